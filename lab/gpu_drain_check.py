"""Drain on stop on a real GPU host, recorded: streams in flight at SIGTERM finish (the
backend drains on the stop file), and those that outlive the drain end with an error.

Run on a GPU host whose python3 imports vLLM, nvidia-pytriton and llmhost (the device
kit: ../shared/gpu-kit). Serves the generated tiny model with `llmhost serve --device
gpu` (KIND_GPU) twice and records, under OUT_DIR/result.json:

1. complete: 32 streams of 400 tokens in flight for sure (vLLM's engine processes
   frozen with SIGSTOP while they arrive and until the backend has begun draining,
   then thawed), then SIGTERM of serve: every stream must complete, serve exit 0,
   no process and no /dev/shm segment left, the backend's "draining" line in the log;
2. aborted: the same with --drain-timeout 3 and the engine left frozen past the
   drain: every stream must end with the shutting-down error, then the same clean stop.

Usage: python3 -m lab.gpu_drain_check OUT_DIR [complete] [aborted]   (default: both)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from lab.gpucheck.check import stream_tokens
from lab.gpucheck.lifecycle import GRPC, HTTP, METRICS, MODEL, URL, alive, log, ready, tree, wait

STREAMS, TOKENS = 32, 400


def serve(model: Path, workdir: Path, logfile: Path, drain_s: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "llmhost.cli", "serve", "--device", "gpu", "--model", str(model), "--name", MODEL,
           "--http-port", str(HTTP), "--grpc-port", str(GRPC), "--metrics-port", str(METRICS),
           "--max-model-len", "2048", "--workdir", str(workdir), "--drain-timeout", str(drain_s)]
    return subprocess.Popen(cmd, stdout=logfile.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def stream(outcome: dict[str, Any]) -> None:
    """One stream of TOKENS from the served model, its tokens (each response counts its own)
    or its error into OUTCOME."""
    stream_tokens(outcome, threading.Event(), url=URL, max_tokens=TOKENS, model=MODEL)


def engine_procs(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    out = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if p.name().startswith("VLLM::") or "EngineCore" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def case(name: str, model: Path, out: Path, drain_s: int, thaw_after_s: float) -> dict[str, Any]:
    """Serve, freeze the engine, start the streams, SIGTERM serve, thaw after THAW_AFTER_S."""
    res: dict[str, Any] = {"drain_timeout_s": drain_s, "streams": STREAMS, "tokens": TOKENS}
    shm_before = set(os.listdir("/dev/shm"))
    logfile = out / f"serve-{name}.log"
    proc = serve(model, out / f"work-{name}", logfile, drain_s)
    up = wait(lambda: ready() == 200, 480, 1.0)
    res["ready_s"] = None if up is None else round(up, 1)
    log(f"{name}: ready after {res['ready_s']} s")
    if up is None:
        proc.kill()
        return res
    kids = [pid for pid, _ in tree(proc.pid)]
    engine = engine_procs(proc)
    res["engine_processes"] = [p.name() for p in engine]
    outcomes: list[dict[str, Any]] = [{} for _ in range(STREAMS)]
    threads = [threading.Thread(target=stream, args=(o,)) for o in outcomes]
    for p in engine:
        p.send_signal(signal.SIGSTOP)
    try:
        for t in threads:
            t.start()
        time.sleep(3)  # every request reaches the backend; no token can come
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(thaw_after_s)
    finally:
        for p in engine:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
    for t in threads:
        t.join(timeout=300)
    try:
        rc = proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        rc = None
    res["stop_s"] = round(time.monotonic() - t0, 1)
    time.sleep(2)
    res["serve_rc"] = rc
    res["complete"] = sum(1 for o in outcomes if o.get("tokens") == TOKENS)
    res["errors"] = sorted({str(o["error"]) for o in outcomes if "error" in o})
    res["errored"] = sum(1 for o in outcomes if "error" in o)
    res["processes_left"] = alive(kids)
    res["shm_left"] = sorted(set(os.listdir("/dev/shm")) - shm_before)
    text = logfile.read_text(errors="replace")
    res["draining_logged"] = "draining (tritonserver is stopping)" in text
    res["aborted_logged"] = "drain time over: aborting" in text
    log(f"{name}: {json.dumps(res)}")
    return res


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import vllm

    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm": vllm.__version__,
                           "gpu": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                                                  "--format=csv,noheader"], capture_output=True,
                                                 text=True).stdout.strip()}
    model = Path("/tmp/lh-tiny")
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "llmhost.cli", "tiny-model", str(model)], check=True)
    cases = sys.argv[2:] or ["complete", "aborted"]
    try:
        if "complete" in cases:
            # The backend sees the stop file within a second: thaw 2 s after the SIGTERM.
            res["complete"] = case("complete", model, out, drain_s=30, thaw_after_s=2.0)
        if "aborted" in cases:
            # Thawed only after the drain (3 s) is over: every stream is aborted with the error.
            res["aborted"] = case("aborted", model, out, drain_s=3, thaw_after_s=6.0)
    finally:
        (out / "result.json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
