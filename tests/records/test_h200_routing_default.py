"""The shipped routing default, cache_aware with the load factor 1.5, on the 8B-shaped model:
two replicas on one H200 (2026-12-03, vLLM 0.20.2), the servers, client and workload of
``test_h200_routing_load_factor.py`` (80 prefixes of 2,000 tokens, 200-token suffixes,
128 out; each replica's KV cache 16 GiB), recorded in three runs, one call each:

``device-run-2026-12-03-routing-default-c64``, against round robin at c=64, three rounds
of 768 requests asked (720 sent: 9 a prefix)::

    python3 -m lab.gpu_routing_check OUT --rounds 3 --budget 515 --hard-limit 545 \\
        --model-shape qwen3-8b --num-prefixes 80 --prefix-requests 768 --kv-cache-gib 16 \\
        --gpu-memory-utilization 0.40 --only prefix:64 --policies round_robin,cache_aware

``device-run-2026-12-03-routing-default-c256``, the same at c=256, two rounds of 1,024
asked (960 sent): ``--rounds 2 --prefix-requests 1024 --only prefix:256``;

``device-run-2026-12-03-routing-default-random``, random 2,200-token prompts at c=64
against least loaded, three rounds of 256: ``--only random:64 --policies
least_loaded,cache_aware``.

What they showed: at c=256 the issue's targets held (1.66x the tokens per second, 0.22x
the TTFT p50 of round robin); at c=64 the throughput target held (1.30x) and the TTFT p50
did not (0.54x: 0.94x, 0.51x, 0.54x by round); on random prompts cache_aware kept 0.97x the
throughput of least loaded, the floor, with half its TTFT p50. The bound moved 1-2 % of
the shared-prefix requests at c=64 and c=256 (1.25 had moved 5-11 %).

Every ratio and verdict is recomputed here from the raw runs, and docs/performance.md's
table is checked against them. No timing is measured here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.gpu_routing_check import PLAN, acceptance, policy_order, ratios
from tests.harness.paths import FIXTURES, ROOT
from tests.records._routing import assert_last_gateway_counted_its_round, assert_planned_runs

HOST = FIXTURES / "gpu" / "h200-580.159.04-real"
C64 = HOST / "device-run-2026-12-03-routing-default-c64"
C256 = HOST / "device-run-2026-12-03-routing-default-c256"
RANDOM = HOST / "device-run-2026-12-03-routing-default-random"
# Per run: its (workload, concurrency), its policies in the order of round 0, its rounds, the
# requests sent each time (prefix_repetition: 80 prefixes x (asked // 80)).
PLANNED = {
    C64: (("prefix", 64), ("round_robin", "cache_aware"), 3, 720),
    C256: (("prefix", 256), ("round_robin", "cache_aware"), 2, 960),
    RANDOM: (("random", 64), ("least_loaded", "cache_aware"), 3, 256),
}
RUNS = list(PLANNED)


def _res(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())


@pytest.fixture(scope="module", params=RUNS, ids=["c64", "c256", "random"])
def run(request: pytest.FixtureRequest) -> Path:
    return request.param


def test_the_shipped_default_on_the_8b_shape_and_workload(run: Path):
    res = _res(run)
    (workload, c), policies, _, _ = PLANNED[run]
    assert res["gpu"] == "NVIDIA H200, 580.159.04" and res["vllm"] == "0.20.2"
    assert res["model_shape"] == "qwen3-8b"
    assert res["replicas"]["engine_args"]["kv_cache_memory_bytes"] == 16 * 2**30
    assert res["workload"]["prefix"] == {"dataset": "prefix_repetition", "prefix_len": 2000, "suffix_len": 200,
                                         "num_prefixes": 80}
    assert res["workload"]["only"] == [f"{workload}:{c}"] and res["policies"] == list(policies)
    # The gateway ran the code's defaults: cache_aware first, with the load factor 1.5.
    assert res["routing_module"]["default_policy"] == "cache_aware"
    assert res["routing_module"]["load_factor"] == 1.5
    assert "exception" not in res and res["skipped"] == []


def test_every_run_in_order_with_its_seed_and_the_last_counted_by_its_gateway(run: Path):
    res = _res(run)
    (workload, c), policies, rounds, sent = PLANNED[run]
    assert [(x["round"], x["policy"]) for x in res["runs"]] == [
        (r, p) for r in range(rounds) for p in policy_order(r, policies)]
    assert_planned_runs(res, policies, workload, c, sent)
    assert_last_gateway_counted_its_round(run, res)


def test_ratios_and_acceptance_as_measured(run: Path):
    res = _res(run)
    rows = ratios(res["runs"])
    assert rows == res["ratios"] and acceptance(rows) == res["acceptance"]
    (workload, c), _, rounds, _ = PLANNED[run]
    [row] = [r for r in rows if r["policy"] == "cache_aware"]
    assert row["rounds"] == rounds
    verdicts = {(v["workload"], v["concurrency"]): v["held"] for v in res["acceptance"]}
    # Each run measured its own check only: c=64 missed (on TTFT), c=256 and random held.
    assert verdicts == {k: ({C64: False, C256: True, RANDOM: True}[run] if k == (workload, c) else None)
                        for k in PLAN}


def test_c64_met_the_throughput_and_missed_the_ttft_target():
    row = _res(C64)["ratios"][0]
    assert row["tps"] >= 1.3 and row["ttft_p50"] > 0.5
    assert min(row["tps_rounds"]) > 1.29 and min(row["ttft_p50_rounds"]) > 0.5  # no round under 0.5x


def test_the_bound_moved_few_requests_and_the_fleet_kept_its_prefixes():
    for run in (C64, C256):
        _, _, _, sent = PLANNED[run]
        for x in _res(run)["runs"]:
            if x["policy"] == "cache_aware":
                assert 0 < x["routing_decisions"]["load_bound"] / sent < 0.03  # 1.25 moved 5-11 %
        rates = {(x["policy"], x["round"]): x["fleet_hit_rate"] for x in _res(run)["runs"]}
        for rnd in range(PLANNED[run][2]):
            assert rates[("cache_aware", rnd)] > rates[("round_robin", rnd)] + 0.25


def test_random_prompts_share_nothing_whatever_the_policy():
    for x in _res(RANDOM)["runs"]:
        assert x["fleet_hit_rate"] < 0.05


def test_the_documented_table_is_the_records():
    doc = (ROOT / "docs" / "performance.md").read_text()
    assert "### The shipped load factor on the 8B shape, 2026-12-03" in doc
    for run in RUNS:
        for row in _res(run)["ratios"]:
            rates = " / ".join(f"{row['fleet_hit_rate'][p]:.3f}" for p in (row["policy"], row["base"]))
            line = (f"| {row['workload']} | {row['concurrency']} | {row['base']} | {row['rounds']} | "
                    f"{row['tps']:.2f}x | {row['ttft_p50']:.2f}x | {row['itl_p50']:.2f}x | {rates} |")
            assert line in doc, line
