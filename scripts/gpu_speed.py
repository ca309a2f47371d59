#!/usr/bin/env python3
"""Issue 14's GPU speed run: the Triton path against vLLM's own OpenAI server.

Run on a GPU host whose python3 imports vLLM, nvidia-pytriton and llmhost (the device
kit: ../shared/gpu-kit, after gpu-setup.sh). It writes the Qwen3-0.6B-shaped random
model of gpu_check.py and measures, with `llmhost bench` spread over several client
processes (64-word prompts, 128 output tokens, ignore_eos, a fixed duration per
concurrency level):

* `triton`: `llmhost serve --device gpu --setting stream_interval_ms=0`, one response
  per engine step (vLLM's server sends one SSE event per token), through Triton's HTTP
  `/generate_stream`;
* `vllm`: `python3 -m vllm.entrypoints.openai.api_server` with the same engine
  arguments, through `/v1/completions` (`--kind openai`);
* `grouped` (unless --no-grouped): `llmhost serve` with the default stream window
  (`stream_interval_ms` 50), beside the pair, compared with vLLM too.

Each round measures `triton` and `vllm`, alternating which goes first, then `grouped`.
--servers apart starts each server before its measurement and stops it after (a
start costs 1-2 minutes of CUDA graphs and torch.compile); --servers together (the
default) starts all of them once, each with the same GPU memory share, and measures
one at a time while the others idle (their CPU seconds are recorded per measurement
to show it). While a sweep runs, nvidia-smi is sampled (utilisation, memory, power)
and so is the machine's CPU use (/proc/stat), per level.

Usage: python3 scripts/gpu_speed.py OUT_DIR [--rounds 3] [--duration 12] [--processes 8]
Writes OUT_DIR/result.json (every sweep's levels, server CPU, GPU and CPU samples per
level, the engine config both sides logged, and the medians of the per-round ratios
against issue 14's goal), speed.log, the servers' log tails (serve-triton.log,
serve-grouped.log, vllm-server.log), gpu-samples.csv and nvidia-smi.txt: few files,
as the lent GPU machine returns at most 8. The H100 run is in
tests/fixtures/gpu/h100-580.159.04-real/device-run-2026-11-24-speed2/ (its unit test:
tests/unit/test_gpu_speed_run.py).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

NAME = "llm"
SIDES = ("triton", "vllm", "grouped")
PORTS = {"triton": 18600, "grouped": 18610, "vllm": 18620}
LOGS = {"triton": "serve-triton.log", "grouped": "serve-grouped.log", "vllm": "vllm-server.log"}
KINDS = {"triton": "http", "grouped": "http", "vllm": "openai"}
STREAMING = {
    "triton": "Triton HTTP SSE (/generate_stream), stream_interval_ms=0: one response per engine step",
    "grouped": "Triton HTTP SSE (/generate_stream), stream_interval_ms=50 (default): deltas grouped per stream",
    "vllm": "OpenAI SSE (/v1/completions), one event per engine step",
}
# Issue 14: the per-step Triton path against vLLM's server, at every level.
GOAL = {"path": "triton", "base": "vllm", "min_tps_ratio": 0.97, "max_ttft_ratio": 1.10}
# Lines of a server's log kept whatever the tail: the engine's config and scheduler.
KEEP = re.compile(r"Initializing a V1 LLM engine|non-default args|max_num_batched_tokens|max_num_seqs|"
                  r"KV cache|Maximum concurrency|graph capturing|torch.compile t|Directly load|ready|"
                  r"Traceback|Error|error")
ENGINE_CONFIG = re.compile(r"Initializing a V1 LLM engine \((v[^)]*)\) with config: (.*)$")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def get(url: str, timeout: float = 3) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
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


def order(rnd: int) -> list[str]:
    """The pair's order in round RND (from 0): the Triton path first in even rounds."""
    return ["triton", "vllm"] if rnd % 2 == 0 else ["vllm", "triton"]


def window_mean(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    """Mean of the (time, value) SAMPLES taken within [START, END]."""
    vals = [v for t, v in samples if start <= t <= end]
    return round(statistics.fmean(vals), 2) if vals else None


def ratios(runs: dict[str, list[dict[str, Any]]], path: str, base: str) -> list[dict[str, Any]]:
    """Per level, PATH against BASE from the raw per-round sweeps (JSON as `llmhost bench`
    writes them): each round's tokens/s and TTFT p50 on both sides, their ratios, and the
    medians of those per-round ratios (llmhost.bench_compare's arithmetic)."""
    from dataclasses import fields

    from llmhost.bench import LevelResult
    from llmhost.bench_compare import compare

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
    from llmhost.bench_compare import Goal, check

    return check(Goal(goal["path"], goal["base"], goal["min_tps_ratio"], goal["max_ttft_ratio"]), rows)


# --- the servers -----------------------------------------------------------------------

class Server:
    """One server (SIDE) started in a session of its own; stop() ends its whole group."""

    def __init__(self, side: str, model: Path, work: Path, logfile: Path, engine: dict[str, Any],
                 env: dict[str, str]) -> None:
        self.side, self.model, self.work, self.logfile, self.engine, self.env = side, model, work, logfile, engine, env
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
        cmd = [py, "-m", "llmhost.cli", "serve", "--device", "gpu", "--model", str(self.model), "--name", NAME,
               "--http-port", str(self.port), "--grpc-port", str(self.port + 1),
               "--metrics-port", str(self.port + 2), "--workdir", str(self.work / self.side)]
        for k, v in self.engine.items():
            if k != "served_model_name":  # serve sets it from --name
                cmd += ["--engine-arg", f"{k}={json.dumps(v)}"]
        if self.side == "triton":
            cmd += ["--setting", "stream_interval_ms=0"]
        return cmd

    def ready(self) -> bool:
        path = "/health" if self.side == "vllm" else f"/v2/models/{NAME}/ready"
        return get(self.url + path) == 200

    def start(self, timeout_s: float = 420) -> float:
        t0 = time.monotonic()
        with self.logfile.open("ab") as out:
            out.write(f"\n===== {time.strftime('%H:%M:%S')} {' '.join(self.command())}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
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


# --- one sweep -------------------------------------------------------------------------

def bench(server: Server, args: argparse.Namespace, out_json: Path | None, levels: str, duration: float) -> str:
    cmd = [sys.executable, "-m", "llmhost.cli", "bench", "--kind", KINDS[server.side], "--url", server.url,
           "--model", NAME, "--concurrency", levels, "--duration", str(duration),
           "--prompt-words", str(args.prompt_words), "--output-tokens", str(args.output_tokens),
           "--processes", str(args.processes), "--quiet"]
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
    t0 = time.monotonic()
    out = bench(server, args, path, args.concurrency, args.duration)
    took = round(time.monotonic() - t0, 1)
    after = {s.side: s.cpu_s() for s in [server, *others]}
    sweep = json.loads(path.read_text())
    for level in sweep["levels"]:
        level["samples"] = samplers.level(level["started_at"], level["duration_s"])
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
    for path in ("triton", "grouped"):
        if runs.get(path) and runs.get("vllm") and len(runs[path]) == len(runs["vllm"]):
            rows = ratios(runs, path, "vllm")
            res["summary"][f"{path}/vllm"] = {"rows": rows, "misses": misses(rows, {**GOAL, "path": path})}
    res["goal_met"] = "triton/vllm" in res["summary"] and not res["summary"]["triton/vllm"]["misses"]


def print_summary(res: dict[str, Any]) -> None:
    for pair, s in res.get("summary", {}).items():
        path = pair.split("/")[0]
        print(f"\n{pair}: medians over {len(res['runs']['vllm'])} rounds (per-round ratios)")
        for r in s["rows"]:
            print(f"  c={r['concurrency']:<4} {r[path + '_tokens_per_s']:>9.0f} / {r['vllm_tokens_per_s']:>9.0f} tok/s"
                  f"  ratio {r['tps_ratio']:.2f} ({', '.join(f'{x:.2f}' for x in r['tps_ratios'])})"
                  f"  TTFT p50 {r[path + '_ttft_p50_s'] * 1000:.0f}/{r['vllm_ttft_p50_s'] * 1000:.0f} ms"
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
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds at c=64 after a start, not recorded")
    ap.add_argument("--budget", type=float, default=1500.0,
                    help="seconds for the whole run: no round or grouped pass is begun that would not fit")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-speed-work"))
    args = ap.parse_args(argv)
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
    sides = ["triton", "vllm"] + ([] if args.no_grouped else ["grouped"])
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm": vllm.__version__, "gpu": q,
        "cpus": os.cpu_count(), "servers": args.servers, "rounds_asked": args.rounds,
        "workload": {"concurrency": [int(c) for c in args.concurrency.split(",")], "duration_s": args.duration,
                     "prompt_words": args.prompt_words, "output_tokens": args.output_tokens, "ignore_eos": True,
                     "client_processes": args.processes, "client": "llmhost bench on the same host"},
        "engine_args": {side: dict(engine) for side in sides}, "streaming": {s: STREAMING[s] for s in sides},
        "settings": {"triton": {"stream_interval_ms": 0}, "grouped": {}},
        "goal": GOAL, "runs": {s: [] for s in sides}, "order": [], "skipped": [],
    }

    def save() -> None:
        summarise(res)
        (out / "result.json").write_text(json.dumps(res, indent=2) + "\n")

    model = Path("/tmp/lh-qwen3")
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import sys; sys.path[:0] = [sys.argv[2]]; import gpu_check; "
                    "gpu_check.make_model('qwen3', gpu_check.Path(sys.argv[1]))", str(model),
                    str(Path(__file__).resolve().parent)], check=True)
    config = json.loads((model / "config.json").read_text())
    res["model"] = {"architectures": config.get("architectures"), "hidden_size": config.get("hidden_size"),
                    "num_hidden_layers": config.get("num_hidden_layers"), "vocab_size": config.get("vocab_size"),
                    "bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")),
                    "made_in_s": round(time.monotonic() - t0, 1)}
    log(f"model: {res['model']}")
    # One compile cache for every server: the same engine config compiles once.
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CACHE_ROOT=str(args.work / "vllm-cache"), PYTHONUNBUFFERED="1")
    servers = {s: Server(s, model, args.work, args.work / LOGS[s], engine, env) for s in sides}
    samplers = Samplers(out / "gpu-samples.csv")
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
                    if s != "grouped":
                        raise
                    # The grouped pass is beside the point of the run: go on without it.
                    res["skipped"].append(f"grouped: {type(exc).__name__}: {exc}")
                    servers[s].stop()
                    sides.remove(s)
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
            names = order(rnd) + (["grouped"] if "grouped" in sides else [])
            done: list[str] = []
            for side in names:
                server = servers[side]
                if side == "grouped" and took_round is not None:
                    per = statistics.fmean(r["seconds"] for r in res["runs"]["triton"])
                    if time.monotonic() - t_start + per > args.budget:
                        res["skipped"].append(f"round {rnd + 1} grouped: over budget")
                        continue
                if args.servers == "apart":
                    up(server)
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
        res["ready_s"] = {s: servers[s].ready_s for s in sides}
        res["engine_config"] = {s: engine_config((args.work / LOGS[s]).read_text(errors="replace"))
                                for s in sides if (args.work / LOGS[s]).exists()}
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
