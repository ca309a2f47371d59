#!/usr/bin/env python3
"""`make bench-compare`: llmhost's paths against vLLM's own OpenAI server.

Three paths, the same tiny model, engine arguments and workload: `triton` (our
backend's `/generate_stream`, HTTP SSE), `gateway` (the same Triton behind
`llmhost gateway`, OpenAI `/v1/completions` with an API key) and `vllm` (vLLM's
OpenAI server). They never run at the same time (vLLM's CPU workers would compete
for the cores): each round starts one, measures it, stops it, then the next, the
order rotating by one each round. Reports per concurrency level the median of the
per-round ratios against the goals of llmhost.bench.compare, the gateway's CPU per
output token, and writes JSON and a PNG under bench-results/. Not a test: it prints
numbers and gates nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

from llmhost.backend.config import BackendSettings
from llmhost.backend.cpus import pin_threads
from llmhost.bench.compare import (
    GOALS,
    PATHS,
    Goal,
    check,
    client_cpus,
    compare,
    gateway_args,
    round_order,
    write_bench_key,
)
from llmhost.bench.loadgen import LevelResult, Target, Workload, plot, sweep, table
from llmhost.tiny.model import write_tiny_model

MAX_MODEL_LEN = 1024
# The CPUs this script may use, read before the load generator is pinned.
ALL_CPUS = frozenset(os.sched_getaffinity(0))


# The servers run below the load generator's priority. The client shares this
# machine's cores with the server under test; Linux groups CPU time by session
# (autogroups, on by default), and in its own session a server starved the client
# here: in 15 s at concurrency 64 the client ran 0.05 s and waited 16.6 s to run,
# so a level measured the client. Both servers get the same treatment.
SERVER_NICE = 10
# The gateway runs ahead of the servers, as its unit puts it (CPUWeight 1000 against
# tritonserver's 100): in a session of its own at nice 0 it weighs 1024 against the
# servers' 110. At equal weight, vLLM's busy-waiting engine delayed the gateway's
# streams by up to a whole response (docs/performance.md, 2026-11-25).
GATEWAY_NICE = 0


def frontend_cpus(proc: subprocess.Popen[bytes]) -> set[int] | None:
    """The CPUs our backend moved tritonserver to (off vLLM's worker cores:
    llmhost.backend.cpus), for the gateway to run on as well, as a CPU host's
    `gateway_cpu_affinity` puts it; None when tritonserver was left on every CPU."""
    root = psutil.Process(proc.pid)
    for p in [root, *root.children(recursive=True)]:
        if p.name() == "tritonserver":
            cpus = set(p.cpu_affinity())
            return cpus if cpus != ALL_CPUS else None
    return None


def server_client_cpus(proc: subprocess.Popen[bytes]) -> set[int]:
    """The CPUs the server's bound vLLM workers leave free (llmhost.bench.compare.client_cpus)."""
    processes = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            processes.append((p.name(), set(p.cpu_affinity())))
        except psutil.Error:
            continue
    return client_cpus(set(ALL_CPUS), processes)


def start(cmd: list[str], env: dict[str, str], ready_url: str, log: Path,
          headers: dict[str, str] | None = None, nice: int = SERVER_NICE,
          cpus: set[int] | None = None) -> subprocess.Popen[bytes]:
    priority = ("nice", "-n", str(nice), "sh", "-c", f'echo {nice} > /proc/self/autogroup 2>/dev/null; exec "$@"',
                "server")
    with log.open("ab") as out:
        proc = subprocess.Popen([*priority, *cmd], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                # Every CPU unless told: not the load generator's (it inherits this
                                # process's mask, and vLLM binds its workers within it).
                                preexec_fn=lambda: os.sched_setaffinity(0, cpus or ALL_CPUS))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log}")
        try:
            if requests.get(ready_url, timeout=2, headers=headers).status_code == 200:
                return proc
        except requests.RequestException:
            pass
        time.sleep(1)
    raise SystemExit(f"server not ready after 300 s; see {log}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    kids = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _, alive = psutil.wait_procs(kids, timeout=30)
    for p in alive:
        p.kill()
    time.sleep(2)  # let the cores go quiet before the next server


class StallProbe:
    """Sleeps 10 ms at a time and sums how late it wakes beyond 100 ms.

    It runs in the load generator's process, so it tells how long the client itself
    could not run during a level (the server under test or anything else took its
    CPU): a level with many such stalls measured the client, not the server.
    """

    def __init__(self) -> None:
        self.late: list[tuple[float, float]] = []
        threading.Thread(target=self._run, daemon=True, name="stall-probe").start()

    def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            time.sleep(0.01)
            late = time.monotonic() - t0 - 0.01
            if late > 0.1:
                self.late.append((t0, late))

    def stalled_s(self, since: float, until: float) -> float:
        return sum(late for t, late in self.late if since <= t < until)


def _switches(pid: int) -> float:
    """Context switches of every thread of PID so far."""
    n = 0.0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            for line in status.read_text().splitlines():
                if "ctxt_switches:" in line:  # voluntary and nonvoluntary
                    n += float(line.split()[1])
        except OSError:
            continue
    return n


def cpu_seconds(proc: subprocess.Popen[bytes]) -> dict[str, float]:
    """CPU seconds (user + system) and context switches (`<name>:switches`) so far of
    the server and each of its processes, by name, and the whole machine's context
    switches (`ctxt`)."""
    out: dict[str, float] = {}
    root = psutil.Process(proc.pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            name = p.name()
        except psutil.Error:
            continue
        out[name] = out.get(name, 0.0) + t.user + t.system
        out[name + ":switches"] = out.get(name + ":switches", 0.0) + _switches(p.pid)
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("ctxt "):
            out["ctxt"] = float(line.split()[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--duration", type=float, help="seconds per level instead of a request count")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                    help="a backend setting for the Triton paths (llmhost serve --setting), repeatable")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"which to run, of {', '.join(PATHS)}")
    ap.add_argument("--gateway-arg", action="append", default=[], metavar="--FLAG=VALUE",
                    help="a flag for `llmhost gateway` on the gateway path, repeatable (e.g. --event-loop=asyncio)")
    ap.add_argument("--client-cpus", choices=("auto", "all"), default="auto",
                    help="auto: run the load generator on the CPUs the first server's vLLM workers leave "
                         "free, for every path (all: anywhere, as runs before this option did)")
    args = ap.parse_args()
    names = [n for n in args.paths.split(",") if n]
    if not names or set(names) - set(PATHS) or len(set(names)) != len(names):
        ap.error(f"--paths: one or more of {', '.join(PATHS)}, each once")
    levels = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="llmhost-bench-"))
    model = write_tiny_model(work / "tiny", seed=0)
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1",
               VLLM_CACHE_ROOT=str(work / "vllm-cache"))
    engine = ["--max-model-len", str(MAX_MODEL_LEN)]
    triton_cmd = [str(bin_dir / "llmhost"), "serve", "--model", str(model), "--name", "tiny", "--device", "cpu",
                  "--http-port", "18800", "--grpc-port", "18801", "--metrics-port", "18802",
                  "--workdir", str(work / "triton"), *engine, "--setting", "pin_frontend_cpus=true",
                  *(a for kv in args.setting for a in ("--setting", kv))]
    key = "bench-" + os.urandom(16).hex()
    keys_file = work / "gateway-keys.yml"
    write_bench_key(keys_file, key)
    gateway_cmd = [str(bin_dir / "llmhost"), "gateway", *gateway_args(
        "127.0.0.1:18801", "127.0.0.1:18820", "127.0.0.1:18821", keys_file, "tiny", max(levels) * 2),
        *args.gateway_arg]
    vllm_cmd = [str(bin_dir / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", "18810", "--enforce-eager",
                "--dtype", "bfloat16", "--disable-log-stats", *engine]
    triton = (triton_cmd, "http://127.0.0.1:18800/v2/models/tiny/ready", None)
    auth = {"Authorization": f"Bearer {key}"}
    # Each path: the processes to start in order (command, ready URL, headers) and the target.
    paths: dict[str, tuple[list[tuple[list[str], str, dict[str, str] | None]], Target]] = {
        "triton": ([triton], Target("http", "http://127.0.0.1:18800", "tiny")),
        "gateway": ([triton, (gateway_cmd, "http://127.0.0.1:18820/v1/models", auth)],
                    Target("openai", "http://127.0.0.1:18820", "tiny", api_key=key)),
        "vllm": ([(vllm_cmd, "http://127.0.0.1:18810/health", None)],
                 Target("openai", "http://127.0.0.1:18810", "tiny")),
    }
    workload = Workload(requests=args.requests, duration_s=args.duration, prompt_words=args.prompt_words,
                        output_tokens=args.output_tokens)
    runs: dict[str, list[list[LevelResult]]] = {n: [] for n in names}
    stalls: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    probe = StallProbe()
    gateway_cpus: list[list[int]] = []
    # Where the load generator runs (empty: anywhere); None until the first server shows it.
    client: set[int] | None = set() if args.client_cpus == "all" else None
    for rnd in range(args.rounds):
        for name in round_order(names, rnd):
            procs_spec, target = paths[name]
            print(f"round {rnd + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            procs: list[tuple[str, subprocess.Popen[bytes]]] = []
            try:
                for cmd, ready, headers in procs_spec:
                    label = "gateway" if cmd is gateway_cmd else "triton" if cmd is triton_cmd else name
                    nice = GATEWAY_NICE if label == "gateway" else SERVER_NICE
                    cpus = frontend_cpus(procs[0][1]) if label == "gateway" else None
                    if cpus:
                        gateway_cpus.append(sorted(cpus))
                    procs.append((label, start(cmd, env, ready, args.out / f"{label}.log", headers, nice, cpus)))
                if client is None:
                    # Every thread of this process: the load generator and the stall probe.
                    client = server_client_cpus(procs[0][1])
                    if client:
                        pin_threads(os.getpid(), client)
                    print(f"the load generator runs on CPUs {sorted(client) or 'any'}", file=sys.stderr, flush=True)
                t0 = time.monotonic()
                cpu0 = {label: cpu_seconds(p) for label, p in procs}
                results = asyncio.run(sweep(target, workload, levels, progress=True))
                used: dict[str, float] = {}
                for label, p in procs:
                    prefix = "gateway:" if label == "gateway" else ""
                    for k, v in cpu_seconds(p).items():
                        if k != "ctxt":
                            used[prefix + k] = round(v - cpu0[label].get(k, 0.0), 2)
            finally:
                for _, p in reversed(procs):
                    stop(p)
            stalled = probe.stalled_s(t0, time.monotonic())
            print(table(results), flush=True)
            print(f"  client stalls (the load generator could not run): {stalled:.1f} s; "
                  f"CPU s by process: {used}", flush=True)
            cpu[name].append(used)
            runs[name].append(results)
            stalls[name].append(round(stalled, 2))

    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "cpus": os.cpu_count(),
            "rounds": args.rounds, "workload": workload.__dict__, "max_model_len": MAX_MODEL_LEN,
            "llmhost_settings": BackendSettings().__dict__, "llmhost_setting_overrides": args.setting,
            "gateway_arg_overrides": args.gateway_arg,
            "server_nice": SERVER_NICE, "gateway_nice": GATEWAY_NICE, "paths": names,
            "gateway_cpus": gateway_cpus, "client_cpus": sorted(client or ()) or "any",
            "streaming": {"triton": "HTTP SSE from the backend, one response per engine step unless "
                                    "stream_interval_ms (llmhost_settings) groups them",
                          "gateway": "OpenAI SSE, one chunk per backend response (grouped the same way)",
                          "vllm": "OpenAI SSE, one event per engine step",
                          "merged": "vLLM's output collector merges a request's steps when its reader falls "
                                    "behind, on every path: each level's tokens_per_event says how it went"}}
    record: dict[str, object] = {"meta": meta, "stalls_s": stalls, "cpu_s": cpu,
                                 "runs": {k: [[r.__dict__ for r in rs] for rs in v] for k, v in runs.items()}}
    if "gateway" in runs:
        tokens = [sum(r.output_tokens_per_s * r.duration_s for r in rs) for rs in runs["gateway"]]
        per_token = [sum(v for k, v in c.items() if k.startswith("gateway:") and ":switches" not in k) / t
                     for c, t in zip(cpu["gateway"], tokens, strict=True) if t]
        if per_token:
            record["gateway_cpu_ms_per_token"] = round(statistics.median(per_token) * 1000, 3)
            print(f"\nthe gateway's own CPU per output token (median of rounds): "
                  f"{record['gateway_cpu_ms_per_token']} ms")
    comparisons: list[tuple[str, str, Goal | None]] = [(g.path, g.base, g) for g in GOALS]
    comparisons.append(("triton", "vllm", None))  # no goal here: the speed goal is the GPU's
    summary: dict[str, object] = {}
    for path, base, goal in comparisons:
        if path not in runs or base not in runs:
            continue
        pair = f"{path}/{base}"
        rows = compare(runs, path, base)
        misses = check(goal, rows) if goal is not None else []
        summary[pair] = {"rows": rows, "goal": goal.__dict__ if goal else None, "misses": misses}
        print(f"\n{path} / {base}, medians over {args.rounds} rounds:")
        print(f"{'conc':>4} {path + ' tok/s':>16} {base + ' tok/s':>14} {'ratio':>6} {'TTFT p50':>9} {base:>8} "
              f"{'TTFT ratio':>10}")
        for row in rows:
            print(f"{row['concurrency']:>4} {row[path + '_tokens_per_s']:>16.1f} {row[base + '_tokens_per_s']:>14.1f} "
                  f"{row['tps_ratio']:>6.2f} {row[path + '_ttft_p50_s'] * 1000:>7.0f}ms "
                  f"{row[base + '_ttft_p50_s'] * 1000:>6.0f}ms {row['ttft_ratio']:>10.2f}")
        if goal is not None:
            print("  goal met" if not misses else "  goal missed: " + "; ".join(misses))
    (args.out / "compare.json").write_text(json.dumps({**record, "summary": summary}, indent=2) + "\n")
    labels = {"triton": "llmhost (Triton, HTTP SSE)", "gateway": "llmhost gateway (OpenAI SSE)",
              "vllm": "vLLM OpenAI server"}
    median_run = {labels[name]: [sorted((r[i] for r in rs), key=lambda x: x.output_tokens_per_s)[len(rs) // 2]
                                 for i in range(len(levels))] for name, rs in runs.items()}
    plot(median_run, args.out / "compare.png", f"tiny model, {os.cpu_count()} CPU cores, {meta['date']}")
    print(f"\nwrote {args.out / 'compare.json'} and {args.out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
