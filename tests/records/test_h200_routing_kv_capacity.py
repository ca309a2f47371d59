"""Cache-aware routing where one replica's KV cache cannot hold every prefix: two replicas
on one H200 (2026-12-02, vLLM 0.20.2), recorded in ``device-run-2026-12-02-routing-kv``:

    python3 -m lab.gpu_routing_check OUT --rounds 3 --budget 900 --num-prefixes 128 \\
        --prefix-requests 2048 --kv-cache-gib 21.4 \\
        --skip least_loaded:prefix --skip round_robin:random

The same servers and client as ``test_h200_routing_cache_aware.py`` but each replica's
KV cache fixed at 21.4 GiB (vLLM's ``kv_cache_memory_bytes``: 200,352 tokens) and 128
prefixes of 2,000 tokens (256,000 tokens): the fleet holds the prefix set, one replica
does not. 2,048 requests a prefix run (16 a prefix), so a run measures the steady state
more than each prefix's first computation.

What it showed: cache_aware's fleet hit rate 0.75-0.76 against round robin's 0.49-0.52,
1.08x / 1.10x the tokens per second and 0.77x / 0.67x the TTFT p50 at c=64 / 256. The
issue's acceptance (1.3x and 0.5x) did not hold: this model's decode steps, not its
prefills, take most of the GPU's time (ITL p50 the same on both policies, 73-82% GPU
use), so saving a quarter of the prompt tokens' computation buys about a tenth of the
throughput. The random workload's check (>= 0.97x least_loaded) held at 0.970x.

Every ratio and verdict is recomputed here from the raw runs, and docs/performance.md's
table is checked against them."""

from __future__ import annotations

import json
import re

import pytest

from lab.gpu_routing_check import PLAN, acceptance, policy_order, ratios, routing_decisions, seed_of
from tests.harness.paths import FIXTURES, ROOT
from tests.records._routing import assert_run_follows_from_its_counters

RUN = FIXTURES / "gpu" / "h200-580.159.04-real" / "device-run-2026-12-02-routing-kv"
SKIPPED = {("least_loaded", "prefix"), ("round_robin", "random")}
KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


@pytest.fixture(scope="module")
def res() -> dict:
    return json.loads((RUN / "result.json").read_text())


def replica_kv_tokens(side: str) -> list[int]:
    text = (RUN / f"serve-{side}.log").read_text()
    return [int(n.replace(",", "")) for n in KV_TOKENS.findall(text)]


def test_one_replica_holds_part_of_the_prefix_set_and_the_fleet_all_of_it(res: dict):
    assert res["gpu"] == "NVIDIA H200, 580.159.04" and res["vllm"] == "0.20.2"
    assert res["replicas"]["engine_args"]["kv_cache_memory_bytes"] == int(21.4 * 2**30)
    prefix = res["workload"]["prefix"]
    assert prefix == {"dataset": "prefix_repetition", "prefix_len": 2000, "suffix_len": 200, "num_prefixes": 128}
    prefix_set = prefix["num_prefixes"] * prefix["prefix_len"]
    for side in ("replica-a", "replica-b"):
        (tokens,) = replica_kv_tokens(side)
        assert prefix_set / 2 < tokens < prefix_set
    assert res["workload"]["skipped_runs"] == sorted(f"{p}:{w}" for p, w in SKIPPED)
    assert res["workload"]["requests"] == {"prefix:64": 2048, "prefix:256": 2048, "random:64": 256}
    assert "exception" not in res and res["skipped"] == []


def test_every_planned_run_recorded_in_order_with_its_seed(res: dict):
    expected = [(r, p, w, c) for r in range(3) for p in policy_order(r) for w, c in PLAN if (p, w) not in SKIPPED]
    assert [(x["round"], x["policy"], x["workload"], x["concurrency"]) for x in res["runs"]] == expected
    for x in res["runs"]:
        index = policy_order(x["round"]).index(x["policy"]) * len(PLAN) + PLAN.index((x["workload"], x["concurrency"]))
        assert x["seed"] == seed_of(x["round"], index)
        assert x["completed"] == x["requests"] == res["workload"]["requests"][f"{x['workload']}:{x['concurrency']}"]
        assert x["failed"] == 0 and 1.0 <= x["tokens_per_event"] <= 1.2


def test_decisions_and_hit_rates_follow_from_the_counters(res: dict):
    for x in res["runs"]:
        queries = assert_run_follows_from_its_counters(x, x["requests"])
        # Below c=256 no request was preempted, and the queries are the client's prompt tokens.
        if x["concurrency"] < 256:
            assert queries == x["total_input_tokens"]
    last = res["runs"][-1]
    assert {k: v for k, v in routing_decisions((RUN / "gateway-metrics.txt").read_text()).items() if v} == \
        last["routing_decisions"]


def test_cache_aware_hits_more_and_its_bound_moved_few_requests(res: dict):
    for c in (64, 256):
        rates = {p: [x["fleet_hit_rate"] for x in res["runs"]
                     if x["workload"] == "prefix" and x["concurrency"] == c and x["policy"] == p]
                 for p in ("cache_aware", "round_robin")}
        assert min(rates["cache_aware"]) > max(rates["round_robin"]) + 0.2
    for x in res["runs"]:
        if x["policy"] == "cache_aware" and x["workload"] == "prefix":
            assert x["routing_decisions"]["load_bound"] / x["requests"] < 0.1


def test_ratios_and_acceptance_as_measured(res: dict):
    rows = ratios(res["runs"])
    assert rows == res["ratios"] and acceptance(rows) == res["acceptance"]
    for v in res["acceptance"]:
        if v["workload"] == "prefix":
            assert v["held"] is False and 1.05 < v["tps"] < v["min_tps"] and v["max_ttft_p50"] < v["ttft_p50"] < 0.8
        else:
            assert v["held"] is True


def test_the_documented_table_is_the_records(res: dict):
    doc = (ROOT / "docs" / "performance.md").read_text()
    assert "### Cache-aware routing where one replica's cache is too small, 2026-12-02" in doc
    for row in res["ratios"]:
        rates = " / ".join(f"{v:.3f}" for v in row["fleet_hit_rate"].values())
        line = (f"| {row['workload']} | {row['concurrency']} | {row['base']} | {row['rounds']} | {row['tps']:.2f}x | "
                f"{row['ttft_p50']:.2f}x | {row['itl_p50']:.2f}x | {rates} |")
        assert line in doc, line
