"""Checks shared by the records of lab.gpu_routing_check's runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lab.gpu_routing_check import PLAN, cache_aware_variant, hit_rate, policy_order, routing_decisions, seed_of


def assert_run_follows_from_its_counters(run: dict[str, Any], routed: float) -> float:
    """The run's routing decisions (ROUTED of them, each for its policy's reasons) and its
    fleet hit rate agree with the counters recorded; returns the fleet's prefix-cache queries."""
    assert sum(run["routing_decisions"].values()) == routed
    if run["policy"] == "cache_aware" or cache_aware_variant(run["policy"]):
        # the key's first choice; past the load bound (which may not bind in a run), the next one
        assert "prefix" in run["routing_decisions"] and set(run["routing_decisions"]) <= {"prefix", "load_bound"}
    elif run["policy"] == "kv_events":  # the longest match, past the bound the next; no match at all
        assert "prefix" in run["routing_decisions"]
        assert set(run["routing_decisions"]) <= {"prefix", "load_bound", "no_match"}
    else:
        assert set(run["routing_decisions"]) == {run["policy"]}
    hits = sum(r["prefix_hits"] for r in run["replicas"].values())
    queries = sum(r["prefix_queries"] for r in run["replicas"].values())
    assert run["fleet_hit_rate"] == hit_rate(hits, queries)
    return queries


def assert_last_gateway_counted(run_dir: Path, runs: list[dict[str, Any]]) -> None:
    """The gateway's last /metrics (RUN_DIR's gateway-metrics.txt) counts RUNS' decisions:
    those its process made since it started."""
    summed: dict[str, float] = {}
    for x in runs:
        for reason, n in x["routing_decisions"].items():
            summed[reason] = summed.get(reason, 0.0) + n
    assert {k: v for k, v in routing_decisions((run_dir / "gateway-metrics.txt").read_text()).items() if v} == summed


def assert_planned_runs(res: dict[str, Any], policies: tuple[str, ...], workload: str, concurrency: int,
                        sent: int) -> None:
    """Each of RES's runs, one of POLICIES on WORKLOAD at CONCURRENCY, in its round's order
    with its own seed, served all SENT requests one event per engine step, and its
    decisions and hit rate follow from its counters."""
    for x in res["runs"]:
        assert (x["workload"], x["concurrency"]) == (workload, concurrency)
        index = policy_order(x["round"], policies).index(x["policy"]) * len(PLAN) + PLAN.index((workload, concurrency))
        assert x["seed"] == seed_of(x["round"], index)
        assert x["completed"] == sent and x["failed"] == 0 and 1.0 <= x["tokens_per_event"] <= 1.2
        assert_run_follows_from_its_counters(x, sent)


def assert_last_gateway_counted_its_round(run_dir: Path, res: dict[str, Any]) -> None:
    """The gateway starts again for each policy of each round: its last /metrics counts the
    decisions of RES's last run (its policy in its round)."""
    final = (res["runs"][-1]["policy"], res["runs"][-1]["round"])
    assert_last_gateway_counted(run_dir, [x for x in res["runs"] if (x["policy"], x["round"]) == final])


def assert_shipped_default_on_the_8b_shape(res: dict[str, Any], only: list[str], policies: tuple[str, ...],
                                           skipped: set[tuple[str, str]]) -> None:
    """RES ran on the H200 with vLLM 0.20.2, the 8B shape, 16 GiB of KV cache a replica,
    80 shared prefixes of 2,000 tokens, the entries ONLY of the plan, POLICIES less SKIPPED,
    and the gateway's routing as shipped: cache_aware with the load factor 1.5, four workers
    weighing every worker's requests in flight; nothing went wrong or was left out."""
    assert res["gpu"] == "NVIDIA H200, 580.159.04" and res["vllm"] == "0.20.2"
    assert res["model_shape"] == "qwen3-8b"
    assert res["replicas"]["engine_args"]["kv_cache_memory_bytes"] == 16 * 2**30
    assert res["workload"]["prefix"] == {"dataset": "prefix_repetition", "prefix_len": 2000, "suffix_len": 200,
                                         "num_prefixes": 80}
    assert res["workload"]["only"] == only
    assert res["policies"] == list(policies)
    assert {tuple(x.split(":")) for x in res["workload"]["skipped_runs"]} == skipped
    assert res["routing_module"]["default_policy"] == "cache_aware" and res["routing_module"]["load_factor"] == 1.5
    assert res["gateway"]["workers"] == 4
    assert "llmhost.gateway.routing.inflight" in res["gateway"]["loads_weighed"]
    assert "exception" not in res and res["skipped"] == []


def ratio_line(row: dict[str, Any]) -> str:
    """ROW of lab.gpu_routing_check's ratios as a line of docs/performance.md's tables:
    workload, c, base, rounds, the three ratios and both policies' fleet hit rates."""
    rates = " / ".join(f"{row['fleet_hit_rate'][p]:.3f}" for p in (row["policy"], row["base"]))
    return (f"| {row['workload']} | {row['concurrency']} | {row['base']} | {row['rounds']} | "
            f"{row['tps']:.2f}x | {row['ttft_p50']:.2f}x | {row['itl_p50']:.2f}x | {rates} |")
