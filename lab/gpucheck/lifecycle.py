"""The engine lifecycle and input checks on a real GPU host, recorded.

Run on a GPU host whose python3 imports vLLM, nvidia-pytriton and llmhost (the
device kit: ../shared/gpu-kit). It serves the generated tiny model with
`llmhost serve --device gpu` (KIND_GPU) and records, under OUT_DIR:

1. import-error: vLLM's AsyncLLM made unimportable in every new interpreter (a .pth
   file that sets its module to None, as a missing dependency would): the load must
   fail within seconds naming the ImportError, and serve must exit.
2. the bounds (seed beyond 2^63-1, JSON nested 100,000 deep, an invalid regex):
   HTTP 400 naming the input, no traceback or path, engine_error unchanged;
3. the admin APIs: POST /v2/logging refused without the key, accepted with it;
4. the EngineCore SIGKILLed while a stream is in flight: the stream's error, the
   model going not ready, serve restarting tritonserver, smoke passing again, and
   no process of the old generation nor /dev/shm segment left; then a SIGTERM stop
   leaving nothing behind.

Usage: python3 -m lab.gpu_lifecycle_check OUT_DIR   (results in OUT_DIR/result.json)
"""

from __future__ import annotations

import json
import os
import re
import signal
import site
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HTTP, GRPC, METRICS = 18500, 18501, 18502
URL = f"http://127.0.0.1:{HTTP}"
MODEL = "tiny"
ENGINE_MARKERS = ("EngineCore", "VLLM::")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def http(method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
         timeout: float = 30, base: str = URL) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, f"{type(exc).__name__}: {exc}"


def ready() -> int:
    return http("GET", f"/v2/models/{MODEL}/ready", timeout=3)[0]


def wait(pred: Any, timeout_s: float, step: float = 0.5) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def serve(model: Path, workdir: Path, logfile: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "llmhost.cli", "serve", "--device", "gpu", "--kind", "KIND_GPU",
           "--model", str(model), "--name", MODEL,
           "--http-port", str(HTTP), "--grpc-port", str(GRPC), "--metrics-port", str(METRICS),
           "--max-model-len", "2048", "--workdir", str(workdir)]
    return subprocess.Popen(cmd, stdout=logfile.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def tree(pid: int) -> list[tuple[int, str]]:
    import psutil

    try:
        return [(p.pid, " ".join(p.cmdline())[:160]) for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(pids: list[int]) -> list[int]:
    import psutil

    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def metric(name: str, label: str) -> float:
    status, text = http("GET", "/metrics", base=f"http://127.0.0.1:{METRICS}")
    total = 0.0
    for line in text.splitlines() if status == 200 else []:
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def smoke(out: Path, name: str) -> int:
    cmd = [sys.executable, "-m", "llmhost.cli", "smoke", "--url", URL, "--grpc-url", f"127.0.0.1:{GRPC}",
           "--metrics-url", f"http://127.0.0.1:{METRICS}", "--model", MODEL, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    (out / f"{name}.json").write_text(proc.stdout + proc.stderr)
    return proc.returncode


def import_error_case(out: Path, model: Path, res: dict[str, Any]) -> None:
    pth = Path(site.getsitepackages()[0]) / "zzz-llmhost-break-asyncllm.pth"
    pth.write_text("import sys; sys.modules['vllm.v1.engine.async_llm'] = None\n")
    try:
        t0 = time.monotonic()
        proc = serve(model, out / "work-import", out / "serve-import-error.log")
        try:
            rc = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = None
        took = time.monotonic() - t0
    finally:
        pth.unlink()
    text = (out / "serve-import-error.log").read_text(errors="replace")
    errors = [line for line in text.splitlines() if "failed to load" in line]
    res["import_error"] = {"serve_rc": rc, "seconds_to_exit": round(took, 1), "load_error": errors[:1],
                           "names_import_error": any(re.search(r"did not start: (ImportError|ModuleNotFoundError)", e)
                                                     for e in errors)}
    log(f"import error case: {res['import_error']}")


def bounds_case(res: dict[str, Any]) -> None:
    before = metric("vllm:request_failed_total", 'reason="engine_error"')
    cases = {
        "seed": {"text_input": "hi", "max_tokens": 4, "seed": 2**64},
        "deep_json": {"text_input": "hi", "sampling_parameters": "[" * 100000 + "]" * 100000},
        "invalid_regex": {"text_input": "hi", "max_tokens": 4, "regex": "(unclosed"},
    }
    out: dict[str, Any] = {}
    for name, body in cases.items():
        status, text = http("POST", f"/v2/models/{MODEL}/generate", body)
        out[name] = {"status": status, "body": text[:300],
                     "leaks": any(s in text for s in ("Traceback", 'File "', "/site-packages/", ".py"))}
    time.sleep(2.5)  # metrics are pushed once a second
    out["engine_error_delta"] = metric("vllm:request_failed_total", 'reason="engine_error"') - before
    res["bounds"] = out
    log(f"bounds: {json.dumps(out)[:600]}")


def admin_case(workdir: Path, res: dict[str, Any]) -> None:
    from llmhost.server.admin_key import HEADER, read_key

    key = read_key(workdir / "admin-key")
    body = {"log_verbose_level": 0}
    res["admin"] = {"logging_without_key": http("POST", "/v2/logging", body)[0],
                    "logging_with_key": http("POST", "/v2/logging", body, headers={HEADER: key})[0],
                    "index_without_key": http("POST", "/v2/repository/index", {})[0],
                    "health_ready": http("GET", "/v2/health/ready")[0]}
    log(f"admin: {res['admin']}")


def stream_until_error(result: dict[str, Any], started: threading.Event) -> None:
    body = {"text_input": "def main():", "max_tokens": 1800, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(f"{URL}/v2/models/{MODEL}/generate_stream", data=json.dumps(body).encode(),
                                 method="POST")
    events = 0
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                events += 1
                started.set()
                data = json.loads(line[5:])
                if "error" in data:
                    result["error"] = data["error"]
                    break
    except Exception as exc:  # noqa: BLE001 - recorded
        result["exception"] = f"{type(exc).__name__}: {exc}"
    result["events"] = events
    result["ended_at"] = time.monotonic()
    started.set()


def kill_case(out: Path, proc: subprocess.Popen[bytes], res: dict[str, Any], shm_before: set[str]) -> None:
    old = tree(proc.pid)
    engines = [pid for pid, cmd in old if "EngineCore" in cmd]
    if not engines:
        import psutil

        engines = [pid for pid, _ in old if any(m in psutil.Process(pid).name() for m in ENGINE_MARKERS)]
    shm_at_kill = set(os.listdir("/dev/shm")) - shm_before  # the old generation's segments
    stream: dict[str, Any] = {}
    started = threading.Event()
    t = threading.Thread(target=stream_until_error, args=(stream, started), daemon=True)
    t.start()
    started.wait(60)
    time.sleep(0.5)
    t_kill = time.monotonic()
    os.kill(engines[0], signal.SIGKILL)
    log(f"SIGKILL EngineCore pid {engines[0]}")
    not_ready = wait(lambda: ready() != 200, 60, 0.2)
    t.join(120)
    new_req = http("POST", f"/v2/models/{MODEL}/generate", {"text_input": "hi", "max_tokens": 4}, timeout=60)
    back = wait(lambda: ready() == 200, 480, 1.0)
    res["engine_kill"] = {
        "engine_pid": engines[0],
        "stream_error": stream.get("error") or stream.get("exception"),
        "stream_events_before_error": stream.get("events"),
        "stream_error_after_s": round(stream.get("ended_at", t_kill) - t_kill, 2),
        "not_ready_after_s": None if not_ready is None else round(not_ready, 2),
        "new_request_during_restart": [new_req[0], new_req[1][:200]],
        "ready_again_after_s": None if back is None else round(time.monotonic() - t_kill, 1),
        "old_processes_left": alive([pid for pid, _ in old if pid not in {p for p, _ in tree(proc.pid)}]),
        "old_shm_left": sorted(shm_at_kill & set(os.listdir("/dev/shm"))),
    }
    res["engine_kill"]["smoke_after_restart_rc"] = smoke(out, "smoke-after-restart") if back is not None else None
    log(f"engine kill: {res['engine_kill']}")


def stop_case(proc: subprocess.Popen[bytes], res: dict[str, Any], shm_before: set[str]) -> None:
    kids = [pid for pid, _ in tree(proc.pid)]
    os.kill(proc.pid, signal.SIGTERM)
    try:
        rc = proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        rc = None
    time.sleep(2)
    res["stop"] = {"serve_rc": rc, "processes_left": alive(kids),
                   "shm_left": sorted(set(os.listdir("/dev/shm")) - shm_before)}
    log(f"stop: {res['stop']}")


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    import vllm

    res["vllm"] = vllm.__version__
    res["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip()
    model = Path("/tmp/lh-tiny")
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "llmhost.cli", "tiny-model", str(model)], check=True)
    shm_before = set(os.listdir("/dev/shm"))
    import_error_case(out, model, res)
    workdir = out / "work"
    proc = serve(model, workdir, out / "serve.log")
    up = wait(lambda: ready() == 200, 480, 1.0)
    res["ready_s"] = None if up is None else round(up, 1)
    log(f"ready after {res['ready_s']} s")
    try:
        if up is not None:
            res["smoke_rc"] = smoke(out, "smoke")
            bounds_case(res)
            admin_case(workdir, res)
            kill_case(out, proc, res, shm_before)
    finally:
        stop_case(proc, res, shm_before)
        (out / "result.json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
