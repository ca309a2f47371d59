"""Where the gateway's first-token time goes: one Triton server, read three ways.

Starts `llmhost serve` (GPU: the Qwen3-0.6B-shaped random model of gpu_speed.py, or
--device cpu: the tiny model) and `llmhost gateway` in front of its gRPC port, then
measures with `llmhost bench` (64-word prompts, 128 output tokens, ignore_eos),
rotating the order each round:

* `http`: Triton's HTTP `/generate_stream` (the native path);
* `grpc`: Triton's gRPC `ModelStreamInfer`, read directly (`--kind grpc`);
* `gateway`: `llmhost gateway` -> Triton gRPC, OpenAI `/v1/completions`;
* `gateway-uvloop` (only if --sides names it): a second gateway beside the first, on
  uvloop (`--event-loop uvloop`; the first runs on asyncio's own loop).

Usage: python3 -m lab.gateway_probe OUT [--device gpu|cpu] [--rounds 2] [--duration 10]
           [--levels 1,16,64] [--processes 8] [--sides http,grpc,gateway]
           [--triton-arg=--FLAG=VALUE ...] [--py-spy PATH]
--triton-arg passes a flag to tritonserver (`llmhost serve --triton-arg`). With --py-spy,
one more round runs each gateway side under `py-spy record` (raw collapsed stacks in
OUT/profile-SIDE.txt); that round's figures are kept apart (`profile_round`).
Writes OUT/probe.json (per round and side: tok/s, TTFT p50 and tokens per event per
level, the CPU seconds of the server's processes and of the gateway, the gateway's open
connections to Triton, its own TTFT p50 from its access log) and OUT/probe.log.

The H100 runs of 2026-11-26 (tests/fixtures/gpu/h100-580.159.04-real/
device-run-2026-11-26-gateway-probe/, docs/performance.md) also had sides made with
temporary switches that are not in the code: `gw4` (the gateway over 4 gRPC
connections), `grpc4` (`--kind grpc` asking for the gateway's outputs) and
`gateway-dense` (the gateway without `sparse_outputs`). In runs 4 and 5 the gateway's
default loop was uvloop: `gateway` ran on uvloop, `gateway-asyncio` on asyncio's loop.
Runs 6 and 7 had `gateway-reuse`: a second gateway keeping its gRPC streams open for
the next request (a prototype, not kept: docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lab.gpucheck import speed
from lab.gpucheck.model import make_in_child


class Serve(speed.Server):
    def __init__(self, device: str, triton_args: list[str], *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.device, self.triton_args = device, triton_args

    def command(self) -> list[str]:
        cmd = super().command()
        if self.device == "cpu":
            cmd[cmd.index("--device") + 1] = "cpu"
            i = cmd.index("--kind")
            del cmd[i:i + 2]
        return cmd + [f"--triton-arg={a}" for a in self.triton_args]


class SecondGateway(speed.Gateway):
    """Another gateway in front of the same Triton, on its own ports and files, with
    more flags (EXTRA)."""

    PORT = speed.PORTS["gateway"] + 5

    def __init__(self, name: str, extra: list[str], upstream: speed.Server, work: Path, env: dict[str, str],
                 max_concurrent: int) -> None:
        super().__init__(upstream, work, env, max_concurrent)
        self.logfile = work / f"{name}.log"
        self.keys_file, self.key_file = work / f"{name}-keys.yml", work / f"{name}-key.txt"
        self.extra = extra

    @property
    def port(self) -> int:  # speed.Gateway.command listens on port and port + 1
        return self.PORT

    def command(self) -> list[str]:
        return super().command() + self.extra


def gateway_ttft(log: Path, offset: int, levels: list[dict[str, Any]]) -> dict[int, float | None]:
    """The gateway's own TTFT p50 (ms) per level, from its access log's lines after OFFSET
    that fall in each level's window."""
    import datetime
    import statistics

    entries = []
    with log.open("rb") as f:
        f.seek(offset)
        for raw in f:
            if raw.startswith(b"{"):
                e = json.loads(raw)
                if e.get("ttft_s") is not None:
                    t = datetime.datetime.fromisoformat(e["time"]).timestamp()
                    entries.append((t, e["ttft_s"]))
    out: dict[int, float | None] = {}
    for lv in levels:
        vals = [v for t, v in entries if lv["started_at"] <= t <= lv["started_at"] + lv["duration_s"]]
        out[lv["concurrency"]] = round(statistics.median(vals) * 1e3, 2) if vals else None
    return out


def upstream_connections(g: speed.Gateway, port: int) -> int:
    """The gateway's open TCP connections to Triton's gRPC port."""
    import psutil

    n = 0
    for pid in g.processes():
        try:
            n += sum(1 for c in psutil.Process(pid).net_connections("tcp") if c.raddr and c.raddr.port == port)
        except psutil.Error:
            continue
    return n


def bench(kind: str, url: str, key: Path | None, levels: str, duration: float, processes: int,
          out: Path) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "llmhost.cli", "bench", "--kind", kind, "--url", url, "--model", speed.NAME,
           "--concurrency", levels, "--duration", str(duration), "--prompt-words", "64", "--output-tokens", "128",
           "--processes", str(processes), "--quiet", "--json", str(out)]
    if key is not None:
        cmd += ["--api-key-file", str(key)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = []
    for lv in json.loads(out.read_text())["levels"]:
        rows.append({"c": lv["concurrency"], "tok_s": round(lv["output_tokens_per_s"]),
                     "ttft_p50_ms": round(lv["ttft_s"].get("p50", 0) * 1e3, 2), "errors": lv["errors"],
                     "tokens_per_event": round(lv["tokens_per_event"], 2)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=10)
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--work", type=Path, default=Path("/tmp/gw-probe"))
    ap.add_argument("--sides", default="http,grpc,gateway")
    ap.add_argument("--triton-arg", action="append", default=[], metavar="--FLAG=VALUE")
    ap.add_argument("--py-spy", type=Path, metavar="PATH", help="profile each gateway side in one more round")
    args = ap.parse_args()
    names = args.sides.split(",")
    if set(names) - {"http", "grpc", "gateway", "gateway-uvloop"} or len(set(names)) != len(names):
        ap.error("--sides: one or more of http, grpc, gateway, gateway-uvloop, each once")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    logf = (args.out / "probe.log").open("a")

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    model = args.work / ("qwen3" if args.device == "gpu" else "tiny")
    make_in_child("qwen3" if args.device == "gpu" else "tiny", model)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1",
               VLLM_CACHE_ROOT=str(args.work / "vllm-cache"), PYTHONUNBUFFERED="1")
    engine: dict[str, Any] = {"max_model_len": 4096 if args.device == "gpu" else 1024}
    if args.device == "gpu":
        engine["gpu_memory_utilization"] = 0.3
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    triton = Serve(args.device, args.triton_arg, "triton", model, args.work, args.out / "serve.log", engine, env)
    gateways: dict[str, speed.Gateway] = {}
    if "gateway" in names:
        gateways["gateway"] = speed.Gateway(triton, args.work, env, 512)
    if "gateway-uvloop" in names:
        gateways["gateway-uvloop"] = SecondGateway("gateway-uvloop", ["--event-loop", "uvloop"], triton,
                                                   args.work, env, 512)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": args.device,
                           "cpus": os.cpu_count(), "levels": args.levels, "duration_s": args.duration,
                           "processes": args.processes, "triton_args": args.triton_arg, "rounds": []}
    try:
        log(f"triton ready after {triton.start()} s")
        for name, g in gateways.items():
            log(f"{name} ready after {g.start()} s")
        grpc_url = f"127.0.0.1:{triton.port + 1}"
        sides: dict[str, tuple[str, str, Path | None, speed.Gateway | None]] = {
            "http": ("http", triton.url, None, None), "grpc": ("grpc", grpc_url, None, None),
            **{name: ("openai", g.url, g.key_file, g) for name, g in gateways.items()}}
        bench("http", triton.url, None, "16", 3, args.processes, args.work / "warm.json")
        rounds = args.rounds + (1 if args.py_spy else 0)
        for r in range(rounds):
            profiling = r == args.rounds
            order = names[r % len(names):] + names[:r % len(names)]
            if profiling:
                order = [n for n in names if n in gateways]
            rnd: dict[str, Any] = {"order": order}
            for name in order:
                kind, url, key, g = sides[name]
                cpu0 = sum(g.cpu_s().values()) if g else None
                server0 = triton.cpu_s()
                offset = g.logfile.stat().st_size if g else 0
                path = args.work / f"r{r}-{name}.json"
                spy = None
                if profiling and g is not None and args.py_spy:
                    pid = next(iter(g.processes()))
                    spy = subprocess.Popen([str(args.py_spy), "record", "--pid", str(pid), "--rate", "200",
                                            "--format", "raw", "--nonblocking", "--output",
                                            str(args.out / f"profile-{name}.txt")],
                                           stdout=logf, stderr=subprocess.STDOUT)
                rows = bench(kind, url, key, args.levels, args.duration, args.processes, path)
                if spy is not None:
                    spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
                    spy.wait(60)
                server1 = triton.cpu_s()
                rnd[name] = {"levels": rows, "server_cpu_s": {k: round(v - server0.get(k, 0.0), 2)
                                                              for k, v in server1.items()}}
                if g:
                    rnd[name]["gateway_ttft_p50_ms"] = gateway_ttft(g.logfile, offset,
                                                                    json.loads(path.read_text())["levels"])
                    rnd[name]["upstream_connections"] = upstream_connections(g, triton.port + 1)
                    rnd[name]["gateway_cpu_s"] = round(sum(g.cpu_s().values()) - cpu0, 2)
                log(f"round {r} {name}: " + "; ".join(
                    f"c={x['c']} {x['tok_s']} tok/s ttft {x['ttft_p50_ms']} ms tpe {x['tokens_per_event']} "
                    f"err {x['errors']}" for x in rows) + f" server cpu {rnd[name]['server_cpu_s']}"
                    + (f" gateway cpu {rnd[name].get('gateway_cpu_s')} own ttft {rnd[name]['gateway_ttft_p50_ms']}"
                       if g else ""))
            if profiling:
                res["profile_round"] = rnd
            else:
                res["rounds"].append(rnd)
            (args.out / "probe.json").write_text(json.dumps(res, indent=2) + "\n")
    finally:
        for g in gateways.values():
            g.stop()
        triton.stop()
        tail = (args.out / "serve.log").read_text(errors="replace").splitlines()[-40:] \
            if (args.out / "serve.log").exists() else []
        (args.out / "serve.log").write_text("\n".join(tail) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
