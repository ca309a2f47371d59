"""The H100 runs of the code with one response per engine step as the default and the
metrics pushed before every final response (2026-11-25, vLLM 0.20.2):

* ``device-run-2026-11-25-check``: lab/gpu_check.py under KIND_GPU (`llmhost serve
  --kind KIND_GPU`) and KIND_MODEL (the roles' repository), with one response per
  engine step as the new default: every check passed, nothing left behind;
* ``device-run-2026-11-25-fresh``: gpu_speed.py, the per-step Triton path with the
  metrics pushed before every final response (then the default) against vLLM's server
  and against the same path with ``fresh_metrics=false``; 2 rounds (the budget ended
  the third) at 16/64/256. What docs/performance-history.md states of them is checked here
  from the recorded numbers."""

from __future__ import annotations

import json
import statistics

import pytest

from lab.gpucheck import check as gpu_check
from tests.harness.paths import FIXTURES

H100 = FIXTURES / "gpu" / "h100-580.159.04-real"
CHECK = H100 / "device-run-2026-11-25-check"
FRESH = H100 / "device-run-2026-11-25-fresh"
LEVELS = [16, 64, 256]


@pytest.fixture(scope="module")
def check() -> dict:
    return json.loads((CHECK / "result.json").read_text())


@pytest.fixture(scope="module")
def speed() -> dict:
    return json.loads((FRESH / "result.json").read_text())


@pytest.mark.parametrize("kind", ["KIND_GPU", "KIND_MODEL"])
def test_every_check_passed_under_both_kinds(check: dict, kind: str):
    assert check["gpu"] == "NVIDIA H100 80GB HBM3, 580.159.04" and check["vllm"] == "0.20.2"
    case = check["kinds"][kind]
    assert case["passed"] and all(case["passed"].values()), case["passed"]
    assert gpu_check.passed(case) == case["passed"]  # today's verdicts over the recorded numbers
    stop = case["stop"]
    assert stop["rc"] == 0 and stop["processes_left"] == [] and stop["shm_left"] == []
    assert stop["gpu_memory_used_mib_after"] == [0]
    assert check["all_passed"] is True


@pytest.mark.parametrize("kind", ["KIND_GPU", "KIND_MODEL"])
def test_each_kind_served_as_asked_one_response_per_engine_step(check: dict, kind: str):
    # llmhost serve's own default is KIND_MODEL now; the check asked for KIND_GPU by name.
    assert check["kinds"][kind]["rendered_kind"] == kind
    log = (CHECK / f"serve-{kind.lower()}.log").read_text(errors="replace")
    assert "stream interval 0 ms" in log


def _tps(speed: dict, side: str, c: int) -> list[float]:
    return [sweep["levels"][LEVELS.index(c)]["output_tokens_per_s"] for sweep in speed["runs"][side]]


def _ttft(speed: dict, side: str, c: int) -> list[float]:
    return [sweep["levels"][LEVELS.index(c)]["ttft_s"]["p50"] for sweep in speed["runs"][side]]


def _median_ratio(a: list[float], b: list[float]) -> float:
    return round(statistics.median(x / y for x, y in zip(a, b, strict=True)), 2)


def test_the_speed_run_is_like_for_like_and_error_free(speed: dict):
    assert speed["gpu"] == "NVIDIA H100 80GB HBM3, 580.159.04" and speed["engine_config_equal"] is True
    assert speed["settings"]["triton"] == {"stream_interval_ms": 0}
    assert speed["settings"]["variant"] == {"stream_interval_ms": 0, "fresh_metrics": "false"}
    w = speed["workload"]
    assert w["concurrency"] == LEVELS and (w["prompt_words"], w["output_tokens"], w["ignore_eos"]) == (64, 128, True)
    for side in ("triton", "vllm", "variant"):
        assert len(speed["runs"][side]) == 2
        for sweep in speed["runs"][side]:
            assert all(lv["errors"] == 0 and lv["requests"] > 0 for lv in sweep["levels"])


def test_pushing_metrics_before_every_final_response_cost_the_triton_path(speed: dict):
    # fresh_metrics=false against the per-final pushes: faster at every level, every round.
    got = {c: _median_ratio(_tps(speed, "variant", c), _tps(speed, "triton", c)) for c in LEVELS}
    assert got == {16: 1.13, 64: 1.28, 256: 1.38}
    for c in LEVELS:
        assert all(v > t for v, t in zip(_tps(speed, "variant", c), _tps(speed, "triton", c), strict=True))


def test_without_the_pushes_against_vllms_server(speed: dict):
    tps = {c: _median_ratio(_tps(speed, "variant", c), _tps(speed, "vllm", c)) for c in LEVELS}
    ttft = {c: _median_ratio(_ttft(speed, "variant", c), _ttft(speed, "vllm", c)) for c in LEVELS}
    assert tps == {16: 0.99, 64: 0.91, 256: 1.15}
    assert ttft == {16: 0.93, 64: 0.83, 256: 2.21}
    with_pushes = {c: _median_ratio(_tps(speed, "triton", c), _tps(speed, "vllm", c)) for c in LEVELS}
    assert with_pushes == {16: 0.88, 64: 0.71, 256: 0.82}
