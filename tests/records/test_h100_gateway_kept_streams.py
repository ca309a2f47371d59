"""A prototype gateway that kept its gRPC streams to Triton open, on the H100: two runs
of ``lab/gateway_probe.py`` (2026-11-26, vLLM 0.20.2, sides http, gateway with a
stream per request, and gateway-reuse: the prototype, a temporary switch that is not in
the code), recorded in ``device-run-2026-11-26-gateway-probe/{6-stream-reuse,
7-stream-reuse-b}``. What docs/performance-history.md ("Kept gRPC streams: tried, not kept")
states of them is checked here from the recorded numbers."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from tests.records.test_h100_gateway_first_token import level, load, round_cpu_ms_per_token

NAMES = ("6-stream-reuse", "7-stream-reuse-b")
SIDES = ("http", "gateway", "gateway-reuse")
DURATION_S = 10.0  # each level's, in both runs


def rounds() -> list[dict[str, Any]]:
    return [r for name in NAMES for r in load(name)["rounds"]]


def ttft(rnd: dict[str, Any], side: str, c: int) -> float:
    return float(level(rnd, side, c)["ttft_p50_ms"])


def cpu_ms_per_token(rnd: dict[str, Any], side: str) -> float:
    return round_cpu_ms_per_token(rnd, side, DURATION_S)


@pytest.mark.parametrize("name", NAMES)
def test_recorded_on_the_h100_three_rotating_rounds_without_errors(name: str) -> None:
    res = load(name)
    assert res["device"] == "gpu" and res["cpus"] == 16 and res["duration_s"] == DURATION_S and res["processes"] == 8
    assert res["date"].startswith("2026-11-26T10") and res["levels"] == "1,16,64"
    first = res["rounds"][0]["order"]
    assert sorted(first) == sorted(SIDES)
    assert [r["order"] for r in res["rounds"]] == [first, first[1:] + first[:1], first[2:] + first[:2]]
    for r in res["rounds"]:
        assert all(lv["errors"] == 0 and lv["tok_s"] > 0 for s in SIDES for lv in r[s]["levels"])
        # One channel each: the kept streams share one connection, as before.
        assert r["gateway"]["upstream_connections"] == r["gateway-reuse"]["upstream_connections"] == 1


def test_kept_streams_answered_sooner_at_c1_in_every_round() -> None:
    diffs = [round(ttft(r, "gateway-reuse", 1) - ttft(r, "gateway", 1), 2) for r in rounds()]
    assert diffs == [-1.43, -1.68, -0.33, -0.77, -0.55, -1.38]
    per_request = [round(ttft(r, "gateway", 1) / ttft(r, "http", 1), 2) for r in rounds()]
    kept = [round(ttft(r, "gateway-reuse", 1) / ttft(r, "http", 1), 2) for r in rounds()]
    assert per_request == [1.02, 1.3, 1.16, 1.23, 1.14, 1.23] and round(statistics.median(per_request), 3) == 1.195
    assert kept == [0.91, 1.14, 1.13, 1.15, 1.09, 1.1] and round(statistics.median(kept), 3) == 1.115


def test_at_c16_mostly_sooner_and_at_c64_no_consistent_difference() -> None:
    c16 = [round(ttft(r, "gateway-reuse", 16) - ttft(r, "gateway", 16), 2) for r in rounds()]
    assert c16 == [0.89, -2.14, -4.43, -4.59, -0.09, -11.09]
    ratio16 = [round(ttft(r, "gateway-reuse", 16) / ttft(r, "http", 16), 2) for r in rounds()]
    assert round(statistics.median(ratio16), 3) == 1.18
    assert round(statistics.median(round(ttft(r, "gateway", 16) / ttft(r, "http", 16), 2) for r in rounds()), 3) == 1.29
    c64 = [round(ttft(r, "gateway-reuse", 64) - ttft(r, "gateway", 64), 2) for r in rounds()]
    assert c64 == [19.16, 3.03, -18.33, -4.29, 1.46, 1.65]


def test_kept_streams_used_less_gateway_cpu_in_every_round() -> None:
    cpu = [(r["gateway"]["gateway_cpu_s"], r["gateway-reuse"]["gateway_cpu_s"]) for r in rounds()]
    assert all(kept < own for own, kept in cpu), cpu
    assert min(kept for _, kept in cpu) == 11.01 and max(kept for _, kept in cpu) == 11.82
    assert min(own for own, _ in cpu) == 11.29 and max(own for own, _ in cpu) == 13.8
    per_token = [(round(cpu_ms_per_token(r, "gateway"), 3), round(cpu_ms_per_token(r, "gateway-reuse"), 3))
                 for r in rounds()]
    assert sum(kept < own for own, kept in per_token) == 5, per_token
