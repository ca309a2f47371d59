"""The arithmetic of `make bench-compare` (lab/bench_compare.py): which path runs
first in each round, and the median ratios between paths per concurrency level,
checked against the goals the project set itself for the gateway against the native
Triton path and against vLLM's own server."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmhost.bench.loadgen import LevelResult

PATHS = ("triton", "gateway", "vllm")


def write_bench_key(keys_file: Path, key: str) -> None:
    """A gateway keys file holding KEY's hash as the one key "bench"."""
    from llmhost.gateway.keys import hash_key

    keys_file.write_text(f"keys:\n  - name: bench\n    sha256: {hash_key(key)}\n")


def gateway_args(upstream: str, listen: str, metrics_listen: str, keys_file: Path, model: str,
                 max_concurrent: int) -> list[str]:
    """`llmhost gateway`'s arguments for a benchmark. MAX_CONCURRENT: room for every
    level's requests at once (the gateway's queue is not under test)."""
    return ["--upstream", upstream, "--listen", listen, "--metrics-listen", metrics_listen,
            "--keys-file", str(keys_file), "--model", model, "--max-concurrent-upstream", str(max_concurrent),
            "--log-level", "warning"]


@dataclass(frozen=True)
class Goal:
    """PATH against BASE: median throughput ratio at least MIN_TPS_RATIO and, if set,
    TTFT p50 ratio at most MAX_TTFT_RATIO, at the concurrency levels LEVELS (None: all)."""

    path: str
    base: str
    min_tps_ratio: float
    max_ttft_ratio: float | None = None
    levels: tuple[int, ...] | None = None


GOALS = (
    Goal("gateway", "triton", 0.95, 1.10),
    Goal("gateway", "vllm", 0.90, None, (16, 64)),
)


# vLLM's CPU workers carry this process title (setproctitle) under both servers.
WORKER_TITLE = "VLLM::Worker"


def client_cpus(allowed: set[int], processes: list[tuple[str, set[int]]]) -> set[int]:
    """The CPUs for the load generator: those a server's bound vLLM CPU workers leave
    to the other processes, from (process name, affinity) of the server's processes.
    Empty (run anywhere) when no worker is bound to a strict subset of ALLOWED.

    vLLM's CPU backend keeps at least one CPU free of its workers for "the other
    processes"; a client left anywhere at a higher priority than the servers
    preempts a worker whenever the kernel puts it there."""
    from llmhost.backend.cpus import frontend_cpus

    return frontend_cpus(allowed, [cpus for name, cpus in processes if WORKER_TITLE in name])


def round_order(names: list[str], rnd: int) -> list[str]:
    """The order of the paths in round RND (from 0): rotated by one each round, so
    each path runs first, second and last equally often."""
    k = rnd % len(names)
    return names[k:] + names[:k]


def _p50(r: LevelResult) -> float:
    return r.ttft_s.get("p50", math.nan)


def compare(runs: dict[str, list[list[LevelResult]]], path: str, base: str) -> list[dict[str, Any]]:
    """Per concurrency level, PATH against BASE over the rounds: the median of each
    side's tokens/s and TTFT p50, and the median of the per-round ratios (round i of
    one against round i of the other)."""
    rows = []
    for i, level in enumerate(r.concurrency for r in runs[path][0]):
        a = [rs[i] for rs in runs[path]]
        b = [rs[i] for rs in runs[base]]
        tps = [x.output_tokens_per_s / y.output_tokens_per_s for x, y in zip(a, b, strict=True)
               if y.output_tokens_per_s]
        ttft = [_p50(x) / _p50(y) for x, y in zip(a, b, strict=True) if _p50(y)]
        rows.append({
            "concurrency": level,
            f"{path}_tokens_per_s": statistics.median(x.output_tokens_per_s for x in a),
            f"{base}_tokens_per_s": statistics.median(y.output_tokens_per_s for y in b),
            "tps_ratio": statistics.median(tps) if tps else math.nan, "tps_ratios": tps,
            f"{path}_ttft_p50_s": statistics.median(_p50(x) for x in a),
            f"{base}_ttft_p50_s": statistics.median(_p50(y) for y in b),
            "ttft_ratio": statistics.median(ttft) if ttft else math.nan,
            "errors": sum(x.errors for x in a) + sum(y.errors for y in b),
        })
    return rows


def check(goal: Goal, rows: list[dict[str, Any]]) -> list[str]:
    """What of GOAL the rows miss, one line per level ([] when it is met)."""
    misses = []
    for row in rows:
        if goal.levels is not None and row["concurrency"] not in goal.levels:
            continue
        c = row["concurrency"]
        if not row["tps_ratio"] >= goal.min_tps_ratio:  # NaN misses too
            misses.append(f"c={c}: throughput {row['tps_ratio']:.2f}x of {goal.base} < {goal.min_tps_ratio:.2f}")
        if goal.max_ttft_ratio is not None and not row["ttft_ratio"] <= goal.max_ttft_ratio:
            misses.append(f"c={c}: TTFT p50 {row['ttft_ratio']:.2f}x of {goal.base} > {goal.max_ttft_ratio:.2f}")
        if row["errors"]:
            misses.append(f"c={c}: {row['errors']} failed request(s)")
    return misses
