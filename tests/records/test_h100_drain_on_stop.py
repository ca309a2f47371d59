"""Drain on stop recorded on the real H100 (lab/gpu_drain_check.py, vLLM 0.20.2,
`llmhost serve --device gpu`, KIND_GPU, 2026-11-23): what it showed is checked here,
so the record and the claims made from it (docs/gpu.md) cannot drift apart."""

from __future__ import annotations

import json
import re

from tests.harness.paths import FIXTURES

RUN = FIXTURES / "gpu" / "h100-580.159.04-real" / "device-run-2026-11-23-drain"


def _result() -> dict:
    return json.loads((RUN / "result.json").read_text())


def test_recorded_on_the_h100_with_vllm_0_20_2():
    res = _result()
    assert res["gpu"].startswith("NVIDIA H100") and res["vllm"] == "0.20.2"


def test_streams_in_flight_at_sigterm_all_complete_and_nothing_is_left():
    case = _result()["complete"]
    assert case["streams"] == 32 and case["complete"] == 32 and case["errored"] == 0
    assert case["serve_rc"] == 0 and case["processes_left"] == [] and case["shm_left"] == []
    log = (RUN / "serve-complete.log").read_text()
    # Triton waits for the HTTP connections first; the backend drains meanwhile, from the stop file.
    began = log.index("[llmhost] draining (tritonserver is stopping): 32 request(s) in flight get up to 30 s")
    assert re.search(r"Timeout \d+: Found 32 HTTP service connections", log[:began + 400])
    assert "drain time over" not in log


def test_streams_that_outlive_the_drain_end_with_the_shutting_down_error():
    case = _result()["aborted"]
    assert case["drain_timeout_s"] == 3 and case["complete"] == 0 and case["errored"] == case["streams"] == 32
    assert len(case["errors"]) == 1
    assert ("the model is shutting down: the request was aborted after the drain timeout of 3 s; "
            "retry on another instance") in case["errors"][0]
    assert case["serve_rc"] == 0 and case["processes_left"] == [] and case["shm_left"] == []
    log = (RUN / "serve-aborted.log").read_text()
    assert "[llmhost] drain time over: aborting 32 request(s)" in log
