"""The GPU speed run: the Triton path against vLLM's own OpenAI server.

Run on a GPU host whose python3 imports vLLM, nvidia-pytriton and llmhost (the device
kit: ../shared/gpu-kit, after gpu-setup.sh). It writes the Qwen3-0.6B-shaped random
model of gpu_check.py and measures, with `llmhost bench` spread over several client
processes (64-word prompts, 128 output tokens, ignore_eos, a fixed duration per
concurrency level):

* `triton`: `llmhost serve --device gpu --setting stream_interval_ms=0` (the default
  since 2026-11-25, given explicitly for older runs' sake), one response per engine
  step (vLLM's server sends one SSE event per token), through Triton's HTTP
  `/generate_stream`;
* `vllm`: `python3 -m vllm.entrypoints.openai.api_server` with the same engine
  arguments, through `/v1/completions` (`--kind openai`);
* `grouped` (unless --no-grouped): `llmhost serve --setting stream_interval_ms=50`, the
  stream window (the default before 2026-11-25), beside the pair, compared with vLLM too.

* `uvloop` (with --uvloop): the `triton` server with the engine thread's loop on uvloop
  (LLMHOST_EVENT_LOOP=uvloop);
* `variant` (with --variant KEY=VALUE ...): the `triton` server with those backend settings;
* `gateway` (with --gateway, --servers together): `llmhost gateway` in front of the `triton`
  side's server (its gRPC port), an API key from a keys file, through `/v1/completions`
  (`--kind openai --api-key-file`): the OpenAI API path, measured against `triton` and
  `vllm` (the gateway's goals, bench_compare.GOALS); its CPU seconds are recorded per
  measurement like the servers'.

Each round measures `triton` and `vllm` (and `uvloop`, `variant`, `gateway`), rotating which goes
first, then `grouped`.
--servers apart starts each server before its measurement and stops it after (a
start costs 1-2 minutes of CUDA graphs and torch.compile); --servers together (the
default) starts all of them once, each with the same GPU memory share, and measures
one at a time while the others idle (their CPU seconds are recorded per measurement
to show it). While a sweep runs, nvidia-smi is sampled (utilisation, memory, power)
and so is the machine's CPU use (/proc/stat), per level; and (unless --no-watch) every
thread of the measured server's processes (CPU, run-queue wait, timeslices: Watch,
thread_level), with OS threads named after Python threads for the run (a .pth hook;
--no-thread-names), and its metrics page (vLLM's scheduler gauges, latency histograms and
token counter, Triton's queue counters: gauge_level).

Usage: python3 -m lab.gpu_speed OUT_DIR [--rounds 3] [--duration 12] [--processes 8]
Writes OUT_DIR/result.json (every sweep's levels, server CPU, GPU and CPU samples per
level, the engine config both sides logged, and the medians of the per-round ratios
against the speed goal and the gateway's), speed.log, the servers' log tails (serve-triton.log,
serve-grouped.log, vllm-server.log, gateway.log), gpu-samples.csv and nvidia-smi.txt: few files,
as the lent GPU machine returns at most 8. The H100 runs are in
tests/fixtures/gpu/h100-580.159.04-real/device-run-2026-11-24-speed2/ (its test:
tests/records/test_h100_speed_triton_against_vllm.py) and device-run-2026-11-25-{apart,variants}/
(tests/records/test_h100_speed_gap_per_thread.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from lab.gpucheck.model import make_in_child

NAME = "llm"
SIDES = ("triton", "vllm", "grouped", "uvloop", "variant", "gateway")
PORTS = {"triton": 18600, "grouped": 18610, "vllm": 18620, "uvloop": 18630, "variant": 18640, "gateway": 18650}
LOGS = {"triton": "serve-triton.log", "grouped": "serve-grouped.log", "vllm": "vllm-server.log",
        "uvloop": "serve-uvloop.log", "variant": "serve-variant.log", "gateway": "gateway.log"}
KINDS = {"triton": "http", "grouped": "http", "vllm": "openai", "uvloop": "http", "variant": "http",
         "gateway": "openai"}
STREAMING = {
    "triton": "Triton HTTP SSE (/generate_stream), stream_interval_ms=0: one response per engine step",
    "grouped": "Triton HTTP SSE (/generate_stream), stream_interval_ms=50: deltas grouped per stream",
    "vllm": "OpenAI SSE (/v1/completions), one event per engine step",
    "uvloop": "as triton, with the engine thread's loop on uvloop (LLMHOST_EVENT_LOOP=uvloop)",
    "variant": "as triton, with the backend settings of --variant",
    "gateway": "OpenAI SSE (/v1/completions) through llmhost gateway -> Triton gRPC -> the triton side's server "
               "(stream_interval_ms=0): one event per engine step",
}
# Sides beside the pair: one that does not start is skipped, the pair goes on.
OPTIONAL = ("uvloop", "variant", "grouped", "gateway")
GATEWAY_KEY = "gpu-speed-bench-key"
# The per-step Triton path and its variants: the same settings but for an env var (uvloop)
# or the backend settings given with --variant.
PER_STEP = ("triton", "uvloop", "variant")
GROUPED_MS = 50  # the grouped side's stream window
SIDE_ENV = {"uvloop": {"LLMHOST_EVENT_LOOP": "uvloop"}}
# The speed goal: the per-step Triton path at least 0.97x vLLM's server's tokens/s and at
# most 1.10x its TTFT p50, at every level.
GOAL = {"path": "triton", "base": "vllm", "min_tps_ratio": 0.97, "max_ttft_ratio": 1.10}
# Lines of a server's log kept whatever the tail: the engine's config and scheduler.
KEEP = re.compile(r"Initializing a V1 LLM engine|non-default args|max_num_batched_tokens|max_num_seqs|"
                  r"KV cache|Maximum concurrency|graph capturing|torch.compile t|Directly load|ready|"
                  r"Traceback|Error|error|event loop")
ENGINE_CONFIG = re.compile(r"Initializing a V1 LLM engine \((v[^)]*)\) with config: (.*)$")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def get(url: str, timeout: float = 3, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return int(r.status)
    except OSError:
        return 0


# --- pure helpers (unit-tested) --------------------------------------------------------

def engine_config(text: str) -> dict[str, str]:
    """The engine config line vLLM logs at start (`Initializing a V1 LLM engine (vX) with
    config: ...`): version and config, with the served model's own port- or path-free
    parts kept as logged. Empty when the log has none."""
    for line in text.splitlines():
        m = ENGINE_CONFIG.search(line)
        if m:
            return {"version": m.group(1), "config": m.group(2).strip()}
    return {}


def order(rnd: int, sides: tuple[str, ...] | list[str] = ("triton", "vllm")) -> list[str]:
    """The order of SIDES in round RND (from 0), rotated by one a round: for the pair, the
    Triton path first in even rounds; each of n sides goes first once in n rounds."""
    k = rnd % len(sides)
    return [*sides[k:], *sides[:k]]


# --- per-thread CPU and the scheduler's gauges (pure parts unit-tested) ------------------

# Installed (as a .pth in the image's site-packages) for the run and removed after it:
# every Python thread of every python3 process (the stub, vLLM's API server, EngineCore)
# gives its name to its OS thread, as Python 3.14 does, so /proc/<pid>/task/*/comm tells
# them apart. Threads that C/C++ code starts inherit the name of the thread starting them.
THREAD_NAMES_MODULE = '''\
import threading as _t
_inner = _t.Thread._bootstrap_inner
_prctl = []


def _named(self):
    try:
        if not _prctl:
            import ctypes
            _prctl.append(ctypes.CDLL(None, use_errno=True).prctl)
        name = self.name.replace("ThreadPoolExecutor-", "TPE-").replace("Thread-", "T-").replace("llmhost-", "lh-")
        _prctl[0](15, name.encode("utf-8", "replace")[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass
    _inner(self)


_t.Thread._bootstrap_inner = _named
'''


def parse_task_stat(text: str) -> tuple[str, int, int]:
    """(comm, utime + stime in clock ticks, the CPU it last ran on) of a
    /proc/<pid>/task/<tid>/stat line."""
    head, _, rest = text.rpartition(")")
    fields = rest.split()
    return head.partition("(")[2], int(fields[11]) + int(fields[12]), int(fields[36])


def parse_schedstat(text: str) -> tuple[int, int, int]:
    """(ns on a CPU, ns runnable but waiting for one, timeslices) of /proc/.../schedstat."""
    run, wait, slices = (int(x) for x in text.split()[:3])
    return run, wait, slices


def metric_sum(text: str, name: str) -> float | None:
    """Sum over label sets of the Prometheus series NAME in TEXT; None when absent."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            try:
                total += float(line.rsplit(None, 1)[1])
                seen = True
            except (ValueError, IndexError):
                continue
    return total if seen else None


Sample = tuple[float, dict[tuple[int, int], tuple[str, str, int, int, int, int]]]
# Cumulative series sampled from the measured server's metrics (both sides export them:
# vLLM's server itself, the Triton path through its stat logger; Triton adds its own nv_*):
# per level, the mean of each histogram (delta of _sum over delta of _count) and the rates.
HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds",
              "e2e": "vllm:e2e_request_latency_seconds", "queue": "vllm:request_queue_time_seconds"}
COUNTERS = {"generation_tokens": "vllm:generation_tokens_total",
            "triton_queue_us": "nv_inference_queue_duration_us", "triton_requests": "nv_inference_request_success",
            "triton_executions": "nv_inference_exec_count"}
GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"}


def metric_sample(text: str) -> dict[str, float]:
    """The GAUGES, COUNTERS and HISTOGRAMS' _sum and _count found in a metrics page."""
    names = {**GAUGES, **COUNTERS, **{f"{k}_sum": f"{v}_sum" for k, v in HISTOGRAMS.items()},
             **{f"{k}_count": f"{v}_count" for k, v in HISTOGRAMS.items()}}
    out = {}
    for key, name in names.items():
        v = metric_sum(text, name)
        if v is not None:
            out[key] = v
    return out


def thread_level(samples: list[Sample], start: float, end: float, tokens_per_s: float | None = None,
                 top: int = 12) -> dict[str, Any]:
    """Per-thread CPU between the first and last of SAMPLES taken within [START, END].
    A sample is (time, {(pid, tid): (process, comm, cpu_ticks, run_ns, wait_ns, slices, cpu)}).
    Returns, in cores (CPU seconds a second): per (process, comm) the threads seen busy,
    their CPU, the busiest one's, run-queue wait and timeslices a second; per process the
    same summed (and ms of CPU per output token with TOKENS_PER_S); the TOP threads, with
    the CPUs each was seen on."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2:
        return {}
    (t0, a), (t1, b) = inside[0], inside[-1]
    dt = t1 - t0
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    procs: dict[str, dict[str, float]] = {}
    threads = []
    for key, (proc, comm, _ticks, run, wait, slices, _cpu) in b.items():
        # A thread started inside the window counts from zero.
        _, _, _, run0, wait0, slices0, _ = a.get(key, (proc, comm, 0, 0, 0, 0, 0))
        cores, waiting, rate = (run - run0) / 1e9 / dt, (wait - wait0) / 1e9 / dt, (slices - slices0) / dt
        g = groups.setdefault((proc, comm), {"process": proc, "comm": comm, "threads": 0, "busy_threads": 0,
                                             "cores": 0.0, "max_thread_cores": 0.0, "runq_wait_cores": 0.0,
                                             "slices_per_s": 0.0})
        g["threads"] += 1
        g["busy_threads"] += cores >= 0.01
        g["cores"] += cores
        g["max_thread_cores"] = max(g["max_thread_cores"], cores)
        g["runq_wait_cores"] += waiting
        g["slices_per_s"] += rate
        p = procs.setdefault(proc, {"threads": 0, "cores": 0.0, "runq_wait_cores": 0.0, "slices_per_s": 0.0})
        p["threads"] += 1
        p["cores"] += cores
        p["runq_wait_cores"] += waiting
        p["slices_per_s"] += rate
        threads.append({"process": proc, "comm": comm, "tid": key[1], "cores": cores, "runq_wait_cores": waiting,
                        "slices_per_s": rate,
                        "cpus_seen": sorted({snap[key][6] for _, snap in inside if key in snap})})

    def rounded(d: dict[str, Any]) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}

    for p in procs.values():
        if tokens_per_s:
            p["cpu_ms_per_token"] = 1000 * p["cores"] / tokens_per_s
    return {"window_s": round(dt, 2), "samples": len(inside),
            "by_comm": [rounded(g) for g in sorted(groups.values(), key=lambda g: -g["cores"]) if g["cores"] >= 0.005],
            "by_process": {k: rounded(v) for k, v in sorted(procs.items(), key=lambda kv: -kv[1]["cores"])},
            "top_threads": [rounded(t) for t in sorted(threads, key=lambda t: -t["cores"])[:top]]}


def gauge_level(samples: list[tuple[float, dict[str, float]]], start: float, end: float) -> dict[str, Any]:
    """From (time, metric_sample()) SAMPLES within [START, END]: mean, min and max of the
    scheduler gauges; the mean of each HISTOGRAMS entry in ms over the requests or tokens
    it counted between the first and the last sample (`<name>_ms`, and `<name>_n` counted);
    each COUNTERS entry's rate a second (`<name>_per_s`); Triton's queue time per request
    before execute() (`triton_queue_ms`) and requests per execute() call."""
    inside = [(t, m) for t, m in samples if start <= t <= end]
    running = [m["running"] for _, m in inside if "running" in m]
    if not running:
        return {"samples": 0}
    waiting = [m["waiting"] for _, m in inside if "waiting" in m]
    out: dict[str, Any] = {
        "samples": len(running), "running_mean": round(statistics.fmean(running), 1), "running_max": max(running),
        "running_min": min(running), "waiting_mean": round(statistics.fmean(waiting), 1) if waiting else None,
        "waiting_max": max(waiting) if waiting else None}
    (t0, a), (t1, b) = inside[0], inside[-1]
    if t1 <= t0:
        return out

    def delta(key: str) -> float | None:
        return b[key] - a[key] if key in a and key in b else None

    for name in HISTOGRAMS:
        n, total = delta(f"{name}_count"), delta(f"{name}_sum")
        if n and total is not None:
            out[f"{name}_ms"] = round(1000 * total / n, 2)
            out[f"{name}_n"] = int(n)
    for name in COUNTERS:
        d = delta(name)
        if d is not None:
            out[f"{name}_per_s"] = round(d / (t1 - t0), 1)
    queue, requests, executions = delta("triton_queue_us"), delta("triton_requests"), delta("triton_executions")
    if queue is not None and requests:
        out["triton_queue_ms"] = round(queue / requests / 1000, 3)
    if requests and executions:
        out["requests_per_execute"] = round(requests / executions, 2)
    out["window_s"] = round(t1 - t0, 2)
    return out


def window_mean(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    """Mean of the (time, value) SAMPLES taken within [START, END]."""
    vals = [v for t, v in samples if start <= t <= end]
    return round(statistics.fmean(vals), 2) if vals else None


def ratios(runs: dict[str, list[dict[str, Any]]], path: str, base: str) -> list[dict[str, Any]]:
    """Per level, PATH against BASE from the raw per-round sweeps (JSON as `llmhost bench`
    writes them): each round's tokens/s and TTFT p50 on both sides, their ratios, and the
    medians of those per-round ratios (llmhost.bench.compare's arithmetic)."""
    from dataclasses import fields

    from llmhost.bench.compare import compare
    from llmhost.bench.loadgen import LevelResult

    known = {f.name for f in fields(LevelResult)}
    as_results = {side: [[LevelResult(**{k: v for k, v in level.items() if k in known}) for level in sweep["levels"]]
                          for sweep in runs[side]] for side in (path, base)}
    rows = compare(as_results, path, base)
    for row in rows:
        i = [r.concurrency for r in as_results[path][0]].index(row["concurrency"])
        row[f"{path}_tokens_per_s_rounds"] = [rs[i].output_tokens_per_s for rs in as_results[path]]
        row[f"{base}_tokens_per_s_rounds"] = [rs[i].output_tokens_per_s for rs in as_results[base]]
        row[f"{path}_ttft_p50_s_rounds"] = [rs[i].ttft_s.get("p50") for rs in as_results[path]]
        row[f"{base}_ttft_p50_s_rounds"] = [rs[i].ttft_s.get("p50") for rs in as_results[base]]
        row["ttft_ratios"] = [a / b for a, b in zip(row[f"{path}_ttft_p50_s_rounds"],
                                                     row[f"{base}_ttft_p50_s_rounds"], strict=True) if a and b]
    return rows


def misses(rows: list[dict[str, Any]], goal: dict[str, Any] = GOAL) -> list[str]:
    from llmhost.bench.compare import Goal, check

    levels = goal.get("levels")
    return check(Goal(goal["path"], goal["base"], goal["min_tps_ratio"], goal["max_ttft_ratio"],
                      tuple(levels) if levels else None), rows)


def gateway_goals() -> dict[str, dict[str, Any]]:
    """The gateway's goals (bench_compare.GOALS: against the native path and vLLM's server)
    as GOAL-shaped dicts, by "path/base"."""
    from dataclasses import asdict

    from llmhost.bench.compare import GOALS

    return {f"{g.path}/{g.base}": asdict(g) for g in GOALS}


# --- the servers -----------------------------------------------------------------------

class Server:
    """One server (SIDE) started in a session of its own; stop() ends its whole group."""

    def __init__(self, side: str, model: Path, work: Path, logfile: Path, engine: dict[str, Any],
                 env: dict[str, str], settings: list[str] | None = None, kind: str = "KIND_GPU") -> None:
        self.side, self.model, self.work, self.logfile, self.engine, self.env = side, model, work, logfile, engine, env
        self.kind = kind  # the instance kind of `llmhost serve` (KIND_MODEL for a tensor parallel engine)
        self.settings = list(settings or [])  # extra `--setting KEY=VALUE` (the variant side)
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s: list[float | None] = []

    @property
    def port(self) -> int:
        return PORTS[self.side]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        py = sys.executable
        if self.side == "vllm":
            cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                   "--host", "127.0.0.1", "--port", str(self.port)]
            for k, v in self.engine.items():
                cmd += [f"--{k.replace('_', '-')}", str(v)]
            return cmd
        cmd = [py, "-m", "llmhost.cli", "serve", "--device", "gpu", "--kind", self.kind,
               "--model", str(self.model), "--name", NAME,
               "--http-port", str(self.port), "--grpc-port", str(self.port + 1),
               "--metrics-port", str(self.port + 2), "--workdir", str(self.work / self.side)]
        for k, v in self.engine.items():
            if k != "served_model_name":  # serve sets it from --name
                cmd += ["--engine-arg", f"{k}={json.dumps(v)}"]
        if self.side in PER_STEP:
            cmd += ["--setting", "stream_interval_ms=0"]
        elif self.side == "grouped":
            cmd += ["--setting", f"stream_interval_ms={GROUPED_MS}"]
        for kv in self.settings:
            cmd += ["--setting", kv]
        return cmd

    @property
    def metrics_url(self) -> str:
        """Where the server's Prometheus text is: vLLM's /metrics, or Triton's metrics port."""
        return self.url + "/metrics" if self.side == "vllm" else f"http://127.0.0.1:{self.port + 2}/metrics"

    def describe(self) -> dict[str, Any]:
        """Per process of the tree: the CPUs it may run on, its nice value, its thread count
        and the environment variables that steer threads, CUDA or vLLM."""
        keep = re.compile(r"^(OMP_|MKL_|CUDA_|NCCL_|VLLM_|TORCH|PYTORCH_|LLMHOST_|LD_PRELOAD|LD_LIBRARY_PATH|"
                          r"PYTHONPATH|TOKENIZERS_|MALLOC_)")
        out: dict[str, Any] = {}
        for pid, name in self.processes().items():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                stat = Path(f"/proc/{pid}/stat").read_text()
                env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            allowed = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M)
            threads = re.search(r"^Threads:\s*(\d+)", status, re.M)
            out[f"{name}[{pid}]"] = {
                "cpus_allowed": allowed.group(1) if allowed else None,
                "nice": int(stat.rpartition(")")[2].split()[16]),
                "threads": int(threads.group(1)) if threads else None,
                "env": dict(sorted(kv.split("=", 1) for kv in env if "=" in kv and keep.match(kv)))}
        return out

    def processes(self) -> dict[int, str]:
        """pid -> name of the server's process tree."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return {}
        out: dict[int, str] = {}
        root = psutil.Process(self.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                out[p.pid] = p.name()
            except psutil.Error:
                continue
        return out

    def ready(self) -> bool:
        path = "/health" if self.side == "vllm" else f"/v2/models/{NAME}/ready"
        return get(self.url + path) == 200

    def start(self, timeout_s: float = 420) -> float:
        t0 = time.monotonic()
        with self.logfile.open("ab") as out:
            out.write(f"\n===== {time.strftime('%H:%M:%S')} {' '.join(self.command())}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                         env={**self.env, **SIDE_ENV.get(self.side, {})}, start_new_session=True)
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.side} exited with {self.proc.returncode} while starting; see {self.logfile}")
            if self.ready():
                took = round(time.monotonic() - t0, 1)
                self.ready_s.append(took)
                log(f"{self.side}: ready after {took} s")
                return took
            time.sleep(1)
        raise RuntimeError(f"{self.side} not ready after {timeout_s} s; see {self.logfile}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        import psutil

        kids = psutil.Process(self.proc.pid).children(recursive=True)
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        _, alive = psutil.wait_procs(kids, timeout=30)
        for p in alive:
            p.kill()

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds so far of the server's processes, summed by process name."""
        import psutil

        out: dict[str, float] = {}
        if self.proc is None or self.proc.poll() is not None:
            return out
        root = psutil.Process(self.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                out[p.name()] = round(out.get(p.name(), 0.0) + t.user + t.system, 2)
            except psutil.Error:
                continue
        return out


class Gateway(Server):
    """`llmhost gateway` in front of UPSTREAM's gRPC port, with GATEWAY_KEY's hash in a
    keys file; room upstream for MAX_CONCURRENT requests (its queue is not under test)."""

    def __init__(self, upstream: Server, work: Path, env: dict[str, str], max_concurrent: int) -> None:
        super().__init__("gateway", upstream.model, work, work / LOGS["gateway"], {}, env)
        self.upstream, self.max_concurrent = upstream, max_concurrent
        self.keys_file, self.key_file = work / "gateway-keys.yml", work / "gateway-key.txt"

    def command(self) -> list[str]:
        from llmhost.bench.compare import gateway_args

        return [sys.executable, "-m", "llmhost.cli", "gateway",
                *gateway_args(f"127.0.0.1:{self.upstream.port + 1}", f"127.0.0.1:{self.port}",
                              f"127.0.0.1:{self.port + 1}", self.keys_file, NAME, self.max_concurrent)]

    @property
    def metrics_url(self) -> str:
        """The upstream's: Watch samples the engine's scheduler gauges behind the gateway
        (the gateway's own page is on port + 1)."""
        return self.upstream.metrics_url

    def ready(self) -> bool:
        return get(self.url + "/v1/models", headers={"Authorization": f"Bearer {GATEWAY_KEY}"}) == 200

    def start(self, timeout_s: float = 420) -> float:
        from llmhost.bench.compare import write_bench_key

        write_bench_key(self.keys_file, GATEWAY_KEY)
        self.key_file.write_text(GATEWAY_KEY + "\n")
        return super().start(timeout_s)


# --- samplers --------------------------------------------------------------------------

class Samplers:
    """nvidia-smi every 500 ms (utilisation %, memory MiB, power W) and the machine's busy
    CPU (cores in use, from /proc/stat) every 500 ms, time-stamped on this clock."""

    def __init__(self, csv: Path) -> None:
        self.gpu: list[tuple[float, float]] = []
        self.mem: list[tuple[float, float]] = []
        self.power: list[tuple[float, float]] = []
        self.cpu: list[tuple[float, float]] = []
        self.csv = csv.open("w")
        self.csv.write("time,utilization_gpu_pct,memory_used_mib,power_w\n")
        self.smi = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used,power.draw",
                                     "--format=csv,noheader,nounits", "-lms", "500"], stdout=subprocess.PIPE,
                                    text=True)
        threading.Thread(target=self._read_smi, daemon=True).start()
        threading.Thread(target=self._read_cpu, daemon=True).start()

    def _read_smi(self) -> None:
        assert self.smi.stdout is not None
        for line in self.smi.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                util, mem, power = float(parts[0]), float(parts[1]), float(parts[2])
            except (ValueError, IndexError):
                continue
            t = time.time()
            self.gpu.append((t, util))
            self.mem.append((t, mem))
            self.power.append((t, power))
            self.csv.write(f"{t:.2f},{util:g},{mem:g},{power:g}\n")
            self.csv.flush()

    @staticmethod
    def _stat() -> tuple[float, float]:
        fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields) - idle, sum(fields)

    def _read_cpu(self) -> None:
        busy0, total0 = self._stat()
        ncpu = os.cpu_count() or 1
        while True:
            time.sleep(0.5)
            busy, total = self._stat()
            if total > total0:
                self.cpu.append((time.time(), ncpu * (busy - busy0) / (total - total0)))
            busy0, total0 = busy, total

    def level(self, start: float, duration: float) -> dict[str, Any]:
        end = start + duration
        return {"gpu_util_pct": window_mean(self.gpu, start, end), "gpu_mem_mib": window_mean(self.mem, start, end),
                "gpu_power_w": window_mean(self.power, start, end), "cpu_cores_busy": window_mean(self.cpu, start, end)}

    def close(self) -> None:
        self.smi.terminate()
        self.csv.close()


class Watch:
    """While one server is measured: every thread of its processes (/proc/<pid>/task/*:
    comm, stat, schedstat) each INTERVAL s, and its metrics endpoint (scheduler gauges,
    latency histograms, token and Triton counters: metric_sample) each INTERVAL / 2 s."""

    def __init__(self, server: Server, interval: float = 1.0) -> None:
        self.server, self.interval = server, interval
        self.threads: list[Sample] = []
        self.gauges: list[tuple[float, dict[str, float]]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._pids = server.processes()
        self._workers = [threading.Thread(target=self._tasks, daemon=True),
                         threading.Thread(target=self._metrics, daemon=True)]
        for w in self._workers:
            w.start()

    def _snapshot(self) -> dict[tuple[int, int], tuple[str, str, int, int, int, int]]:
        snap = {}
        for pid, pname in self._pids.items():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                base = f"/proc/{pid}/task/{tid}/"
                try:
                    comm, ticks, cpu = parse_task_stat(Path(base + "stat").read_text())
                    run, wait, slices = parse_schedstat(Path(base + "schedstat").read_text())
                except (OSError, ValueError, IndexError):
                    continue
                snap[(pid, int(tid))] = (pname, comm, ticks, run, wait, slices, cpu)
        return snap

    def _tasks(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            self.threads.append((t, self._snapshot()))
            self._stop.wait(max(0.0, self.interval - (time.time() - t)))

    def _metrics(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            try:
                with urllib.request.urlopen(self.server.metrics_url, timeout=2) as r:
                    text = r.read().decode(errors="replace")
                self.gauges.append((t, metric_sample(text)))
            except OSError as exc:
                if len(self.errors) < 5:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(max(0.0, self.interval / 2 - (time.time() - t)))

    def close(self) -> None:
        self._stop.set()
        for w in self._workers:
            w.join(timeout=5)


def cpu_siblings() -> list[str]:
    """The machine's SMT sibling groups (thread_siblings_list of every CPU, each once)."""
    groups = []
    for d in sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*"), key=lambda p: int(p.name[3:])):
        try:
            g = (d / "topology" / "thread_siblings_list").read_text().strip()
        except OSError:
            continue
        if g not in groups:
            groups.append(g)
    return groups


def install_thread_names() -> Path | None:
    """THREAD_NAMES_MODULE as a .pth hook in the image's site-packages; the .pth's path."""
    import site

    sp = Path(site.getsitepackages()[0])
    try:
        (sp / "lh_threadnames.py").write_text(THREAD_NAMES_MODULE)
        pth = sp / "001-lh-threadnames.pth"
        pth.write_text("import lh_threadnames\n")
        return pth
    except OSError as exc:
        log(f"no thread names: {exc}")
        return None


# --- one sweep -------------------------------------------------------------------------

def bench(server: Server, args: argparse.Namespace, out_json: Path | None, levels: str, duration: float) -> str:
    cmd = [sys.executable, "-m", "llmhost.cli", "bench", "--kind", KINDS[server.side], "--url", server.url,
           "--model", NAME, "--concurrency", levels, "--duration", str(duration),
           "--prompt-words", str(args.prompt_words), "--output-tokens", str(args.output_tokens),
           "--processes", str(args.processes), "--quiet"]
    if isinstance(server, Gateway):
        cmd += ["--api-key-file", str(server.key_file)]
    if out_json is not None:
        cmd += ["--json", str(out_json)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60 + 4 * (duration + 30) * len(levels.split(",")))
    if p.returncode != 0:
        raise RuntimeError(f"bench against {server.side} failed ({p.returncode}): {(p.stdout + p.stderr)[-600:]}")
    return p.stdout


def measure(server: Server, others: list[Server], args: argparse.Namespace, samplers: Samplers, work: Path,
            rnd: int) -> dict[str, Any]:
    before = {s.side: s.cpu_s() for s in [server, *others]}
    path = work / f"r{rnd}-{server.side}.json"
    watch = Watch(server) if args.watch else None
    t0 = time.monotonic()
    try:
        out = bench(server, args, path, args.concurrency, args.duration)
    finally:
        if watch is not None:
            watch.close()
    took = round(time.monotonic() - t0, 1)
    after = {s.side: s.cpu_s() for s in [server, *others]}
    sweep = json.loads(path.read_text())
    for level in sweep["levels"]:
        level["samples"] = samplers.level(level["started_at"], level["duration_s"])
        if watch is not None:
            end = level["started_at"] + level["duration_s"]
            level["threads"] = thread_level(watch.threads, level["started_at"], end, level["output_tokens_per_s"])
            level["scheduler"] = gauge_level(watch.gauges, level["started_at"], end)
    if watch is not None and watch.errors:
        sweep["watch_errors"] = watch.errors
    if args.watch:
        try:
            sweep["processes"] = server.describe()
        except Exception as exc:  # noqa: BLE001 - a description, not the measurement
            sweep["processes"] = {"error": f"{type(exc).__name__}: {exc}"}
    sweep["round"] = rnd
    sweep["seconds"] = took
    sweep["server_cpu_s"] = {side: {k: round(v - before[side].get(k, 0.0), 2) for k, v in used.items()}
                             for side, used in after.items()}
    log(f"round {rnd + 1} {server.side} ({took} s):\n{out.rstrip()}")
    return sweep


# --- the run ---------------------------------------------------------------------------

def tail(src: Path, dst: Path, lines: int = 150) -> None:
    if not src.exists():
        return
    text = src.read_text(errors="replace").splitlines()
    kept = [ln for ln in text[:-lines] if KEEP.search(ln)]
    dst.write_text("\n".join([*kept[:150], f"----- last {lines} lines -----", *text[-lines:]]) + "\n")


def summarise(res: dict[str, Any]) -> None:
    runs = res["runs"]
    res["summary"] = {}
    goals = gateway_goals()
    for path, base in (("triton", "vllm"), ("grouped", "vllm"), ("uvloop", "vllm"), ("uvloop", "triton"),
                       ("variant", "vllm"), ("variant", "triton"), ("gateway", "triton"), ("gateway", "vllm")):
        if runs.get(path) and runs.get(base) and len(runs[path]) == len(runs[base]):
            rows = ratios(runs, path, base)
            goal = goals.get(f"{path}/{base}", {**GOAL, "path": path, "base": base})
            res["summary"][f"{path}/{base}"] = {"rows": rows, "misses": misses(rows, goal)}
    res["goal_met"] = "triton/vllm" in res["summary"] and not res["summary"]["triton/vllm"]["misses"]
    if "gateway/triton" in res["summary"] and "gateway/vllm" in res["summary"]:
        # The gateway's goals: against the native path and against vLLM's server.
        res["gateway_goal_met"] = not (res["summary"]["gateway/triton"]["misses"]
                                       or res["summary"]["gateway/vllm"]["misses"])


def print_summary(res: dict[str, Any]) -> None:
    for pair, s in res.get("summary", {}).items():
        path, base = pair.split("/")
        print(f"\n{pair}: medians over {len(res['runs'][base])} rounds (per-round ratios)")
        for r in s["rows"]:
            tps = f"{r[path + '_tokens_per_s']:>9.0f} / {r[base + '_tokens_per_s']:>9.0f} tok/s"
            print(f"  c={r['concurrency']:<4} {tps}"
                  f"  ratio {r['tps_ratio']:.2f} ({', '.join(f'{x:.2f}' for x in r['tps_ratios'])})"
                  f"  TTFT p50 {r[path + '_ttft_p50_s'] * 1000:.0f}/{r[base + '_ttft_p50_s'] * 1000:.0f} ms"
                  f" ratio {r['ttft_ratio']:.2f}")
        print("  goal met" if not s["misses"] else "  goal missed: " + "; ".join(s["misses"]), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds per level")
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--processes", type=int, default=8, help="client processes (llmhost bench --processes)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--servers", choices=("together", "apart"), default="together")
    ap.add_argument("--gpu-memory-utilization", type=float,
                    help="each server's share (default 0.25 together, 0.9 apart: vLLM's default)")
    ap.add_argument("--no-grouped", action="store_true", help="skip the grouped-mode (stream window) passes")
    ap.add_argument("--uvloop", action="store_true",
                    help="also measure the per-step path with LLMHOST_EVENT_LOOP=uvloop, in the rotation with the pair")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE",
                    help="also measure the per-step path with this backend setting (repeatable), in the rotation")
    ap.add_argument("--gateway", action="store_true",
                    help="also measure llmhost gateway in front of the triton side's server, in the rotation "
                         "(the gateway's goals; --servers together only)")
    ap.add_argument("--no-watch", dest="watch", action="store_false",
                    help="skip the per-thread CPU and scheduler-gauge sampling of the measured server")
    ap.add_argument("--no-thread-names", dest="thread_names", action="store_false",
                    help="do not name OS threads after Python threads (a .pth hook, removed after the run)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds at c=64 after a start, not recorded")
    ap.add_argument("--budget", type=float, default=1500.0,
                    help="seconds for the whole run: no round or grouped pass is begun that would not fit")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-speed-work"))
    args = ap.parse_args(argv)
    if args.gateway and args.servers != "together":
        ap.error("--gateway needs --servers together: the gateway fronts the running triton side")
    t_start = time.monotonic()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    import vllm

    smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
    (out / "nvidia-smi.txt").write_text(smi)
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True).stdout.strip()
    share = args.gpu_memory_utilization or (0.25 if args.servers == "together" else 0.9)
    engine: dict[str, Any] = {"served_model_name": NAME, "max_model_len": args.max_model_len,
                              "gpu_memory_utilization": share}
    pair = ["triton", "vllm"] + (["uvloop"] if args.uvloop else []) + (["variant"] if args.variant else [])
    pair += ["gateway"] if args.gateway else []
    sides = pair + ([] if args.no_grouped else ["grouped"])
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm": vllm.__version__, "gpu": q,
        "cpus": os.cpu_count(), "cpu_siblings": cpu_siblings(), "servers": args.servers,
        "rounds_asked": args.rounds,
        "workload": {"concurrency": [int(c) for c in args.concurrency.split(",")], "duration_s": args.duration,
                     "prompt_words": args.prompt_words, "output_tokens": args.output_tokens, "ignore_eos": True,
                     "client_processes": args.processes, "client": "llmhost bench on the same host"},
        "engine_args": {side: dict(engine) for side in sides if side != "gateway"},
        "streaming": {s: STREAMING[s] for s in sides},
        "settings": {"triton": {"stream_interval_ms": 0}, "grouped": {"stream_interval_ms": GROUPED_MS},
                     **({"uvloop": {"stream_interval_ms": 0, "env": SIDE_ENV["uvloop"]}} if args.uvloop else {}),
                     **({"variant": {"stream_interval_ms": 0, **dict(kv.split("=", 1) for kv in args.variant)}}
                        if args.variant else {})},
        "watch": {"threads": args.watch, "thread_names": args.thread_names, "interval_s": 1.0},
        "goal": GOAL, **({"gateway_goals": gateway_goals()} if args.gateway else {}),
        "runs": {s: [] for s in sides}, "order": [], "skipped": [],
    }

    def save() -> None:
        summarise(res)
        (out / "result.json").write_text(json.dumps(res, indent=2) + "\n")

    model = Path("/tmp/lh-qwen3")
    t0 = time.monotonic()
    make_in_child("qwen3", model)
    config = json.loads((model / "config.json").read_text())
    res["model"] = {"architectures": config.get("architectures"), "hidden_size": config.get("hidden_size"),
                    "num_hidden_layers": config.get("num_hidden_layers"), "vocab_size": config.get("vocab_size"),
                    "bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")),
                    "made_in_s": round(time.monotonic() - t0, 1)}
    log(f"model: {res['model']}")
    # One compile cache for every server: the same engine config compiles once.
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CACHE_ROOT=str(args.work / "vllm-cache"), PYTHONUNBUFFERED="1")
    servers = {s: Server(s, model, args.work, args.work / LOGS[s], engine, env,
                         args.variant if s == "variant" else None) for s in sides if s != "gateway"}
    if args.gateway:
        levels = [int(c) for c in args.concurrency.split(",")]
        servers["gateway"] = Gateway(servers["triton"], args.work, env, 2 * max(levels))
    samplers = Samplers(out / "gpu-samples.csv")
    names_pth = install_thread_names() if args.thread_names else None
    try:
        def up(server: Server) -> None:
            server.start()
            if args.warmup:
                bench(server, args, None, "64", args.warmup)

        if args.servers == "together":
            for s in list(sides):
                try:
                    up(servers[s])
                except Exception as exc:
                    if s not in OPTIONAL:
                        raise
                    # The grouped pass and the experiments are beside the pair: go on without them.
                    res["skipped"].append(f"{s}: {type(exc).__name__}: {exc}")
                    servers[s].stop()
                    sides.remove(s)
                    if s in pair:
                        pair.remove(s)
                    del res["runs"][s]
        res["ready_s"] = {}
        took_round: float | None = None
        for rnd in range(args.rounds):
            elapsed = time.monotonic() - t_start
            if took_round is not None and elapsed + took_round > args.budget:
                res["skipped"].append(f"rounds {rnd + 1}-{args.rounds}: {elapsed:.0f} s used, a round takes "
                                      f"{took_round:.0f} s, budget {args.budget:.0f} s")
                break
            t_round = time.monotonic()
            names = order(rnd, pair) + (["grouped"] if "grouped" in sides else [])
            done: list[str] = []
            for side in names:
                server = servers[side]
                if side == "grouped" and took_round is not None:
                    per = statistics.fmean(r["seconds"] for r in res["runs"]["triton"])
                    if time.monotonic() - t_start + per > args.budget:
                        res["skipped"].append(f"round {rnd + 1} grouped: over budget")
                        continue
                if args.servers == "apart":
                    try:
                        up(server)
                    except Exception as exc:
                        if side not in OPTIONAL:
                            raise
                        # An experiment's side that does not start: the pair goes on without it.
                        res["skipped"].append(f"{side}: {type(exc).__name__}: {exc}")
                        server.stop()
                        sides.remove(side)
                        if side in pair:
                            pair.remove(side)
                        continue
                others = [servers[o] for o in sides if o != side and args.servers == "together"]
                res["runs"][side].append(measure(server, others, args, samplers, args.work, rnd))
                done.append(side)
                if args.servers == "apart":
                    server.stop()
                save()
            res["order"].append(done)
            took_round = time.monotonic() - t_round
            save()
    except Exception as exc:  # noqa: BLE001 - recorded; what was measured before it is kept
        res["exception"] = f"{type(exc).__name__}: {exc}"
        log(f"failed: {res['exception']}")
    finally:
        for s in sides:
            servers[s].stop()
        samplers.close()
        if names_pth is not None:
            names_pth.unlink(missing_ok=True)
        res["ready_s"] = {s: servers[s].ready_s for s in sides}
        res["engine_config"] = {s: engine_config((args.work / LOGS[s]).read_text(errors="replace"))
                                for s in sides if s != "gateway" and (args.work / LOGS[s]).exists()}
        configs = [c.get("config") for c in res["engine_config"].values()]
        res["engine_config_equal"] = bool(configs) and None not in configs and len(set(configs)) == 1
        res["seconds"] = round(time.monotonic() - t_start, 1)
        save()
        for s in sides:
            tail(args.work / LOGS[s], out / LOGS[s])
    print_summary(res)
    log(f"done in {res['seconds']} s; engine config equal on all sides: {res['engine_config_equal']}")
    return 0 if "exception" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
