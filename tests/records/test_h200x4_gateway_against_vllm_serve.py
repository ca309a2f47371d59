"""The gateway against `vllm serve`, recorded on the lent four-GPU machine
(lab/stream_compare.py, 4x H200, vLLM 0.20.2, 2026-11-27): llmhost's gateway with its
default worker processes on GPU 0, vLLM's server on GPU 1, vLLM's own client, two
alternating rounds at c=1/16/64/256.

The ratios the record holds are recomputed from its raw levels, and docs/performance.md's
table is checked against them. No timing is asserted."""

from __future__ import annotations

import json
import re
from typing import Any

from lab.stream_compare import SIDES, ratios
from tests.harness.paths import ROOT

RUN = ROOT / "tests" / "fixtures" / "gpu" / "h200x4-580.159.04-real" / "stream-compare-2026-11-27-workers"
LEVELS = [1, 16, 64, 256]


def _res() -> dict[str, Any]:
    return json.loads((RUN / "result.json").read_text())


def test_recorded_with_the_default_workers_one_gpu_a_side():
    res = _res()
    assert res["vllm"] == "0.20.2" and res["cpus"] == 64 and len(res["gpus"]) == 4
    assert all("NVIDIA H200" in g for g in res["gpus"])
    assert res["placement"] == {"llmhost": 0, "vllm": 1}
    assert res["gateway_workers"] == 8  # one per 4 of 64 cores, at most 8: the default
    assert res["workload"]["client"].startswith("vllm bench serve (in process")
    assert res["workload"]["concurrency"] == LEVELS and res["workload"]["ignore_eos"] is True
    assert res["order"] == ["round 1: gateway", "round 1: vllm", "round 2: vllm", "round 2: gateway"]


def test_every_level_completed_without_a_failed_request():
    res = _res()
    for side in SIDES:
        runs = res["runs"][side]
        assert sorted((r["round"], r["concurrency"]) for r in runs) == [(n, c) for n in (0, 1) for c in LEVELS]
        for r in runs:
            assert r["failed"] == 0 and r["completed"] == max(32, 4 * r["concurrency"])
            assert set(r["server_cpu_cores"]) == ({"gateway", "triton"} if side == "gateway" else {"vllm"})


def test_the_recorded_ratios_follow_from_the_raw_levels():
    res = _res()
    assert ratios(res["runs"]) == res["ratios"]


def test_the_gateway_counted_every_engine_line():
    text = (RUN / "gateway-metrics.txt").read_text()
    transit = re.search(r'llmhost_gateway_upstream_transit_seconds_count\{model="llm"\} ([0-9.e+]+)', text)
    events = re.search(r'llmhost_gateway_tokens_per_event_count\{model="llm"\} ([0-9.e+]+)', text)
    assert transit and events and float(transit.group(1)) == float(events.group(1)) > 0


def test_the_documented_table_is_the_records():
    doc = (ROOT / "docs" / "performance.md").read_text()
    for row in _res()["ratios"]:
        tpe = row["tokens_per_event"]
        line = (f"| {row['concurrency']} | {row['tps']:.2f}x | {row['ttft_p50']:.2f}x | {row['itl_p50']:.2f}x | "
                f"{tpe['gateway']:.2f} / {tpe['vllm']:.2f} | 0 / 0 |")
        assert line in doc, line
