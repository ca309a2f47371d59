"""The gateway's routing policies over two replicas on one H200 (2026-12-02, vLLM 0.20.2),
recorded in ``device-run-2026-12-02-routing``:

    python3 -m lab.gpu_routing_check OUT --rounds 3 --budget 840

Two ``llmhost serve --device gpu`` servers of the Qwen3-0.6B-shaped random model on the
one GPU (0.28 of its memory each, prefix caching on), one ``llmhost gateway`` in front
of both (their engine sockets, 4 workers), restarted with ``--routing cache_aware``,
``round_robin`` and ``least_loaded`` in turn; vLLM's own client in process on the same
16 cores: prefix_repetition (32 prefixes x 2,000 tokens, 200-token suffixes) at c=64 and
256, random (2,200 tokens) at c=64, 128 tokens out, a seed of its own per run.

What fell short: the issue's acceptance for shared prefixes (cache_aware against
round_robin: TTFT p50 <= 0.5x and tok/s >= 1.3x at c=64 and 256) did not hold: tok/s
came out about even and TTFT p50 higher. Each replica's prefix cache held all 32
prefixes, so round robin missed only once per prefix per replica and its fleet hit rate
was within a few points of cache_aware's: this workload cannot show what cache-aware
routing saves. The random workload's check (cache_aware >= 0.97x least_loaded tok/s)
held. The run is short of its third round's least_loaded runs at prefix c=256 and random
c=64: the lent machine went back while they ran (the driver never finished, so the
servers' log tails did not come back either); those two ratios have two rounds.

Every ratio and acceptance verdict is recomputed here from the raw runs; what
docs/performance.md ("Cache-aware routing on one H200, 2026-12-02") states is checked
against them."""

from __future__ import annotations

import json

import pytest

from lab.gpu_routing_check import (
    ACCEPTANCE,
    PLAN,
    POLICIES,
    acceptance,
    hit_rate,
    policy_order,
    ratios,
    requests_for,
    routing_decisions,
    seed_of,
)
from tests.harness.paths import FIXTURES, ROOT

RUN = FIXTURES / "gpu" / "h200-580.159.04-real" / "device-run-2026-12-02-routing"
# What the lost machine left unrun: round 3's least_loaded after its first workload.
MISSING = {(2, "least_loaded", "prefix", 256), (2, "least_loaded", "random", 64)}
PREFIX_SHARE = 2000 / 2200  # the prompt tokens a prefix-cache hit can cover
BLOCK = 16  # vLLM's KV-cache block: only whole blocks hit


@pytest.fixture(scope="module")
def res() -> dict:
    return json.loads((RUN / "result.json").read_text())


def test_recorded_on_one_h200_with_the_kit(res: dict):
    assert res["gpu"] == "NVIDIA H200, 580.159.04" and res["vllm"] == "0.20.2" and res["cpus"] == 16
    smi = (RUN / "nvidia-smi.txt").read_text()
    assert "NVIDIA H200" in smi and "580.159.04" in smi
    assert res["routing_module"]["file"] == "/tmp/kit/project/src/llmhost/gateway/routing.py"
    assert res["routing_module"]["default_policy"] == "cache_aware"
    assert sorted(res["routing_module"]["policies"]) == sorted(POLICIES)
    engine = res["replicas"]["engine_args"]
    assert engine["gpu_memory_utilization"] == 0.28 and engine["enable_prefix_caching"] is True
    assert engine["max_model_len"] >= 2200 + 128
    assert res["gateway"]["workers"] == 4 and res["gateway"]["max_concurrent_upstream"] == 1024
    assert res["workload"]["client"].startswith("vllm bench serve (in process")
    assert res["workload"]["prefix"] == {"dataset": "prefix_repetition", "prefix_len": 2000, "suffix_len": 200,
                                         "num_prefixes": 32}
    assert res["workload"]["random"]["input_len"] == 2200 and res["workload"]["output_len"] == 128
    assert "engine sockets" in res["streaming"]["gateway_to_replicas"]
    # vLLM's prefix_repetition dataset draws other prefixes for another seed.
    assert res["seed_check"] == {"same_seed_same_prefixes": True, "other_seed_other_prefixes": True}
    # The driver never finished (the machine went back): no end, no exception recorded.
    assert "exception" not in res and "engine_config" not in res


def test_the_runs_recorded_in_alternating_order(res: dict):
    assert res["order"] == [f"round {r + 1}: {p}" for r in range(3) for p in policy_order(r)]
    expected = [(r, p, w, c) for r in range(3) for p in policy_order(r) for w, c in PLAN]
    got = [(x["round"], x["policy"], x["workload"], x["concurrency"]) for x in res["runs"]]
    assert got == [e for e in expected if e not in MISSING]


def test_every_run_its_own_seed_and_no_failed_request(res: dict):
    seeds = [x["seed"] for x in res["runs"]]
    assert len(set(seeds)) == len(seeds)
    for x in res["runs"]:
        index = policy_order(x["round"]).index(x["policy"]) * len(PLAN) + PLAN.index((x["workload"], x["concurrency"]))
        assert x["seed"] == seed_of(x["round"], index)
        assert x["requests"] == requests_for(x["concurrency"]) == x["completed"] and x["failed"] == 0
        assert 1.0 <= x["tokens_per_event"] <= 1.2  # one event per engine step


def test_every_request_routed_by_its_policy(res: dict):
    for x in res["runs"]:
        decided = x["routing_decisions"]
        assert sum(decided.values()) == x["requests"]
        if x["policy"] == "cache_aware":
            # Every prompt has a key (its first 1,024 characters); the bound sent the rest on.
            assert set(decided) == {"prefix", "load_bound"}
        else:
            assert set(decided) == {x["policy"]}
    # The gateway's last /metrics is the last run's fresh gateway.
    last = res["runs"][-1]
    text = (RUN / "gateway-metrics.txt").read_text()
    assert {k: v for k, v in routing_decisions(text).items() if v} == last["routing_decisions"]


def test_fleet_hit_rates_follow_from_the_replicas_counters(res: dict):
    for x in res["runs"]:
        hits = sum(r["prefix_hits"] for r in x["replicas"].values())
        queries = sum(r["prefix_queries"] for r in x["replicas"].values())
        assert x["fleet_hit_rate"] == hit_rate(hits, queries)
    # Queries count every prompt token at admission: they match the client's input tokens
    # but where the backend's metrics push came after the last scrape (the last run).
    matched = [x for x in res["runs"] if sum(r["prefix_queries"] for r in x["replicas"].values())
               == x["total_input_tokens"]]
    assert len(matched) >= len(res["runs"]) - 1


def test_round_robin_missed_once_per_prefix_per_replica(res: dict):
    """Why the shared-prefix acceptance could not show: with each replica holding every
    prefix, round robin's fleet hit rate is (1 - 2 x 32 / requests) of the prefix's share."""
    num_prefixes = res["workload"]["prefix"]["num_prefixes"]
    prefix_blocks = res["workload"]["prefix"]["prefix_len"] // BLOCK * BLOCK
    for x in res["runs"]:
        if x["workload"] != "prefix":
            continue
        requests = x["requests"]
        one_miss_each = (1 - 2 * num_prefixes / requests) * prefix_blocks / 2200
        if x["policy"] == "round_robin":
            assert abs(x["fleet_hit_rate"] - one_miss_each) < 0.002
        # cache_aware never fell below it; one replica per prefix would give (1 - 32 / requests).
        if x["policy"] == "cache_aware":
            assert one_miss_each <= x["fleet_hit_rate"] < (1 - num_prefixes / requests) * PREFIX_SHARE


def test_the_recorded_ratios_follow_from_the_raw_runs(res: dict):
    rows = ratios(res["runs"])
    assert rows == res["ratios"]
    assert acceptance(rows) == res["acceptance"]
    rounds = {(r["workload"], r["concurrency"], r["base"]): r["rounds"] for r in rows}
    assert rounds == {("prefix", 64, "round_robin"): 3, ("prefix", 64, "least_loaded"): 3,
                      ("prefix", 256, "round_robin"): 3, ("prefix", 256, "least_loaded"): 2,
                      ("random", 64, "round_robin"): 3, ("random", 64, "least_loaded"): 2}


def test_acceptance_as_measured(res: dict):
    """The random workload's check held; the shared-prefix checks did not (docstring above)."""
    verdicts = acceptance(ratios(res["runs"]))
    assert [(v["workload"], v["concurrency"], v["base"]) for v in verdicts] == \
        [(g["workload"], g["concurrency"], g["base"]) for g in ACCEPTANCE]
    for v in verdicts:
        if v["workload"] == "random":
            assert v["held"] is True and v["tps"] >= v["min_tps"]
        else:
            assert v["held"] is False and v["tps"] < v["min_tps"] and v["ttft_p50"] > v["max_ttft_p50"]


def test_the_documented_table_is_the_records(res: dict):
    doc = (ROOT / "docs" / "performance.md").read_text()
    assert "### Cache-aware routing on one H200, 2026-12-02" in doc
    for row in res["ratios"]:
        rate = row["fleet_hit_rate"]
        line = (f"| {row['workload']} | {row['concurrency']} | {row['base']} | {row['rounds']} | {row['tps']:.2f}x | "
                f"{row['ttft_p50']:.2f}x | {row['itl_p50']:.2f}x | {rate['cache_aware']:.3f} / "
                f"{rate['round_robin']:.3f} / {rate['least_loaded']:.3f} |")
        assert line in doc, line
