"""Lab: the gateway's routing policies over two replicas of one model on one GPU, measured
by vLLM's own client (`vllm bench serve`, in process: llmhost.bench.vllm_client).

Run on a GPU host with the device kit (../shared/gpu-kit, after gpu-setup.sh), from a
folder holding this `lab/` package. It writes the Qwen3-0.6B-shaped random model
(lab.gpucheck.model), starts two `llmhost serve --device gpu` servers on the one GPU
(one after the other, each with --gpu-memory-utilization of its memory; vLLM's prefix
caching on), and one `llmhost gateway` in front of both (both upstreams, each with its
engine sockets), restarted with `--routing POLICY` for each policy. Per round, each
policy (in turn; the order reversed every other round) runs every workload of PLAN:

* `prefix`: vLLM's prefix_repetition dataset, --num-prefixes prefixes of --prefix-len
  tokens, suffixes of --suffix-len tokens;
* `random`: random prompts of prefix-len + suffix-len tokens;

--output-len tokens out, --ignore-eos, max(256, 4 x concurrency) requests (or --prefix-requests,
--random-requests), a seed of its own per run (so no run finds the prompts of an earlier one
in the prefix caches). Per run:
vLLM's numbers (and the TTFTs' deciles), each replica's prefix-cache hits and queries (Triton's metrics port:
vllm:prefix_cache_hits_total / _queries_total), its requests and tokens, the gateway's
routing decisions by reason, the client's and each process tree's CPU cores, the GPU's
utilisation (nvidia-smi). The client runs in this process on the same host.

With --replica-per-gpu (two GPUs) each replica has a GPU of its own, and the policy
`vllm_dp` in --policies measures the issue's other yardstick on the same GPUs: vLLM's own
server with `--data-parallel-size 2` (the replicas' engine arguments, started after them,
so each GPU holds a replica and one of its engines), the client sent to it directly.

Usage: python3 -m lab.gpu_routing_check OUT [--rounds 3] [--budget 840]
Writes OUT/result.json (every run, the medians of the per-round ratios cache_aware /
round_robin, / least_loaded and / vllm_dp, the issue's acceptance checks), the servers'
log tails (serve-replica-a.log, serve-replica-b.log, gateway.log, serve-vllm-dp.log), the
gateway's last /metrics (gateway-metrics.txt) and nvidia-smi.txt. Its stdout is the log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

POLICIES = ("cache_aware", "round_robin", "least_loaded")
# vLLM's own server with --data-parallel-size 2 on the replicas' two GPUs: not a policy of
# the gateway but a run of its own, measured like one (the client sent to it directly).
YARDSTICK = "vllm_dp"
# (workload, concurrency) run by each policy in each round, in this order.
PLAN: tuple[tuple[str, int], ...] = (("prefix", 64), ("prefix", 256), ("random", 64))
# The acceptance: cache_aware against BASE on WORKLOAD at CONCURRENCY, medians of
# the per-round ratios.
ACCEPTANCE: tuple[dict[str, Any], ...] = (
    {"workload": "prefix", "concurrency": 64, "base": "round_robin", "max_ttft_p50": 0.5, "min_tps": 1.3},
    {"workload": "prefix", "concurrency": 256, "base": "round_robin", "max_ttft_p50": 0.5, "min_tps": 1.3},
    {"workload": "random", "concurrency": 64, "base": "least_loaded", "min_tps": 0.97},
)
# Where two GPUs are lent (a replica per GPU): ahead of vLLM's own data parallel on the same
# GPUs, at least as many tokens per second and at most its TTFT p50.
DP_ACCEPTANCE: tuple[dict[str, Any], ...] = (
    {"workload": "prefix", "concurrency": 64, "base": YARDSTICK, "max_ttft_p50": 1.0, "min_tps": 1.0},
    {"workload": "prefix", "concurrency": 256, "base": YARDSTICK, "max_ttft_p50": 1.0, "min_tps": 1.0},
)
REPLICA_PORTS = {"replica-a": 18700, "replica-b": 18710}  # HTTP; gRPC + 1, metrics + 2
YARDSTICK_PORT = 18730
GATEWAY_PORT = 18720  # metrics on + 1
STREAMING = {
    "client_to_gateway": "OpenAI SSE (/v1/completions) from llmhost gateway, one event per engine step",
    "gateway_to_replicas": "the gateway reads each replica's engine sockets (one JSON line per engine step, "
                           "written by the engine's loop in the Triton stub); no Triton gRPC stream",
}
YARDSTICK_STREAMING = "OpenAI SSE (/v1/completions) from vLLM's own API server, one event per engine step"
CLIENT = "vllm bench serve (in process, llmhost.bench.vllm_client), one process on the same host's CPUs"
REPLICA_COUNTERS = {"prefix_hits": "vllm:prefix_cache_hits_total", "prefix_queries": "vllm:prefix_cache_queries_total",
                    "requests": "vllm:request_success_total", "prompt_tokens": "vllm:prompt_tokens_total",
                    "generation_tokens": "vllm:generation_tokens_total", "preemptions": "vllm:num_preemptions_total",
                    "ttft_sum_s": "vllm:time_to_first_token_seconds_sum",
                    "ttft_count": "vllm:time_to_first_token_seconds_count"}
ROUTING_LINE = re.compile(r'^llmhost_gateway_routing_decisions_total\{([^}]*)\}\s+(\S+)', re.M)


# --- pure helpers (tested in tests/records/test_h200_routing_cache_aware.py) ------------

def policy_order(rnd: int, policies: tuple[str, ...] = POLICIES) -> list[str]:
    """The policies in round RND (from 0): POLICIES, reversed in odd rounds."""
    return list(policies) if rnd % 2 == 0 else list(reversed(policies))


def cache_aware_variant(policy: str) -> bool:
    """cache_aware, or cache_aware@F: cache_aware with the gateway's load factor F."""
    return policy == "cache_aware" or policy.startswith("cache_aware@")


# Routing by the engines' own KV-cache events (the replicas publish them: --setting kv_events=true).
KV_EVENTS = "kv_events"
KV_EVENTS_SETTLE_S = 20


def bases_of(policy: str) -> tuple[str, ...]:
    """What POLICY is compared with: a routing-by-cache policy with round robin, least
    loaded and vLLM's data parallel; kv_events also with cache_aware; others with none."""
    if cache_aware_variant(policy):
        return ("round_robin", "least_loaded", YARDSTICK)
    if policy == KV_EVENTS:
        return ("round_robin", "least_loaded", YARDSTICK, "cache_aware")
    return ()


def seed_of(rnd: int, index: int) -> int:
    """The dataset seed of the INDEX-th run (from 0) of round RND: every run its own."""
    return 1000 * (rnd + 1) + index


def requests_for(concurrency: int) -> int:
    return max(256, 4 * concurrency)


def metric_total(text: str, name: str) -> float:
    """Sum over label sets of the Prometheus series NAME (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            try:
                total += float(line.rsplit(None, 1)[1])
            except (ValueError, IndexError):
                continue
    return total


def routing_decisions(text: str) -> dict[str, float]:
    """llmhost_gateway_routing_decisions_total by reason (summed over models)."""
    out: dict[str, float] = {}
    for labels, value in ROUTING_LINE.findall(text):
        m = re.search(r'reason="([^"]*)"', labels)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(value)
    return out


def hit_rate(hits: float, queries: float) -> float | None:
    return round(hits / queries, 4) if queries else None


def ttft_spread(result: dict[str, Any]) -> dict[str, Any]:
    """The run's TTFTs (vLLM's client with --save-detailed: ``ttfts``, seconds, one per request
    in the order sent) as deciles in ms, and the median of each half of the requests sent:
    where a median sits between a fast and a slow group, and whether the start differs."""
    ttfts = [1000 * t for t in result.get("ttfts") or [] if t]
    if len(ttfts) < 10:
        return {}
    half = len(ttfts) // 2
    return {"ttft_ms_deciles": [round(q, 1) for q in statistics.quantiles(ttfts, n=10)],
            "ttft_ms_median_by_half": [round(statistics.median(ttfts[:half]), 1),
                                       round(statistics.median(ttfts[half:]), 1)]}


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, concurrency), cache_aware policy (and each cache_aware@F variant run)
    and base policy: cache_aware / base for tok/s, TTFT p50 and ITL p50 in each round where
    both ran, and the medians of those per-round ratios; each policy's median fleet
    prefix-cache hit rate there."""
    rows = []
    for workload, c in sorted({(r["workload"], r["concurrency"]) for r in runs}):
        here = [r for r in runs if r["workload"] == workload and r["concurrency"] == c]
        ran = [*POLICIES, *sorted({r["policy"] for r in here} - set(POLICIES))]
        rates = {p: statistics.median(r["fleet_hit_rate"] for r in here if r["policy"] == p)
                 for p in ran if any(r["policy"] == p and r["fleet_hit_rate"] is not None for r in here)}
        for policy, base in ((p, b) for p in ran for b in bases_of(p)):
            pairs = [(a, b) for a in here for b in here
                     if a["policy"] == policy and b["policy"] == base and a["round"] == b["round"]]
            if not pairs:
                continue

            def per_round(get: Any, pairs: list[tuple[dict[str, Any], dict[str, Any]]] = pairs) -> list[float]:
                return [round(get(a) / get(b), 4) for a, b in pairs if get(b)]

            tps = per_round(lambda r: r["output_tokens_per_s"])
            ttft = per_round(lambda r: r["ttft_ms"]["median"])
            itl = per_round(lambda r: r["itl_ms"]["median"])
            rows.append({"workload": workload, "concurrency": c, "policy": policy, "base": base,
                         "rounds": len(pairs), "tps": round(statistics.median(tps), 3) if tps else None,
                         "ttft_p50": round(statistics.median(ttft), 3) if ttft else None,
                         "itl_p50": round(statistics.median(itl), 3) if itl else None,
                         "tps_rounds": tps, "ttft_p50_rounds": ttft, "itl_p50_rounds": itl,
                         "fleet_hit_rate": {p: round(v, 4) for p, v in rates.items()}})
    return rows


def acceptance(rows: list[dict[str, Any]], policy: str = "cache_aware") -> list[dict[str, Any]]:
    """Each ACCEPTANCE check of POLICY (and DP_ACCEPTANCE's, where vLLM's data parallel
    ran) with the measured medians and whether it held (None: not run)."""
    out = []
    for goal in (*ACCEPTANCE, *(DP_ACCEPTANCE if any(r["base"] == YARDSTICK for r in rows) else ())):
        row = next((r for r in rows if r["workload"] == goal["workload"] and r["concurrency"] == goal["concurrency"]
                    and r["policy"] == policy and r["base"] == goal["base"]), None)
        held: bool | None = None
        if row is not None and row["tps"] is not None:
            held = row["tps"] >= goal["min_tps"]
            if "max_ttft_p50" in goal:
                held = held and row["ttft_p50"] is not None and row["ttft_p50"] <= goal["max_ttft_p50"]
        out.append({**goal, "tps": row["tps"] if row else None, "ttft_p50": row["ttft_p50"] if row else None,
                    "held": held})
    return out


# --- the processes ---------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def scrape(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode(errors="replace"))


def _servers() -> tuple[type, type, type]:
    """Replica, RoutingGateway and DataParallelVllm, built on lab.gpucheck.speed's Server
    (imported here so that the pure helpers above import nothing of the GPU run)."""
    from lab.gpucheck.speed import GATEWAY_KEY, NAME, Server, get

    class Replica(Server):
        """`llmhost serve --device gpu` on its own ports and workdir (WORK/SIDE)."""

        @property
        def port(self) -> int:
            return REPLICA_PORTS[self.side]

        @property
        def engine_sockets(self) -> Path:
            return self.work / self.side / "engine"

        @property
        def grpc(self) -> str:
            return f"127.0.0.1:{self.port + 1}"

    class RoutingGateway(Server):
        """`llmhost gateway` in front of REPLICAS (their gRPC and engine sockets), --routing POLICY."""

        def __init__(self, replicas: list[Any], work: Path, env: dict[str, str], policy: str) -> None:
            super().__init__("gateway", replicas[0].model, work, work / "gateway.log", {}, env)
            self.replicas, self.policy = replicas, policy
            self.keys_file = work / "gateway-keys.yml"

        @property
        def port(self) -> int:
            return GATEWAY_PORT

        @property
        def metrics_url(self) -> str:
            return f"http://127.0.0.1:{self.port + 1}/metrics"

        def command(self) -> list[str]:
            cmd = [sys.executable, "-m", "llmhost.cli", "gateway", "--listen", f"127.0.0.1:{self.port}",
                   "--metrics-listen", f"127.0.0.1:{self.port + 1}", "--keys-file", str(self.keys_file),
                   "--model", NAME, "--max-concurrent-upstream", "1024", "--log-level", "warning",
                   "--routing", self.policy.partition("@")[0]]
            if load_factor := self.policy.partition("@")[2]:
                cmd += ["--routing-load-factor", load_factor]
            for r in self.replicas:
                cmd += ["--upstream", r.grpc]
            for r in self.replicas:
                cmd += ["--engine-sockets", f"{r.grpc}={r.engine_sockets}"]
            return cmd

        def ready(self) -> bool:
            if get(self.url + "/v1/models", headers={"Authorization": f"Bearer {GATEWAY_KEY}"}) != 200:
                return False
            try:
                text = scrape(self.metrics_url, timeout=3)
            except OSError:
                return False
            ups = re.findall(r'^llmhost_gateway_upstream_up\{upstream="([^"]*)"\}\s+(\S+)', text, re.M)
            return len(ups) == len(self.replicas) and all(float(v) >= 1.0 for _, v in ups)

        def start(self, timeout_s: float = 120) -> float:
            from llmhost.bench.compare import write_bench_key

            write_bench_key(self.keys_file, GATEWAY_KEY)
            return float(super().start(timeout_s))

    class DataParallelVllm(Server):
        """vLLM's own server, `--data-parallel-size SIZE`, with the replicas' engine arguments."""

        def __init__(self, model: Path, work: Path, env: dict[str, str], engine: dict[str, Any], size: int) -> None:
            super().__init__("vllm", model, work, work / "serve-vllm-dp.log", engine, env)
            self.size = size

        @property
        def port(self) -> int:
            return YARDSTICK_PORT

        def command(self) -> list[str]:
            return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                    "--host", "127.0.0.1", "--port", str(self.port), "--data-parallel-size", str(self.size),
                    *vllm_flags(self.engine)]

    return Replica, RoutingGateway, DataParallelVllm


def vllm_flags(engine: dict[str, Any]) -> list[str]:
    """ENGINE's arguments as vLLM's command line flags (a boolean as --x or --no-x)."""
    out: list[str] = []
    for key, value in engine.items():
        flag = key.replace("_", "-")
        out += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return out


def seed_check(tokenizer: str) -> dict[str, Any]:
    """Whether vLLM's prefix_repetition dataset draws other prefixes for another seed."""
    try:
        from transformers import AutoTokenizer
        from vllm.benchmarks.datasets import PrefixRepetitionRandomDataset

        tok = AutoTokenizer.from_pretrained(tokenizer)

        def first(seed: int) -> list[str]:
            ds = PrefixRepetitionRandomDataset(random_seed=seed)
            reqs = ds.sample(tok, num_requests=4, prefix_len=64, suffix_len=8, num_prefixes=2, output_len=4)
            return sorted({str(r.prompt)[:64] for r in reqs})

        a, a2, b = first(1), first(1), first(2)
        return {"same_seed_same_prefixes": a == a2, "other_seed_other_prefixes": not set(a) & set(b)}
    except Exception as exc:  # noqa: BLE001 - recorded
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=840.0,
                    help="seconds for the whole run: no round is begun that would not fit")
    ap.add_argument("--hard-limit", type=float, default=0.0,
                    help="seconds after which everything is stopped and what was measured saved (0: budget + 150)")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--suffix-len", type=int, default=200)
    ap.add_argument("--num-prefixes", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.28)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--model-shape", choices=("qwen3", "qwen3-8b"), default="qwen3",
                    help="lab.gpucheck.model's shape: qwen3 (0.6B) or qwen3-8b")
    ap.add_argument("--prefix-requests", type=int, default=0,
                    help="requests a prefix run sends (0: max(256, 4 x concurrency)); many requests a prefix "
                         "measure the steady state rather than each prefix's first, cold computation")
    ap.add_argument("--random-requests", type=int, default=0,
                    help="requests a random run sends (0: max(256, 4 x concurrency)); more requests weigh the "
                         "last wave, where one replica may finish alone, less")
    ap.add_argument("--kv-cache-gib", type=float, default=0.0,
                    help="each replica's KV cache in GiB (vLLM's kv_cache_memory_bytes; 0: what "
                         "--gpu-memory-utilization leaves): sized so one replica holds part of the prefix set "
                         "and the fleet all of it")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="the policies each round runs, in order (reversed every other round); cache_aware@F is "
                         "cache_aware with the gateway's --routing-load-factor F")
    ap.add_argument("--only", action="append", default=[], metavar="WORKLOAD:CONCURRENCY",
                    help="run only these entries of PLAN (repeatable; each keeps its seed)")
    ap.add_argument("--skip", action="append", default=[], metavar="POLICY:WORKLOAD",
                    help="runs left out, e.g. least_loaded:prefix (repeatable)")
    ap.add_argument("--replica-per-gpu", action="store_true",
                    help="each replica on a GPU of its own (GPUs 0 and 1) instead of both on GPU 0")
    ap.add_argument("--work", type=Path, default=Path("/tmp/routing-work"))
    args = ap.parse_args(argv)
    policies = tuple(args.policies.split(","))
    if not all(p in (*POLICIES, KV_EVENTS, YARDSTICK) or cache_aware_variant(p) for p in policies):
        ap.error(f"--policies: {args.policies!r}: each one of {', '.join(POLICIES)}, {KV_EVENTS}, {YARDSTICK} "
                 "or cache_aware@F")
    if YARDSTICK in policies and not args.replica_per_gpu:
        ap.error(f"--policies: {YARDSTICK} runs vLLM's data parallel on the replicas' two GPUs: "
                 "it needs --replica-per-gpu")
    only = {(w, int(c)) for w, c in (x.split(":", 1) for x in args.only)} or set(PLAN)
    if not only <= set(PLAN):
        ap.error(f"--only: not in the plan: {sorted(only - set(PLAN))}")
    t_start = time.monotonic()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)

    import vllm

    import llmhost.gateway.routing.policies as routing
    from lab.gpucheck.model import make_in_child
    from lab.gpucheck.speed import GATEWAY_KEY, NAME, engine_config, tail
    from lab.stream_compare import GpuUse, tree_cpu_s
    from llmhost.bench.vllm_client import client_argv, run_level, summarize
    from llmhost.gateway.workers import worker_count

    (out / "nvidia-smi.txt").write_text(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip().splitlines()
    gpu = gpus[0] if gpus else ""
    used_gpus = 2 if args.replica_per_gpu else 1
    if len(gpus) < used_gpus:
        ap.error(f"--replica-per-gpu needs two GPUs; nvidia-smi lists {len(gpus)}")
    engine: dict[str, Any] = {"served_model_name": NAME, "max_model_len": args.max_model_len,
                              "gpu_memory_utilization": args.gpu_memory_utilization, "enable_prefix_caching": True}
    if args.kv_cache_gib:
        engine["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    skip = {tuple(x.split(":", 1)) for x in args.skip}

    def requests_of(workload: str, c: int) -> int:
        asked = {"prefix": args.prefix_requests, "random": args.random_requests}[workload]
        return asked or requests_for(c)
    input_len = args.prefix_len + args.suffix_len
    # Each replica's backend settings (`--setting`): kv_events where that policy runs.
    replica_settings = ["stream_interval_ms=0", *(["kv_events=true"] if KV_EVENTS in policies else [])]
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vllm": vllm.__version__, "gpu": gpu,
        "cpus": os.cpu_count(), "rounds_asked": args.rounds, "budget_s": args.budget, "policies": list(policies),
        "routing_module": {"file": routing.__file__, "policies": list(routing.POLICIES),
                           "default_policy": routing.DEFAULT_POLICY, "prefix_chars": routing.DEFAULT_PREFIX_CHARS,
                           "load_factor": routing.DEFAULT_LOAD_FACTOR},
        "model_shape": args.model_shape,
        "gpus": gpus[:used_gpus],
        "replicas": {"count": 2, "on": "a GPU each (0 and 1), two llmhost serve --device gpu servers"
                     if args.replica_per_gpu else
                     "one GPU, two llmhost serve --device gpu servers started one after the other",
                     "engine_args": engine, "settings": replica_settings},
        **({"yardstick": {"policy": YARDSTICK, "server": "vllm serve --data-parallel-size 2 on GPUs 0 and 1, "
                          "the replicas' engine arguments, started after them", "streaming": YARDSTICK_STREAMING}}
           if YARDSTICK in policies else {}),
        "gateway": {"workers": worker_count(0), "max_concurrent_upstream": 1024,
                    "restarted_per_policy": True,
                    "loads_weighed": "requests in flight over every worker (llmhost.gateway.routing.inflight)"
                    if worker_count(0) > 1 else "requests in flight of the one process"},
        "streaming": STREAMING,
        "workload": {"client": CLIENT, "plan": [list(p) for p in PLAN], "ignore_eos": True,
                     "output_len": args.output_len,
                     "prefix": {"dataset": "prefix_repetition", "prefix_len": args.prefix_len,
                                "suffix_len": args.suffix_len, "num_prefixes": args.num_prefixes},
                     "random": {"dataset": "random", "input_len": input_len},
                     "requests": {f"{w}:{c}": requests_of(w, c) for w, c in PLAN},
                     "skipped_runs": sorted(":".join(x) for x in skip),
                     "only": sorted(f"{w}:{c}" for w, c in only)},
        "acceptance_goals": list(ACCEPTANCE), "runs": [], "order": [], "skipped": []}

    def save() -> None:
        res["ratios"] = ratios(res["runs"])
        res["acceptance"] = acceptance(res["ratios"])
        if KV_EVENTS in policies:
            res["acceptance_kv_events"] = acceptance(res["ratios"], KV_EVENTS)
        res["seconds"] = round(time.monotonic() - t_start, 1)
        (out / "result.json").write_text(json.dumps(res, indent=1) + "\n")

    replica_cls, gateway_cls, yardstick_cls = _servers()
    model = Path(f"/tmp/lh-{args.model_shape}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CACHE_ROOT=str(args.work / "vllm-cache"), PYTHONUNBUFFERED="1")
    replicas = [replica_cls(side, model, args.work, args.work / f"serve-{side}.log", engine,
                            {**env, "CUDA_VISIBLE_DEVICES": str(i if args.replica_per_gpu else 0)},
                            replica_settings) for i, side in enumerate(REPLICA_PORTS)]
    yardstick = (yardstick_cls(model, args.work, {**env, "CUDA_VISIBLE_DEVICES": "0,1"}, engine, 2)
                 if YARDSTICK in policies else None)
    gateway: Any = None
    gpu_use: Any = None
    stopping = threading.Lock()

    def stop_all() -> None:
        if not stopping.acquire(blocking=False):
            return
        for s in [gateway, yardstick, *replicas]:
            if s is not None:
                try:
                    s.stop()
                except Exception as exc:  # noqa: BLE001 - go on stopping the others
                    log(f"stopping {s.side}: {exc}")
        if gpu_use is not None:
            gpu_use.close()
        for name in ("serve-replica-a.log", "serve-replica-b.log", "gateway.log", "serve-vllm-dp.log"):
            tail(args.work / name, out / name)

    def abort() -> None:
        res["exception"] = f"hard limit of {hard:.0f} s reached: stopped"
        log(res["exception"])
        save()
        stop_all()
        save()
        os._exit(3)

    hard = args.hard_limit or args.budget + 150
    watchdog = threading.Timer(hard, abort)
    watchdog.daemon = True
    watchdog.start()

    def counters(r: Any) -> dict[str, float]:
        text = scrape(r.metrics_url)
        return {k: metric_total(text, name) for k, name in REPLICA_COUNTERS.items()}

    def start_gateway(policy: str) -> Any:
        nonlocal gateway
        if gateway is not None:
            gateway.stop()
        gateway = gateway_cls(replicas, args.work, env, policy)
        took = gateway.start()
        if policy == KV_EVENTS:
            # Each worker loads vLLM's event types and the tokenizer and follows the engines
            # from its first health check on; until then it routes as cache_aware.
            time.sleep(KV_EVENTS_SETTLE_S)
        res.setdefault("gateway_ready_s", []).append(took)
        return gateway

    def measure(policy: str, workload: str, c: int, rnd: int | None, seed: int, requests: int,
                output_len: int) -> dict[str, Any]:
        # The gateway in front of the replicas, or (YARDSTICK) vLLM's data parallel server alone.
        front, fleet = ((yardstick, {"vllm-dp": yardstick}) if policy == YARDSTICK
                        else (gateway, {r.side: r for r in replicas}))
        before = {side: counters(r) for side, r in fleet.items()}
        routed0 = routing_decisions(scrape(gateway.metrics_url)) if front is gateway else {}
        procs = {"gateway" if front is gateway else YARDSTICK: front, **({} if front is yardstick else fleet)}
        cpu0 = {k: tree_cpu_s(p) for k, p in procs.items()}
        shared = {"shared_prefixes": args.num_prefixes, "prefix_len": args.prefix_len} if workload == "prefix" else {}
        argv_ = client_argv(front.url, NAME, str(model), c, requests,
                            args.suffix_len if workload == "prefix" else input_len, output_len, seed=seed, **shared)
        ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.time()
        result = run_level(argv_, GATEWAY_KEY)
        ru1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.time()
        after = {side: counters(r) for side, r in fleet.items()}
        routed1: dict[str, float] = {}
        if front is gateway:
            gw_text = scrape(gateway.metrics_url)
            (out / "gateway-metrics.txt").write_text(gw_text)
            routed1 = routing_decisions(gw_text)
        level = summarize(c, result).__dict__
        wall = max(t1 - t0, 1e-9)
        delta = {side: {k: after[side][k] - before[side][k] for k in REPLICA_COUNTERS} for side in after}
        hits = sum(d["prefix_hits"] for d in delta.values())
        queries = sum(d["prefix_queries"] for d in delta.values())
        level.update(
            policy=policy, workload=workload, round=rnd, seed=seed, requests=requests, output_len=output_len,
            total_input_tokens=result.get("total_input", result.get("total_input_tokens")),
            started=round(t0, 2), wall_s=round(wall, 1), gpu_util_pct=gpu_use.mean(0, t0, t1),
            **({"gpu_util_pct_each": [gpu_use.mean(i, t0, t1) for i in range(used_gpus)]} if used_gpus > 1 else {}),
            client_cpu_cores=round((ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / wall, 2),
            server_cpu_cores={k: round((tree_cpu_s(p) - cpu0[k]) / wall, 2) for k, p in procs.items()},
            replicas={side: {**{k: round(v, 1) for k, v in d.items()},
                             "hit_rate": hit_rate(d["prefix_hits"], d["prefix_queries"]),
                             "ttft_mean_ms": round(1000 * d["ttft_sum_s"] / d["ttft_count"], 1)
                             if d["ttft_count"] else None} for side, d in delta.items()},
            fleet_hit_rate=hit_rate(hits, queries), **ttft_spread(result),
            routing_decisions={k: round(v - routed0.get(k, 0.0), 1) for k, v in routed1.items()
                               if v - routed0.get(k, 0.0)})
        return level

    try:
        t0 = time.monotonic()
        make_in_child(args.model_shape, model)
        res["model_made_s"] = round(time.monotonic() - t0, 1)
        res["seed_check"] = seed_check(str(model))
        log(f"model ready; prefix_repetition seeds: {res['seed_check']}")
        gpu_use = GpuUse()
        for r in replicas:  # one after the other: on one GPU vLLM takes its memory share in turn
            r.start(timeout_s=420)
        res["replica_ready_s"] = {r.side: r.ready_s for r in replicas}
        if yardstick is not None:  # after the replicas: each GPU then holds a replica and one of its engines
            res["yardstick_ready_s"] = yardstick.start(timeout_s=420)
            for c in sorted({c for _, c in only}):
                w = measure(YARDSTICK, "random", c, None, 7 + c, c, 16)
                log(f"warm-up {YARDSTICK} c={c}: {w['output_tokens_per_s']:.0f} tok/s, failed {w['failed']}")
        start_gateway("least_loaded")
        # Warm-up, not recorded: the run's prompt length at both levels' batch sizes.
        for c in sorted({c for _, c in only}):
            w = measure("least_loaded", "random", c, None, 7 + c, c, 16)
            log(f"warm-up c={c}: {w['output_tokens_per_s']:.0f} tok/s, failed {w['failed']}")
        log(f"servers up and warm after {time.monotonic() - t_start:.0f} s")
        took_round: float | None = None
        for rnd in range(args.rounds):
            elapsed = time.monotonic() - t_start
            if took_round is not None and elapsed + took_round > args.budget:
                res["skipped"].append(f"rounds {rnd + 1}-{args.rounds}: {elapsed:.0f} s used, a round takes "
                                      f"{took_round:.0f} s, budget {args.budget:.0f} s")
                log(res["skipped"][-1])
                break
            t_round = time.monotonic()
            index = 0
            for policy in policy_order(rnd, policies):
                todo = {(w, c) for w, c in PLAN if (policy, w) not in skip and (w, c) in only}
                if not todo:  # nothing to measure: no gateway start either
                    index += len(PLAN)
                    continue
                if policy != YARDSTICK:  # vLLM's data parallel server is up from the start, no gateway
                    start_gateway(policy)
                res["order"].append(f"round {rnd + 1}: {policy}")
                for workload, c in PLAN:
                    seed = seed_of(rnd, index)
                    index += 1
                    if (workload, c) not in todo:
                        continue
                    run = measure(policy, workload, c, rnd, seed, requests_of(workload, c), args.output_len)
                    res["runs"].append(run)
                    per_replica = {k: (d["requests"], d["hit_rate"], d["ttft_mean_ms"])
                                   for k, d in run["replicas"].items()}
                    log(f"round {rnd + 1} {policy:12} {workload:6} c={c:<3} seed {seed}: "
                        f"{run['output_tokens_per_s']:8.0f} tok/s  TTFT p50 {run['ttft_ms']['median']:8.1f} ms  "
                        f"ITL p50 {run['itl_ms']['median']:6.2f} ms  failed {run['failed']}/{run['requests']}  "
                        f"fleet hit {run['fleet_hit_rate']}  per replica (requests, hit rate, TTFT mean ms) "
                        f"{per_replica}  "
                        f"routed {run['routing_decisions']}  GPU {run['gpu_util_pct']}%  client "
                        f"{run['client_cpu_cores']} cores  servers {run['server_cpu_cores']}  {run['wall_s']} s")
                    save()
            took_round = time.monotonic() - t_round
        for row in ratios(res["runs"]):
            log(f"{row['workload']} c={row['concurrency']} {row['policy']}/{row['base']}: tok/s {row['tps']}x "
                f"TTFT p50 {row['ttft_p50']}x ITL p50 {row['itl_p50']}x ({row['rounds']} rounds) "
                f"hit rates {row['fleet_hit_rate']}")
        for routed in ("cache_aware", KV_EVENTS):
            for a in acceptance(ratios(res["runs"]), routed):
                log(f"acceptance {routed} {a}")
    except Exception as exc:  # noqa: BLE001 - recorded; what was measured before it is kept
        res["exception"] = f"{type(exc).__name__}: {exc}"
        log(f"failed: {res['exception']}")
        import traceback

        traceback.print_exc()
    finally:
        watchdog.cancel()
        save()
        stop_all()
        res["engine_config"] = {r.side: engine_config((args.work / f"serve-{r.side}.log").read_text(errors="replace"))
                                for r in replicas if (args.work / f"serve-{r.side}.log").exists()}
        save()
    log(f"done in {res['seconds']} s")
    return 0 if "exception" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
