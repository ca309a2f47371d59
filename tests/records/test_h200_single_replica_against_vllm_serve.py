"""One llmhost replica against `vllm serve` on one H200, after cache-aware routing landed
(lab/stream_compare.py, 2026-12-03, vLLM 0.20.2), recorded in
``device-run-2026-12-03-single-replica``, and again once the gateway's workers weighed
every worker's requests in flight (2026-12-04, ``device-run-2026-12-04-single-replica``),
each with:

    python3 -m lab.stream_compare OUT --rounds 3

`llmhost serve --device gpu` with `llmhost gateway --engine-sockets` in front (its
defaults: cache_aware routing, 4 workers on 16 cores) and vLLM's OpenAI server, both on
the one GPU (0.30 of its memory each, both up, measured in turn), vLLM's own client in
process on the same host; random 256-token prompts, 128 tokens out, three alternating
rounds. It checks that the single-replica figures the routing issue started from did not
regress with routing in the gateway's path.

What the first showed: tok/s 0.97x / 1.09x / 1.01x / 1.16x at c=1 / 16 / 64 / 256, TTFT
p50 0.69-0.86x, ITL p50 0.86-0.98x, 1.00-1.14 tokens per event, no failed request. Every
goal held but c=1's throughput (0.968x against 0.97x, its TTFT and ITL both lower than
vLLM's; the rounds spread from 0.96x to 1.05x there). The second: tok/s 1.00x / 1.00x /
0.98x / 1.12x, TTFT p50 0.74-0.93x, ITL p50 0.93-1.03x, 1.00-1.15 tokens per event, no
failed request: every goal held at every level.

The ratios are recomputed from the raw levels, and docs/performance.md's table is checked
against them. No timing is measured here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.stream_compare import SIDES, ratios
from tests.harness.paths import FIXTURES, ROOT

HOST = FIXTURES / "gpu" / "h200-580.159.04-real"
ROUTING = HOST / "device-run-2026-12-03-single-replica"
SHARED_IN_FLIGHT = HOST / "device-run-2026-12-04-single-replica"
HEADINGS = {ROUTING: "### One replica against vLLM's server after routing, 2026-12-03",
            SHARED_IN_FLIGHT: "### One replica against vLLM's server with the workers' shared counts, 2026-12-04"}
LEVELS = [1, 16, 64, 256]


@pytest.fixture(scope="module", params=[ROUTING, SHARED_IN_FLIGHT], ids=["2026-12-03", "2026-12-04"])
def run(request: pytest.FixtureRequest) -> Path:
    return request.param


@pytest.fixture(scope="module")
def res(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())


def test_both_servers_on_one_h200_with_the_issues_workload(res: dict):
    assert res["gpus"] == ["0, NVIDIA H200"] and res["vllm"] == "0.20.2"
    assert res["placement"] == {"llmhost": 0, "vllm": 0}
    assert res["door"] == "openai" and res["gateway_workers"] == 4
    w = res["workload"]
    assert (w["dataset"], w["input_len"], w["output_len"], w["ignore_eos"]) == ("random", 256, 128, True)
    assert w["concurrency"] == LEVELS


def test_three_alternating_rounds_every_level_every_request_answered(res: dict):
    assert res["order"] == ["round 1: gateway", "round 1: vllm", "round 2: vllm", "round 2: gateway",
                            "round 3: gateway", "round 3: vllm"]
    for side in SIDES:
        levels = [(r["round"], r["concurrency"]) for r in res["runs"][side]]
        assert levels == [(n, c) for n in range(3) for c in LEVELS]
        for r in res["runs"][side]:
            assert r["failed"] == 0 and r["completed"] == res["workload"]["requests"][str(r["concurrency"])]


def test_ratios_are_the_raw_levels(res: dict):
    assert ratios(res["runs"]) == res["ratios"]


def test_the_goals_hold_but_c1_throughput_on_the_first_run(res: dict, run: Path):
    rows = {r["concurrency"]: r for r in res["ratios"]}
    if run == SHARED_IN_FLIGHT:  # every goal at every level
        assert all(r["tps"] >= 0.97 and r["ttft_p50"] <= 1.10 and r["itl_p50"] <= 1.25
                   and r["tokens_per_event"]["gateway"] <= 1.2 for r in rows.values()), rows
        return
    for c, r in rows.items():
        assert r["ttft_p50"] <= 1.10 and r["itl_p50"] <= 1.25, r
        assert r["tokens_per_event"]["gateway"] <= 1.2, r
        assert r["tps"] >= 0.97 or c == 1, r
    assert 0.96 <= rows[1]["tps"] < 0.97  # the one miss, as measured
    per_round = sorted(g["output_tokens_per_s"] / v["output_tokens_per_s"]
                       for g in res["runs"]["gateway"] for v in res["runs"]["vllm"]
                       if g["concurrency"] == v["concurrency"] == 1 and g["round"] == v["round"])
    assert per_round[0] < 0.97 < per_round[-1]  # the rounds straddle the goal


def test_the_documented_table_is_the_records(res: dict, run: Path):
    doc = (ROOT / "docs" / "performance.md").read_text()
    assert HEADINGS[run] in doc
    section = doc.split(HEADINGS[run], 1)[1].split("\n### ", 1)[0]
    for r in res["ratios"]:
        line = (f"| {r['concurrency']} | {r['tps']:.2f}x | {r['ttft_p50']:.2f}x | {r['itl_p50']:.2f}x | "
                f"{r['tokens_per_event']['gateway']:.2f} / {r['tokens_per_event']['vllm']:.2f} |")
        assert line in section, line
