"""Checks shared by the records of lab.gpu_routing_check's runs."""

from __future__ import annotations

from typing import Any

from lab.gpu_routing_check import hit_rate


def assert_run_follows_from_its_counters(run: dict[str, Any], routed: float) -> float:
    """The run's routing decisions (ROUTED of them, each for its policy's reasons) and its
    fleet hit rate agree with the counters recorded; returns the fleet's prefix-cache queries."""
    assert sum(run["routing_decisions"].values()) == routed
    expected = {"prefix", "load_bound"} if run["policy"] == "cache_aware" else {run["policy"]}
    assert set(run["routing_decisions"]) == expected
    hits = sum(r["prefix_hits"] for r in run["replicas"].values())
    queries = sum(r["prefix_queries"] for r in run["replicas"].values())
    assert run["fleet_hit_rate"] == hit_rate(hits, queries)
    return queries
