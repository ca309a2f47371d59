"""The GPU check recorded on the real H100 (lab/gpu_check.py, vLLM 0.20.2, 2026-11-24):
the Qwen3-0.6B-shaped random model served under KIND_GPU (`llmhost serve --device gpu`)
and KIND_MODEL (the roles' model repository under tritonserver started the unit's way).
What the run showed is checked here from its numbers, not from the script's own verdicts
alone, so the record and the claims made from it cannot drift apart. The script's ties
to the roles (context, flags, environment) are checked in tests/unit/test_gpu_check.py."""

from __future__ import annotations

import json
import re

import pytest

from lab.gpucheck import check as gpu_check
from tests.harness.paths import ROOT

RUN = ROOT / "tests" / "fixtures" / "gpu" / "h100-580.159.04-real" / "device-run-2026-11-24-check"
KINDS = ("KIND_GPU", "KIND_MODEL")
LEAKS = ("Traceback", 'File "', "/site-packages/")
CHECKS = {"served", "smoke", "bad_input", "structured", "cancellation", "gpu_metrics", "stop"}
SMOKE_CHECKS = {"server live", "server ready", "model ready", "generate", "generate_stream (SSE)", "gRPC stream",
                "metrics"}


def _result() -> dict:
    return json.loads((RUN / "result.json").read_text())


def _kind(kind: str) -> dict:
    return _result()["kinds"][kind]


def test_recorded_on_the_h100_with_vllm_0_20_2_and_the_qwen3_shaped_model():
    res = _result()
    assert res["gpu"] == "NVIDIA H100 80GB HBM3, 580.159.04" and res["vllm"] == "0.20.2"
    assert "NVIDIA H100 80GB HBM3" in (RUN / "nvidia-smi.txt").read_text()
    model = res["model"]
    assert model["kind"] == "qwen3" and model["architectures"] == ["Qwen3ForCausalLM"]
    assert (model["hidden_size"], model["num_hidden_layers"], model["vocab_size"]) == (1024, 28, 4096)
    assert 800e6 < model["bytes"] < 1e9  # 445M bf16 parameters
    assert sorted(res["kinds"]) == sorted(KINDS)
    assert res["all_passed"] is True


@pytest.mark.parametrize("kind", KINDS)
def test_every_check_passed(kind):
    case = _kind(kind)
    assert set(case["passed"]) == CHECKS
    assert all(case["passed"].values()), case["passed"]
    assert "exception" not in case
    assert gpu_check.passed(case) == case["passed"]  # today's verdicts over the recorded numbers


@pytest.mark.parametrize("kind", KINDS)
def test_served_under_its_instance_kind(kind):
    case = _kind(kind)
    assert case["ready_s"] is not None and case["rendered_kind"] == kind
    assert case["loaded_config"]["status"] == 200
    assert [g["kind"] for g in case["loaded_config"]["instance_group"]] == [kind]
    log = (RUN / f"serve-{kind.lower()}.log").read_text()
    device = "GPU" if kind == "KIND_GPU" else "MODEL"
    assert f"TRITONBACKEND_ModelInstanceInitialize: llm_0_0 ({device} device 0)" in log
    assert "[llmhost] model llm ready (max_model_len 4096" in log
    if kind == "KIND_GPU":
        assert case["how"] == "llmhost serve --device gpu"
        assert case["loaded_config"]["instance_group"][0]["gpus"] == [0]
        assert "llmhost serve: ready." in log
    else:
        assert case["how"].startswith("tritonserver with the roles' model repository")
        assert "llmhost serve" not in log


@pytest.mark.parametrize("kind", KINDS)
def test_smoke_passed(kind):
    case = _kind(kind)
    assert case["smoke"]["rc"] == 0
    assert case["smoke"]["checks"] == dict.fromkeys(SMOKE_CHECKS, True)
    smoke = json.loads((RUN / f"smoke-{kind.lower()}.json").read_text())
    assert smoke["ok"] is True and {c["name"] for c in smoke["checks"] if c["ok"]} == SMOKE_CHECKS


@pytest.mark.parametrize("kind", KINDS)
def test_bad_input_is_a_400_naming_the_input_counted_as_invalid_request(kind):
    bad = _kind(kind)["bad_input"]
    for name, word in (("seed", "'seed'"), ("deep_json", "'sampling_parameters'"), ("invalid_regex", "regex")):
        case = bad[name]
        assert case["status"] == 400, (name, case)
        assert word in case["body"], (name, case)
        assert not any(s in case["body"] for s in LEAKS), (name, case)
    assert "100000 levels deep; at most 100" in bad["deep_json"]["body"]
    assert bad["engine_error_delta"] == 0  # not the server's fault: no page
    assert bad["invalid_request_delta"] == 3


@pytest.mark.parametrize("kind", KINDS)
def test_structured_output_parses_and_matches(kind):
    st = _kind(kind)["structured"]
    attempts = st["json_schema"]["attempts"]
    last = attempts[-1]
    assert last["status"] == 200 and last["finish_reason"] == "stop"
    value = json.loads(last["text"])  # whitespace aside, exactly the schema's object
    assert set(value) == {"ok", "size"} and isinstance(value["ok"], bool) and value["size"] in ("S", "M")
    for a in attempts:  # an answer that stopped before its limit must be valid JSON
        if a["finish_reason"] == "stop":
            assert gpu_check.schema_ok(a["text"]), a
    assert re.fullmatch(st["regex"]["pattern"], st["regex"]["text"]) and st["regex"]["finish_reason"] == "stop"
    assert st["choice"]["text"] in gpu_check.CHOICES


@pytest.mark.parametrize("kind", KINDS)
def test_closed_streams_are_cancelled_in_the_engine(kind):
    c = _kind(kind)["cancellation"]
    assert c["streams"] == 4 and c["running_seen"] == 4  # all four ran at once before the close
    assert all(0 < t < c["max_tokens"] for t in c["tokens_when_closed"]), c  # closed mid-way
    assert c["errors"] == []
    assert c["running_zero_after_close_s"] is not None and c["running_after"] == 0
    assert c["cancelled_delta"] == 4 and c["cancelled_counted"] is True


@pytest.mark.parametrize("kind", KINDS)
def test_triton_exports_the_gpu_metrics_for_the_gpus_uuid(kind):
    uuids = _result()["uuids"]
    assert len(uuids) == 1 and re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", uuids[0])
    gm = _kind(kind)["gpu_metrics"]
    series = gm["series"]
    assert gm["every_gpu"] is True
    for name in ("nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"):
        assert set(series[name]) == set(uuids), name
    total = series["nv_gpu_memory_total_bytes"][uuids[0]]
    assert 80e9 < total < 90e9  # an 80 GB H100
    # vLLM takes about 0.9 of the GPU for weights and KV cache: Triton reports it.
    assert 0.5 * total < series["nv_gpu_memory_used_bytes"][uuids[0]] <= total
    assert 0 <= series["nv_gpu_utilization"][uuids[0]] <= 1
    serving_mib = _kind(kind)["gpu_memory_used_mib_serving"][0]
    assert abs(serving_mib * 2**20 - series["nv_gpu_memory_used_bytes"][uuids[0]]) < 4 * 2**30  # nvidia-smi agrees


@pytest.mark.parametrize("kind", KINDS)
def test_sigterm_leaves_no_process_no_shm_segment_and_frees_the_gpu(kind):
    case = _kind(kind)
    stop = case["stop"]
    assert stop["rc"] == 0 and stop["processes_left"] == [] and stop["shm_left"] == []
    # serve > tritonserver > python stub > EngineCore; the unit's tritonserver is the one stopped.
    assert stop["processes"] == (3 if kind == "KIND_GPU" else 2)
    assert stop["gpu_memory_used_mib_after"] == case["gpu_memory_used_mib_before"]
    assert stop["compute_apps_after"] == []
    assert case["gpu_memory_used_mib_serving"][0] > 40_000
    log = (RUN / f"serve-{kind.lower()}.log").read_text()
    # The stop file (serve's, or the unit's ExecStop as the script does it) reached the backend.
    assert "[llmhost] draining (tritonserver is stopping): 0 request(s) in flight" in log
