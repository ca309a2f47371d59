"""The gateway's speed measured on the H100 (2026-11-25, vLLM 0.20.2), recorded in
``device-run-2026-11-25-gateway``:

    python3 -m lab.gpu_speed OUT --servers together --gpu-memory-utilization 0.2 --gateway \\
        --no-grouped --rounds 3 --concurrency 1,16,64,256 --duration 10 --budget 900

``triton`` (one response per engine step over Triton HTTP SSE), ``vllm`` (vLLM's own
OpenAI server) and ``gateway`` (``llmhost gateway`` -> Triton gRPC -> the ``triton`` side's
server, OpenAI ``/v1/completions``), rotated each round; the client ``llmhost bench
--processes 8`` on the same 16 cores. What docs/performance-history.md ("The gateway on the H100")
states of it is checked here from the recorded numbers."""

from __future__ import annotations

import statistics

import pytest

from lab.gpucheck import speed as gpu_speed
from tests.harness.gpu_runs import clean_levels, levels, load, median_ratio, ratios
from tests.harness.paths import FIXTURES

RUN = FIXTURES / "gpu" / "h100-580.159.04-real" / "device-run-2026-11-25-gateway"
LEVELS = [1, 16, 64, 256]
SIDES = ("triton", "vllm", "gateway")


@pytest.fixture(scope="module")
def res() -> dict:
    return load(RUN)


def _span(values, digits: int = 2) -> tuple[float, float]:
    values = list(values)
    return round(min(values), digits), round(max(values), digits)


def _median(res: dict, side: str, c: int, key: str) -> int:
    lvs = levels(res, side, c)
    if key == "tps":
        return round(statistics.median(lv["output_tokens_per_s"] for lv in lvs))
    return round(statistics.median(lv["ttft_s"]["p50"] * 1000 for lv in lvs))


def test_recorded_on_the_h100_every_level_complete_and_error_free(res: dict):
    assert res["gpu"] == "NVIDIA H100 80GB HBM3, 580.159.04" and res["vllm"] == "0.20.2" and res["cpus"] == 16
    assert "NVIDIA H100 80GB HBM3" in (RUN / "nvidia-smi.txt").read_text()
    assert res["date"] == "2026-11-25T16:28:53Z" and res["seconds"] == 724.9
    assert "exception" not in res and res["skipped"] == [] and res["rounds_asked"] == 3
    assert res["servers"] == "together" and set(res["runs"]) == set(SIDES)
    w = res["workload"]
    assert w["concurrency"] == LEVELS and w["duration_s"] == 10.0 and w["client_processes"] == 8
    assert (w["prompt_words"], w["output_tokens"], w["ignore_eos"]) == (64, 128, True)
    # The three sides rotate: each goes first once.
    assert res["order"] == [gpu_speed.order(r, list(SIDES)) for r in range(3)]
    assert len(clean_levels(res, SIDES, rounds=3)) == 36
    assert res["ready_s"] == {"triton": [101.1], "vllm": [49.0], "gateway": [1.0]}
    # One engine config on both engines; the gateway runs none of its own.
    assert res["engine_config_equal"] is True and set(res["engine_config"]) == {"triton", "vllm"}
    assert set(res["engine_args"]) == {"triton", "vllm"}
    assert "llmhost gateway -> Triton gRPC" in res["streaming"]["gateway"]
    assert "done in 724.9 s; engine config equal on all sides: True" in (RUN / "speed-stdout.log").read_text()


def test_the_medians_table(res: dict):
    med = {(p, b): {c: (median_ratio(res, p, b, c), median_ratio(res, p, b, c, "ttft")) for c in LEVELS}
           for p, b in (("gateway", "triton"), ("gateway", "vllm"), ("triton", "vllm"))}
    assert med == {
        ("gateway", "triton"): {1: (1.05, 1.12), 16: (0.95, 1.32), 64: (1.03, 1.31), 256: (0.89, 1.55)},
        ("gateway", "vllm"): {1: (1.02, 1.01), 16: (0.95, 1.24), 64: (1.07, 0.86), 256: (1.25, 1.49)},
        ("triton", "vllm"): {1: (0.93, 0.98), 16: (0.98, 0.94), 64: (1.04, 0.62), 256: (1.41, 0.96)}}
    assert {s: [_median(res, s, c, "tps") for c in LEVELS] for s in SIDES} == {
        "triton": [470, 5437, 14560, 20970], "vllm": [449, 5862, 13284, 15151],
        "gateway": [471, 5172, 15139, 18991]}
    assert {s: [_median(res, s, c, "ttft") for c in LEVELS] for s in SIDES} == {
        "triton": [14, 24, 74, 366], "vllm": [16, 25, 108, 417], "gateway": [16, 31, 87, 533]}
    # Round 1 (the gateway measured last) holds its low throughput at c=16 and c=64.
    assert ratios(res, "gateway", "triton", 16) == [0.73, 1.07, 0.95]
    assert ratios(res, "gateway", "triton", 64) == [0.82, 1.03, 1.05]
    assert ratios(res, "gateway", "vllm", 16) == [0.72, 0.96, 0.95]


def test_the_gateway_goals(res: dict):
    # Throughput >= 0.95x and TTFT p50 <= 1.10x of the native path; >= 0.90x of vLLM's server at c=16, 64.
    # The script's summary agrees with today's arithmetic over the raw sweeps.
    goals = gpu_speed.gateway_goals()
    assert res["gateway_goals"]["gateway/vllm"]["levels"] == [16, 64]
    native = gpu_speed.ratios(res["runs"], "gateway", "triton")
    assert gpu_speed.misses(native, goals["gateway/triton"]) == res["summary"]["gateway/triton"]["misses"] == [
        "c=1: TTFT p50 1.12x of triton > 1.10", "c=16: TTFT p50 1.32x of triton > 1.10",
        "c=64: TTFT p50 1.31x of triton > 1.10", "c=256: throughput 0.89x of triton < 0.95",
        "c=256: TTFT p50 1.55x of triton > 1.10"]
    server = gpu_speed.ratios(res["runs"], "gateway", "vllm")
    assert gpu_speed.misses(server, goals["gateway/vllm"]) == res["summary"]["gateway/vllm"]["misses"] == []
    assert res["gateway_goal_met"] is False
    # The speed goal of the native path (tok/s >= 0.97x, TTFT p50 <= 1.10x of vLLM's server)
    # is missed at c=1 only in this run.
    assert res["summary"]["triton/vllm"]["misses"] == ["c=1: throughput 0.93x of vllm < 0.97"]
    assert res["goal_met"] is False


def test_streaming_granularity(res: dict):
    tpe = {s: [_span((lv["tokens_per_event"] for lv in levels(res, s, c)), 2) for c in LEVELS] for s in SIDES}
    assert tpe == {
        "triton": [(1.0, 1.01), (1.2, 1.3), (4.93, 7.31), (27.19, 35.41)],
        "vllm": [(1.01, 1.01), (1.01, 1.01), (1.1, 1.14), (1.19, 1.24)],
        "gateway": [(1.0, 1.01), (1.71, 1.87), (7.0, 9.83), (35.07, 39.74)]}


def test_the_gateways_cpu(res: dict):
    gw = res["runs"]["gateway"]
    assert [s["server_cpu_s"]["gateway"]["python3"] for s in gw] == [15.04, 15.65, 15.88]
    per_token = [1000 * s["server_cpu_s"]["gateway"]["python3"] /
                 sum(lv["output_tokens_per_s"] * lv["duration_s"] for lv in s["levels"]) for s in gw]
    assert _span(per_token, 3) == (0.035, 0.042)  # ms of CPU per output token over a sweep
    # Per level (the watched gateway process): cores and ms per output token.
    by_level = {c: (_span(lv["threads"]["by_process"]["python3"]["cores"] for lv in levels(res, "gateway", c)),
                    _span((lv["threads"]["by_process"]["python3"]["cpu_ms_per_token"]
                           for lv in levels(res, "gateway", c)), 3)) for c in LEVELS}
    assert by_level == {1: ((0.14, 0.14), (0.269, 0.339)), 16: ((0.51, 0.53), (0.09, 0.12)),
                        64: ((0.37, 0.42), (0.025, 0.036)), 256: ((0.23, 0.26), (0.011, 0.014))}
    # Its busiest thread, the event loop's (comm python3), stayed at or under 0.34 of a core.
    busiest = [lv["threads"]["top_threads"][0] for c in LEVELS for lv in levels(res, "gateway", c)]
    assert {t["comm"] for t in busiest} == {"python3"} and max(t["cores"] for t in busiest) == 0.337
    # The server behind it worked as for the native path (CPU s per sweep of 56-58 s).
    triton_behind = [s["server_cpu_s"]["triton"] for s in gw]
    assert _span(t["triton_python_backend_stub"] for t in triton_behind) == (33.38, 34.47)
    assert _span(t["triton_python_backend_stub"] for t in (s["server_cpu_s"]["triton"]
                                                           for s in res["runs"]["triton"])) == (33.45, 34.25)
    # An idle gateway (other sides' sweeps) used under 0.35 CPU s.
    assert max(s["server_cpu_s"]["gateway"]["python3"] for side in ("triton", "vllm")
               for s in res["runs"][side]) < 0.35


def test_the_client_and_the_machine_were_not_the_limit(res: dict):
    busiest = [lv["client_cpu_max_s"] / lv["duration_s"] for s in SIDES for c in LEVELS for lv in levels(res, s, c)]
    assert _span(busiest, 3) == (0.015, 0.106)
    util = {s: [_span((lv["samples"]["gpu_util_pct"] for lv in levels(res, s, c)), 0) for c in LEVELS] for s in SIDES}
    assert util == {"triton": [(53, 67), (48, 54), (43, 49), (30, 36)],
                    "vllm": [(58, 62), (52, 57), (45, 46), (22, 33)],
                    "gateway": [(55, 68), (40, 54), (39, 53), (29, 40)]}
    busy = [_span((lv["samples"]["cpu_cores_busy"] for s in SIDES for lv in levels(res, s, c)), 1) for c in LEVELS]
    assert busy == [(1.6, 2.1), (3.3, 4.0), (3.3, 3.8), (2.8, 3.8)]
    for s in SIDES:
        for c in LEVELS:
            for lv in levels(res, s, c):
                assert sum(p["runq_wait_cores"] for p in lv["threads"]["by_process"].values()) < 0.003
