"""The engine-lifecycle run recorded on the real H100 (lab/gpu_lifecycle_check.py,
vLLM 0.20.2, `llmhost serve --device gpu`, 2026-11-23): what it showed is checked
here, so the record and the claims made from it (docs/gpu.md, docs/reliability.md)
cannot drift apart."""

from __future__ import annotations

import json
import re

from tests.harness.paths import FIXTURES

RUN = FIXTURES / "gpu" / "h100-580.159.04-real" / "device-run-2026-11-23-lifecycle"
LEAKS = ("Traceback", 'File "', "/site-packages/")


def _result() -> dict:
    return json.loads((RUN / "result.json").read_text())


def test_recorded_on_the_h100_with_vllm_0_20_2():
    res = _result()
    assert res["gpu"].startswith("NVIDIA H100")
    assert res["vllm"] == "0.20.2"
    assert res["smoke_rc"] == 0
    assert json.loads((RUN / "smoke.json").read_text())["ok"] is True


def test_an_engine_that_cannot_import_fails_the_load_naming_it():
    case = _result()["import_error"]
    assert case["serve_rc"] == 1  # serve exited: a server that never became ready is not restarted
    assert len(case["load_error"]) == 1
    assert re.search(r"vLLM's engine did not start: (ModuleNotFoundError|ImportError): import of "
                     r"vllm\.v1\.engine\.async_llm", case["load_error"][0])
    log = (RUN / "serve-import-error.log").read_text()
    assert "not restarting it" in log


def test_bounds_answer_400_naming_the_input_without_internals():
    bounds = _result()["bounds"]
    for name, word in (("seed", "'seed'"), ("deep_json", "'sampling_parameters'"), ("invalid_regex", "regex")):
        case = bounds[name]
        assert case["status"] == 400, (name, case)
        assert word in case["body"], (name, case)
        assert not any(s in case["body"] for s in LEAKS), (name, case)
    assert bounds["engine_error_delta"] == 0  # the invalid regex is the client's error


def test_admin_apis_need_the_key():
    admin = _result()["admin"]
    assert admin == {"logging_without_key": 403, "logging_with_key": 200, "index_without_key": 403,
                     "health_ready": 200}


def test_a_killed_engine_core_fails_the_stream_then_serve_restarts_cleanly():
    kill = _result()["engine_kill"]
    assert kill["stream_error"].startswith("the model's engine stopped (EngineCore was killed by SIGKILL)")
    assert kill["not_ready_after_s"] is not None
    assert kill["ready_again_after_s"] is not None
    assert kill["old_processes_left"] == [] and kill["old_shm_left"] == []
    assert kill["smoke_after_restart_rc"] == 0
    assert json.loads((RUN / "smoke-after-restart.json").read_text())["ok"] is True
    log = (RUN / "serve.log").read_text()
    assert "vLLM's engine died: EngineCore was killed by SIGKILL" in log
    assert "restarting it in" in log


def test_the_stop_leaves_nothing_behind():
    stop = _result()["stop"]
    assert stop == {"serve_rc": 0, "processes_left": [], "shm_left": []}
