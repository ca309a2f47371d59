"""Cache-aware routing at c=64 on the 8B-shaped model: two replicas on one H200
(2026-12-03, vLLM 0.20.2), the servers, client and workload of
``test_h200_routing_8b_shape.py`` (80 prefixes of 2,000 tokens, 200-token suffixes, 128
out; each replica's KV cache 16 GiB), recorded in two runs:

``device-run-2026-12-03-routing-c64``, two more rounds of the load factor then shipped
(1.25), cache_aware against round_robin at c=64 only::

    python3 -m lab.gpu_routing_check OUT --rounds 2 --budget 525 --hard-limit 565 \\
        --model-shape qwen3-8b --num-prefixes 80 --prefix-requests 1024 --kv-cache-gib 16 \\
        --gpu-memory-utilization 0.40 --only prefix:64 --skip least_loaded:prefix \\
        --skip least_loaded:random

``device-run-2026-12-03-routing-load-factor``, the load factor 1.25 against 2 (the
gateway's ``--routing-load-factor``; with two replicas, 2 never binds), both against
round robin, two rounds of 768 requests (720 sent: 9 a prefix)::

    python3 -m lab.gpu_routing_check OUT --rounds 2 --budget 515 --hard-limit 540 \\
        --model-shape qwen3-8b --num-prefixes 80 --prefix-requests 768 --kv-cache-gib 16 \\
        --gpu-memory-utilization 0.40 --only prefix:64 \\
        --policies round_robin,cache_aware,cache_aware@2

What they showed: with the bound at 1.25, 5-11 % of the requests went past it to the
replica that did not hold their prefix, and cache_aware at c=64 stayed short of the
issue's targets (1.25x and 1.16x the tokens per second, TTFT p50 1.08x and 1.60x). With
no request moved (factor 2), the fleet hit rate rose from 0.65 to 0.78 and cache_aware
reached 1.35x the tokens per second and 0.46x the TTFT p50 of round robin (medians of two
rounds; 0.39x and 0.53x). The default became 1.5 (see docs/performance.md).

Every ratio and verdict is recomputed here from the raw runs, and docs/performance.md's
table is checked against them. No timing is measured here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.gpu_routing_check import acceptance, policy_order, ratios
from tests.harness.paths import FIXTURES, ROOT
from tests.records._routing import assert_last_gateway_counted_its_round, assert_planned_runs

HOST = FIXTURES / "gpu" / "h200-580.159.04-real"
C64 = HOST / "device-run-2026-12-03-routing-c64"
FACTOR = HOST / "device-run-2026-12-03-routing-load-factor"
POLICIES = {C64: ("cache_aware", "round_robin", "least_loaded"),
            FACTOR: ("round_robin", "cache_aware", "cache_aware@2")}
SKIPPED = {C64: {"least_loaded"}, FACTOR: set()}
SENT = {C64: 960, FACTOR: 720}  # prefix_repetition: 80 prefixes x (requests // 80)


def _res(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())


@pytest.fixture(scope="module", params=[C64, FACTOR], ids=["c64", "load-factor"])
def run(request: pytest.FixtureRequest) -> Path:
    return request.param


def test_the_8b_shape_and_workload_of_the_earlier_run(run: Path):
    res = _res(run)
    assert res["gpu"] == "NVIDIA H200, 580.159.04" and res["vllm"] == "0.20.2"
    assert res["model_shape"] == "qwen3-8b"
    assert res["replicas"]["engine_args"]["kv_cache_memory_bytes"] == 16 * 2**30
    assert res["workload"]["prefix"] == {"dataset": "prefix_repetition", "prefix_len": 2000, "suffix_len": 200,
                                         "num_prefixes": 80}
    assert res["workload"]["only"] == ["prefix:64"]
    assert res["routing_module"]["load_factor"] == 1.25  # the default of the code that ran
    assert "exception" not in res and res["skipped"] == []


def test_every_run_in_order_with_its_seed(run: Path):
    res = _res(run)
    policies = POLICIES[run]
    expected = [(r, p) for r in range(2) for p in policy_order(r, policies) if p not in SKIPPED[run]]
    assert [(x["round"], x["policy"]) for x in res["runs"]] == expected
    assert_planned_runs(res, policies, "prefix", 64, SENT[run])


def test_the_last_gateways_counters_are_its_runs(run: Path):
    assert_last_gateway_counted_its_round(run, _res(run))


def test_ratios_and_acceptance_as_measured(run: Path):
    res = _res(run)
    rows = ratios(res["runs"])
    assert rows == res["ratios"] and acceptance(rows) == res["acceptance"]
    shipped = next(v for v in res["acceptance"] if (v["workload"], v["concurrency"]) == ("prefix", 64))
    assert shipped["held"] is False  # the load factor 1.25 missed both targets at c=64


def test_past_the_bound_a_request_loses_its_prefix_and_no_bound_meets_the_targets():
    res = _res(FACTOR)
    moved = {x["policy"]: x["routing_decisions"].get("load_bound", 0.0) / SENT[FACTOR] for x in res["runs"]}
    assert moved["cache_aware@2"] == 0.0 and 0.05 < moved["cache_aware"] < 0.15
    rates = {(x["policy"], x["round"]): x["fleet_hit_rate"] for x in res["runs"]}
    for rnd in range(2):
        assert rates[("cache_aware@2", rnd)] > rates[("cache_aware", rnd)] + 0.1 > rates[("round_robin", rnd)] + 0.2
    row = next(r for r in res["ratios"] if r["policy"] == "cache_aware@2")
    assert row["tps"] >= 1.3 and row["ttft_p50"] <= 0.5 and row["rounds"] == 2
    assert min(row["tps_rounds"]) >= 1.3 and max(row["ttft_p50_rounds"]) > 0.5  # one round's TTFT above 0.5x


def test_the_documented_table_is_the_records():
    doc = (ROOT / "docs" / "performance.md").read_text()
    assert "### The load bound at c=64 on the 8B shape, 2026-12-03" in doc
    for run, label in ((C64, "1,024"), (FACTOR, "768")):
        for row in _res(run)["ratios"]:
            rates = " / ".join(f"{row['fleet_hit_rate'][p]:.3f}" for p in (row["policy"], row["base"]))
            line = (f"| {label} | {row['policy']} | {row['rounds']} | {row['tps']:.2f}x | {row['ttft_p50']:.2f}x | "
                    f"{row['itl_p50']:.2f}x | {rates} |")
            assert line in doc, line
