"""The gateway's event loop at concurrency 1 on the H100: one run of
``lab/gateway_probe.py --levels 1 --rounds 4 --sides http,gateway,gateway-uvloop``
(2026-11-26, vLLM 0.20.2), recorded in
``device-run-2026-11-26-gateway-probe/8-uvloop-c1``. What docs/performance-history.md ("The
gateway's event loop") states of it is checked here from the recorded numbers."""

from __future__ import annotations

import statistics

from tests.records.test_h100_gateway_first_token import level, load

NAME = "8-uvloop-c1"
SIDES = ("http", "gateway", "gateway-uvloop")


def ttfts(side: str) -> list[float]:
    return [float(level(r, side, 1)["ttft_p50_ms"]) for r in load(NAME)["rounds"]]


def test_recorded_on_the_h100_four_rotating_rounds_at_c1_without_errors() -> None:
    res = load(NAME)
    assert res["device"] == "gpu" and res["cpus"] == 16 and res["duration_s"] == 10 and res["processes"] == 8
    assert res["date"].startswith("2026-11-26T14") and res["levels"] == "1"
    orders = [r["order"] for r in res["rounds"]]
    assert orders[0] == list(SIDES) and orders[1:3] == [orders[0][1:] + orders[0][:1], orders[0][2:] + orders[0][:2]]
    for r in res["rounds"]:
        for side in SIDES:
            (lv,) = r[side]["levels"]
            assert lv["c"] == 1 and lv["errors"] == 0 and lv["tok_s"] > 0
            assert 0.99 <= lv["tokens_per_event"] <= 1.01  # per engine step on every side


def test_uvloop_made_no_consistent_difference_at_c1() -> None:
    gateway, uvloop, http = ttfts("gateway"), ttfts("gateway-uvloop"), ttfts("http")
    assert http == [14.9, 16.42, 11.55, 13.94]  # the native path itself moved by 5 ms between rounds
    against_asyncio = [round(u / g, 2) for u, g in zip(uvloop, gateway, strict=True)]
    assert against_asyncio == [0.95, 0.87, 1.08, 1.05] and statistics.median(against_asyncio) == 1.0
    asyncio_vs_http = [round(g / h, 2) for g, h in zip(gateway, http, strict=True)]
    uvloop_vs_http = [round(u / h, 2) for u, h in zip(uvloop, http, strict=True)]
    assert asyncio_vs_http == [1.24, 1.06, 1.03, 1.11] and statistics.median(asyncio_vs_http) == 1.085
    assert uvloop_vs_http == [1.18, 0.92, 1.12, 1.17] and statistics.median(uvloop_vs_http) == 1.145
    cpu = [(r["gateway"]["gateway_cpu_s"], r["gateway-uvloop"]["gateway_cpu_s"]) for r in load(NAME)["rounds"]]
    assert cpu == [(1.51, 1.48), (1.56, 1.44), (1.37, 1.29), (1.35, 1.37)]
