"""Lab: the gateway's gRPC door (Triton's KServe v2 API: tritonclient's asyncio stream,
as `llmhost bench --kind grpc` sends it) against the gateway's OpenAI door
(`/v1/completions`, SSE) on the same server, with llmhost's own client.

Run on a GPU host with the device kit (../shared/gpu-kit, after gpu-setup.sh), from a
folder holding this `lab/` package. It writes the Qwen3-0.6B-shaped random model
(lab.gpucheck.model), starts one `llmhost serve --device gpu` (per engine step:
stream_interval_ms=0) and one `llmhost gateway` in front of it (its engine sockets,
`--grpc-listen`), then per round and door (the order reversed every other round) a
level per concurrency: max(64, 4c) requests of about --prompt-words words, --output
tokens out, ignore_eos, client processes spread as `llmhost bench --processes`.

Per level: tokens per event (per gRPC response, per SSE event), TTFT, the per-token
gap (ITL), tok/s and the client's CPU. OUT/result.json holds every level, the medians
of the per-round ratios grpc / openai and the issue's checks (at most 1.2 tokens per
response, TTFT p50 at most 1.1x and gap p50 at most 1.25x the OpenAI door's).

    python3 -m lab.gpu_grpc_door_check OUT [--rounds 2] [--device gpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lab.gpucheck.speed import get, log, order

NAME = "llm"
KEY = "grpc-door-check-key-0123456789"
SERVE_PORT = 18800  # HTTP; gRPC + 1, metrics + 2
GATEWAY_PORT = 18810  # HTTP; metrics + 1, gRPC door + 2
DOORS = ("openai", "grpc")
GOALS = {"max_tokens_per_response": 1.2, "max_ttft_p50": 1.1, "max_gap_p50": 1.25}


def wait_for(url: str, proc: subprocess.Popen[bytes], timeout_s: float, headers: dict[str, str] | None = None
             ) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}")
        if get(url, headers=headers) == 200:
            return round(time.monotonic() - t0, 1)
        time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def ratios(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: grpc / openai for TTFT p50 and gap p50 in each round where both
    ran, their medians, and the gRPC door's worst tokens per response."""
    rows = []
    for c in sorted({x["concurrency"] for x in levels}):
        pairs = [(g, o) for g in levels for o in levels if g["concurrency"] == o["concurrency"] == c
                 and g["door"] == "grpc" and o["door"] == "openai" and g["round"] == o["round"]]
        ttft = [round(g["ttft_s"]["p50"] / o["ttft_s"]["p50"], 4) for g, o in pairs]
        gap = [round(g["itl_s"]["p50"] / o["itl_s"]["p50"], 4) for g, o in pairs]
        tps = [round(g["output_tokens_per_s"] / o["output_tokens_per_s"], 4) for g, o in pairs]
        worst = max(g["tokens_per_event"] for g, _ in pairs) if pairs else None
        row = {"concurrency": c, "rounds": len(pairs), "ttft_p50": statistics.median(ttft) if ttft else None,
               "gap_p50": statistics.median(gap) if gap else None, "tps": statistics.median(tps) if tps else None,
               "grpc_tokens_per_response_worst": worst, "ttft_rounds": ttft, "gap_rounds": gap, "tps_rounds": tps}
        row["held"] = bool(pairs) and worst is not None and worst <= GOALS["max_tokens_per_response"] \
            and row["ttft_p50"] <= GOALS["max_ttft_p50"] and row["gap_p50"] <= GOALS["max_gap_p50"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--levels", default="1,16,64,256")
    ap.add_argument("--prompt-words", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--model", type=Path, help="a model folder (default: write the Qwen3-0.6B-shaped one)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/grpc-door-work"))
    args = ap.parse_args(argv)
    out, work = args.out.resolve(), args.work.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    from llmhost.bench.compare import write_bench_key
    from llmhost.bench.loadgen import Workload, sweep_processes

    model = args.model
    if model is None:
        from lab.gpucheck.model import make_in_child

        model = Path("/tmp/lh-qwen3")
        make_in_child("qwen3", model)
    py = sys.executable
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    serve_cmd = [py, "-m", "llmhost.cli", "serve", "--device", args.device, "--model", str(model), "--name", NAME,
                 "--http-port", str(SERVE_PORT), "--grpc-port", str(SERVE_PORT + 1),
                 "--metrics-port", str(SERVE_PORT + 2), "--workdir", str(work / "serve"),
                 "--setting", "stream_interval_ms=0"]
    if args.device == "gpu":
        serve_cmd += ["--engine-arg", "max_model_len=4096",
                      "--engine-arg", f"gpu_memory_utilization={args.gpu_memory_utilization}"]
    keys = work / "keys.yml"
    write_bench_key(keys, KEY)
    upstream = f"127.0.0.1:{SERVE_PORT + 1}"
    gateway_cmd = [py, "-m", "llmhost.cli", "gateway", "--listen", f"127.0.0.1:{GATEWAY_PORT}",
                   "--metrics-listen", f"127.0.0.1:{GATEWAY_PORT + 1}", "--grpc-listen",
                   f"127.0.0.1:{GATEWAY_PORT + 2}", "--keys-file", str(keys), "--model", NAME,
                   "--upstream", upstream, "--engine-sockets", f"{upstream}={work / 'serve' / 'engine'}",
                   "--max-concurrent-upstream", "1024", "--log-level", "warning"]
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
                           "device": args.device, "serve": serve_cmd[2:], "gateway": gateway_cmd[2:],
                           "goals": GOALS, "levels": [], "client": "llmhost bench's loadgen (aiohttp SSE; "
                           "tritonclient.grpc.aio stream_infer with authorization metadata), same host"}
    import vllm

    res["vllm"] = vllm.__version__
    if args.device == "gpu":
        res["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
    procs: list[subprocess.Popen[bytes]] = []

    def save() -> None:
        res["ratios"] = ratios(res["levels"])
        (out / "result.json").write_text(json.dumps(res, indent=1) + "\n")

    try:
        with open(out / "serve.log", "wb") as slog:
            procs.append(subprocess.Popen(serve_cmd, stdout=slog, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
        res["serve_ready_s"] = wait_for(f"http://127.0.0.1:{SERVE_PORT}/v2/health/ready", procs[0], 600)
        log(f"serve ready after {res['serve_ready_s']} s")
        with open(out / "gateway.log", "wb") as glog:
            procs.append(subprocess.Popen(gateway_cmd, stdout=glog, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
        res["gateway_ready_s"] = wait_for(f"http://127.0.0.1:{GATEWAY_PORT}/v1/models", procs[1], 120,
                                          {"Authorization": f"Bearer {KEY}"})
        levels = [int(c) for c in args.levels.split(",")]
        for rnd in range(args.rounds):
            for door in order(rnd, DOORS):
                url = f"http://127.0.0.1:{GATEWAY_PORT}" if door == "openai" else f"127.0.0.1:{GATEWAY_PORT + 2}"
                spec = {"kind": door, "url": url, "model": NAME, "api_key": KEY}
                for c in levels:
                    workload = Workload(requests=max(64, 4 * c), prompt_words=args.prompt_words,
                                        output_tokens=args.output, seed=1000 * rnd + c)
                    processes = 1 if c < 16 else 2 if c < 64 else 4
                    (level,), cpu_s = sweep_processes(spec, workload, [c], processes, progress=False)
                    row = {**dataclasses.asdict(level), "door": door, "round": rnd, "processes": processes}
                    res["levels"].append(row)
                    log(f"round {rnd + 1} {door:6} c={c:<3} {level.output_tokens_per_s:8.0f} tok/s  TTFT p50 "
                        f"{level.ttft_s['p50'] * 1000:7.1f} ms  gap p50 {level.itl_s['p50'] * 1000:6.2f} ms  "
                        f"{level.tokens_per_event:.2f} tokens/event  errors {level.errors}/{level.requests}  "
                        f"client {cpu_s:.1f} CPU s")
                    save()
        for row in ratios(res["levels"]):
            log(f"c={row['concurrency']}: grpc/openai TTFT p50 {row['ttft_p50']}x gap p50 {row['gap_p50']}x "
                f"tok/s {row['tps']}x, worst {row['grpc_tokens_per_response_worst']} tokens/response: "
                f"{'held' if row['held'] else 'NOT held'}")
    except Exception as exc:  # noqa: BLE001 - recorded with what was measured before it
        res["exception"] = f"{type(exc).__name__}: {exc}"
        log(f"failed: {res['exception']}")
    finally:
        save()
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=60)
            except ProcessLookupError:
                continue
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    return 0 if "exception" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
