"""Lab: llmhost's gateway (streaming from the engine sockets) against `vllm serve`, both
measured by vLLM's own client (`vllm bench serve`, in process: llmhost.bench.vllm_client).

Run on a GPU host with the device kit (../shared/gpu-kit, after gpu-setup.sh). It writes
the Qwen3-0.6B-shaped random model (lab.gpucheck.model), starts `llmhost serve
--device gpu` with `llmhost gateway --engine-sockets` in front (the role's defaults) on
the first GPU and vLLM's OpenAI server on the second (both on one GPU, each with a
share of its memory, where there is one), and measures them in alternating order per
round at each concurrency: random prompts of --input-len tokens, --output-len tokens
out, --ignore-eos. The client runs in this process on the same host; its CPU cores,
each serving process tree's CPU cores (gateway, tritonserver, vLLM's server) and each
GPU's utilisation are recorded per level.

Usage: python3 -m lab.stream_compare OUT [--rounds 3] [--concurrency 1,16,64,256] [--door native]
Writes OUT/result.json (every level's numbers and the medians of the per-round ratios
gateway / vllm), OUT/compare.log, the servers' log tails and the gateway's /metrics.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lab.gpucheck.model import make_in_child
from lab.gpucheck.speed import GATEWAY_KEY, NAME, Gateway, Server, order, tail
from llmhost.bench.vllm_client import client_argv, run_level, summarize
from llmhost.gateway.workers import worker_count

SIDES = ("gateway", "vllm")
STREAMING = {
    "gateway": "OpenAI SSE (/v1/completions) through llmhost gateway, which reads the model's engine socket "
               "(one JSON line per engine step, written by the engine's loop in the Triton stub)",
    "vllm": "OpenAI SSE (/v1/completions) from vLLM's own API server, one event per engine step",
}

NATIVE_STREAMING = ("Triton's generate_stream SSE (/v2/models/NAME/generate_stream) through llmhost gateway's "
                    "native door, which reads the model's engine socket (one event per engine step)")


def log(msg: str, out: Path) -> None:
    line = f"{time.strftime('%H:%M:%S')} {msg}"
    print(line, flush=True)
    with (out / "compare.log").open("a") as f:
        f.write(line + "\n")


class SocketGateway(Gateway):
    """The gateway as the role runs it on an inference host: streams through the engine sockets."""

    def command(self) -> list[str]:
        sockets = self.work / self.upstream.side / "engine"
        return [*super().command(), "--engine-sockets", f"127.0.0.1:{self.upstream.port + 1}={sockets}"]


class GpuUse:
    """nvidia-smi every 500 ms: utilisation per GPU index."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, float]] = []
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,"
                                      "nounits", "-lms", "500"], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                index, util = (float(p) for p in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.time(), int(index), util))

    def mean(self, gpu: int, start: float, end: float) -> float | None:
        vals = [u for t, i, u in self.samples if i == gpu and start <= t <= end]
        return round(statistics.fmean(vals), 1) if vals else None

    def close(self) -> None:
        self.proc.terminate()


def tree_cpu_s(server: Any) -> float:
    """CPU seconds so far of SERVER's process and its descendants (0 when not running)."""
    import psutil

    proc = getattr(server, "proc", None)
    if proc is None or proc.poll() is not None:
        return 0.0
    total = 0.0
    try:
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
    except psutil.Error:
        pass
    return total


def requests_for(concurrency: int) -> int:
    return max(32, 4 * concurrency)


def ratios(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per level: the medians over rounds of gateway / vllm (tok/s, TTFT p50, ITL p50) and the
    worst tokens per event of each side."""
    rows = []
    levels = sorted({r["concurrency"] for r in runs["vllm"]})
    for c in levels:
        pairs = [(g, v) for g in runs["gateway"] for v in runs["vllm"]
                 if g["concurrency"] == v["concurrency"] == c and g["round"] == v["round"]]
        if not pairs:
            continue

        def med(key: Any, pairs: list[tuple[dict[str, Any], dict[str, Any]]] = pairs) -> float:
            return round(statistics.median(key(g) / key(v) for g, v in pairs if key(v)), 3)

        rows.append({"concurrency": c, "rounds": len(pairs),
                     "tps": med(lambda r: r["output_tokens_per_s"]), "ttft_p50": med(lambda r: r["ttft_ms"]["median"]),
                     "itl_p50": med(lambda r: r["itl_ms"]["median"]),
                     "tokens_per_event": {s: max(r["tokens_per_event"] for r in runs[s] if r["concurrency"] == c)
                                          for s in SIDES},
                     "failed": {s: sum(r["failed"] for r in runs[s] if r["concurrency"] == c) for s in SIDES}})
    return rows


def workload_parser(doc: str, rounds: int, concurrency: str) -> argparse.ArgumentParser:
    """The arguments every comparison takes: OUT, rounds, levels, prompt and output lengths."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--concurrency", default=concurrency)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    return ap


def measure_level(url: str, model: str, tokenizer: Path, concurrency: int, rnd: int | None, input_len: int,
                  output_len: int, api_key: str | None, kind: str = "openai") -> tuple[dict[str, Any], float, float]:
    """One level by vLLM's client (round RND; None: a warm-up of CONCURRENCY requests): its
    numbers with the client's CPU cores, and when it started and ended. KIND: OpenAI's
    /v1/completions, or ``http`` for Triton's generate_stream."""
    argv = client_argv(url, model, str(tokenizer), concurrency,
                       requests_for(concurrency) if rnd is not None else concurrency, input_len, output_len,
                       seed=rnd or 0, kind=kind)
    cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.time()
    result = run_level(argv, api_key)
    cpu1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.time()
    level = summarize(concurrency, result).__dict__
    level.update(round=rnd, started=t0,
                 client_cpu_cores=round((cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime)
                                        / max(t1 - t0, 1e-9), 2))
    return level, t0, t1


def level_line(rnd: int, side: str, level: dict[str, Any], extra: str) -> str:
    return (f"round {rnd + 1} {side:8} c={level['concurrency']:<4} {level['output_tokens_per_s']:9.1f} tok/s  "
            f"TTFT p50 {level['ttft_ms']['median']:8.1f} ms  ITL p50 {level['itl_ms']['median']:6.2f} ms  "
            f"{level['tokens_per_event']:.2f} tok/event  failed {level['failed']}  client "
            f"{level['client_cpu_cores']} cores  {extra}")


def alternate(res: dict[str, Any], rounds: int, levels: list[int], measure: Any, out: Path,
              save: Any, note: Any) -> None:
    """ROUNDS rounds, the sides in turn (their order turning each round), every level of
    one side before the other's: each level's numbers into RES and the log."""
    for rnd in range(rounds):
        for side in order(rnd, list(SIDES)):
            res["order"].append(f"round {rnd + 1}: {side}")
            for c in levels:
                level = measure(side, c, rnd)
                res["runs"][side].append(level)
                log(level_line(rnd, side, level, note(level)), out)
                save()


def main(argv: list[str] | None = None) -> int:
    ap = workload_parser(__doc__ or "", 3, "1,16,64,256")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--work", type=Path, default=Path("/tmp/stream-compare-work"))
    ap.add_argument("--door", choices=("openai", "native"), default="openai",
                    help="the gateway's door to measure: OpenAI's /v1/completions, or Triton's generate_stream "
                         "(the native API through the gateway, llmhost.bench.vllm_client's request function)")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    import torch
    import vllm

    gpus = torch.cuda.device_count()
    one_gpu = gpus < 2
    share = 0.3 if one_gpu else 0.85
    engine: dict[str, Any] = {"served_model_name": NAME, "max_model_len": args.max_model_len,
                              "gpu_memory_utilization": share}
    model = Path("/tmp/lh-qwen3")
    make_in_child("qwen3", model)
    base_env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1",
                    DO_NOT_TRACK="1", VLLM_CACHE_ROOT=str(args.work / "vllm-cache"), PYTHONUNBUFFERED="1")
    gpu_of = {"triton": 0, "vllm": 0 if one_gpu else 1}
    triton = Server("triton", model, args.work, args.work / "serve-triton.log", engine,
                    {**base_env, "CUDA_VISIBLE_DEVICES": str(gpu_of["triton"])})
    vllm_side = Server("vllm", model, args.work, args.work / "vllm-server.log", engine,
                       {**base_env, "CUDA_VISIBLE_DEVICES": str(gpu_of["vllm"])})
    gateway = SocketGateway(triton, args.work, base_env, 2 * max(levels))
    servers = {"gateway": gateway, "vllm": vllm_side}
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm": vllm.__version__,
        "gpus": subprocess.run(["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"],
                               capture_output=True, text=True).stdout.strip().splitlines(),
        "cpus": os.cpu_count(), "placement": {"llmhost": gpu_of["triton"], "vllm": gpu_of["vllm"]},
        "workload": {"client": "vllm bench serve (in process, llmhost.bench.vllm_client), on the same host",
                     "dataset": "random", "input_len": args.input_len, "output_len": args.output_len,
                     "ignore_eos": True, "concurrency": levels,
                     "requests": {c: requests_for(c) for c in levels}},
        "engine_args": engine, "door": args.door, "gateway_workers": worker_count(0),
        "streaming": {**STREAMING, "gateway": NATIVE_STREAMING} if args.door == "native" else STREAMING,
        "runs": {s: [] for s in SIDES}, "order": []}
    gpu_use = GpuUse()

    def save() -> None:
        res["ratios"] = ratios(res["runs"])
        (out / "result.json").write_text(json.dumps(res, indent=1) + "\n")

    # The processes that serve each side: their CPU cores per level say what limited it.
    parts = {"gateway": {"gateway": gateway, "triton": triton}, "vllm": {"vllm": vllm_side}}

    def measure(side: str, concurrency: int, rnd: int | None) -> dict[str, Any]:
        cpu0 = {name: tree_cpu_s(server) for name, server in parts[side].items()}
        kind = "http" if side == "gateway" and args.door == "native" else "openai"
        level, t0, t1 = measure_level(servers[side].url, NAME, model, concurrency, rnd, args.input_len,
                                      args.output_len, GATEWAY_KEY if side == "gateway" else None, kind)
        level.update(side=side, gpu_util_pct=gpu_use.mean(gpu_of["triton" if side == "gateway" else "vllm"], t0, t1),
                     server_cpu_cores={name: round((tree_cpu_s(server) - cpu0[name]) / max(t1 - t0, 1e-9), 2)
                                       for name, server in parts[side].items()})
        return level

    try:
        for server in (triton, gateway, vllm_side):  # one after the other: on one GPU, memory is taken in turn
            server.start()
        for side in SIDES:
            measure(side, 64, None)  # warm-up, not recorded
        log("servers up and warm", out)
        alternate(res, args.rounds, levels, measure, out, save,
                  lambda level: f"GPU {level['gpu_util_pct']}%  server cores {level['server_cpu_cores']}")
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{gateway.port + 1}/metrics")
        with urllib.request.urlopen(req, timeout=10) as r:
            (out / "gateway-metrics.txt").write_text(r.read().decode())
        for row in res["ratios"]:
            log(f"c={row['concurrency']}: gateway/vllm tok/s {row['tps']}x TTFT {row['ttft_p50']}x "
                f"ITL {row['itl_p50']}x tok/event {row['tokens_per_event']} failed {row['failed']}", out)
    finally:
        save()
        gpu_use.close()
        for server in (gateway, triton, vllm_side):
            server.stop()
        for name in ("serve-triton.log", "vllm-server.log", "gateway.log"):
            if (args.work / name).exists():
                tail(args.work / name, out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
