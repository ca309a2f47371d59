"""The two-GPU run recorded on the lent machine (lab/gpu_multi_check.py, 2x H200,
vLLM 0.20.2, 2026-11-27): tensor parallel size 2 the roles' way and through `llmhost
serve`, two models placed one per GPU, stop, drain and the SIGKILL of a tensor parallel
worker, and the bench against `vllm serve --tensor-parallel-size 2`.

Each claim docs/gpu.md and docs/performance.md make from the run is checked here from the
recorded numbers and files; what the roles render for the two placements today is
compared with what the run served. No timing is asserted."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from lab.gpucheck import check as gpu_check
from llmhost.server.layout import make_model_dir
from tests.harness.paths import ROOT

RUN = ROOT / "tests" / "fixtures" / "gpu" / "h200x2-580.159.04-real" / "device-run-2026-11-27-multi"
GIB = 1024  # MiB
SMOKE_CHECKS = {"server live", "server ready", "model ready", "generate", "generate_stream (SSE)", "gRPC stream",
                "metrics"}
LEVELS = [16, 64, 256]
MODEL = Path("/tmp/lh-qwen3")  # where the run wrote the model


def _run(n: int) -> dict[str, Any]:
    return json.loads((RUN / f"result-run{n}.json").read_text())


def _smoke_ok(smoke: dict[str, Any]) -> bool:
    return smoke["rc"] == 0 and set(smoke["checks"]) == SMOKE_CHECKS and all(smoke["checks"].values())


def _vllm_version(res: dict[str, Any]) -> str | None:
    """The run's vLLM: its own key, or (run 1, where phase "vllm" took the key over) the
    version vLLM's engine config line names."""
    if isinstance(res.get("vllm_version") or res.get("vllm"), str):
        return res.get("vllm_version") or res["vllm"]
    m = re.search(r"LLM engine \(v([0-9.]+)\)", "\n".join(res["vllm"]["engine_config"]))
    return m.group(1) if m else None


def _smoke_file_ok(name: str) -> bool:
    """`llmhost smoke --json` as written by the run: ok, and every check ok."""
    smoke = json.loads((RUN / f"{name}.json").read_text())
    return smoke["ok"] is True and {c["name"] for c in smoke["checks"]} == SMOKE_CHECKS and all(
        c["ok"] for c in smoke["checks"])


def _engine_tp(lines: list[str]) -> int | None:
    return gpu_check.engine_tensor_parallel_size("\n".join(lines))


def _freed(stop: dict[str, Any]) -> bool:
    return (stop["rc"] == 0 and stop["processes_left"] == [] and stop["shm_left"] == []
            and len(stop["gpu_memory_used_mib_after"]) == 2 and all(m < GIB for m in stop["gpu_memory_used_mib_after"]))


def test_recorded_on_two_gpus_with_multicast_off():
    for n in (1, 2, 3):
        res = _run(n)
        assert len(res["gpus"]) == 2 and all("NVIDIA H200, 580.159.04" in g for g in res["gpus"]), res["gpus"]
        assert _vllm_version(res) == "0.20.2" and res["tensor_parallel_size"] == 2
        assert res["no_multicast"] == gpu_check.NO_MULTICAST
    smi = (RUN / "nvidia-smi.txt").read_text()
    assert smi.count("NVIDIA H200") == 2
    assert len((RUN / "nvidia-smi-L.txt").read_text().strip().splitlines()) == 2
    assert re.search(r"GPU0\s+X\s+NV\d+", (RUN / "nvidia-smi-topo.txt").read_text())


# --- tensor parallel size 2, the roles' way -----------------------------------------------


def test_roles_tp2_served_with_the_units_command_and_environment():
    case = _run(1)["roles_tp"]
    assert all(case["passed"].values()) and set(case["passed"]) >= {"served", "smoke", "stop", "tensor_parallel"}
    assert gpu_check.passed(case) == case["passed"]  # today's verdicts over the recorded numbers
    assert case["how"].startswith("tritonserver with the roles' model repository")
    assert case["rendered_kind"] == "KIND_MODEL"
    assert case["loaded_config"]["instance_group"] == [{"kind": "KIND_MODEL", "count": 1, "gpus": []}]
    argv = case["command"]
    assert argv[0].endswith("/tritonserver") and "--strict-readiness=true" in argv
    assert any(a.startswith("--http-restricted-api=") and a.endswith("llmhost-admin-key=<redacted>") for a in argv)
    env = case["environment"]
    assert {k: env[k] for k in gpu_check.NO_MULTICAST} == gpu_check.NO_MULTICAST
    assert env["HF_HUB_OFFLINE"] == "1" and env["LLMHOST_STOP_FILE"].endswith("/run/stopping")
    assert _smoke_ok(case["smoke"])
    assert _smoke_file_ok("smoke-kind_model")


def test_roles_tp2_engine_spans_both_gpus_and_the_stop_frees_them():
    case = _run(1)["roles_tp"]
    assert case["engine_tensor_parallel_size"] == 2 and _engine_tp(case["engine_config"]) == 2
    rise = [s - b for s, b in zip(case["gpu_memory_used_mib_serving"], case["gpu_memory_used_mib_before"],
                                  strict=True)]
    assert len(rise) == 2 and all(r > GIB for r in rise)
    assert case["engine_gpus"] == [0, 1]
    assert _freed(case["stop"]) and case["stop"]["compute_apps_after"] == []


def test_the_roles_render_today_what_the_tp2_run_served(tmp_path):
    d = make_model_dir(tmp_path, gpu_check.roles_model_entry(MODEL, tensor_parallel_size=2))
    assert (d / "config.pbtxt").read_text() == (RUN / "roles-tp-config.pbtxt").read_text()
    assert json.loads((d / "model.json").read_text()) == json.loads((RUN / "roles-tp-model.json").read_text())
    engine = json.loads((RUN / "roles-tp-model.json").read_text())
    assert engine["tensor_parallel_size"] == 2 and "visible_gpus" not in engine["llmhost"]
    assert "kind: KIND_MODEL" in (RUN / "roles-tp-config.pbtxt").read_text()
    assert "gpus:" not in (RUN / "roles-tp-config.pbtxt").read_text()


# --- two models, one per GPU ----------------------------------------------------------------


def test_the_placement_rule_places_the_two_models_as_the_run_served_them(tmp_path):
    """The inventory's two models, the roles' decision (llmhost_placement) and the files
    rendered from it today equal the ones Triton loaded in the run."""
    case = _run(1)["placement"]
    wanted = case["inventory"]
    assert wanted == [{"name": "gpu0", "kind": "KIND_GPU", "gpus": [0]}, {"name": "gpu1", "gpus": [1]}]
    entries = gpu_check.placed_entries(MODEL, wanted, gpu_count=2)
    assert [{k: e.get(k) for k in ("name", "kind", "gpus")} for e in entries] == case["entries"]
    assert case["entries"] == [{"name": "gpu0", "kind": "KIND_GPU", "gpus": [0]},
                               {"name": "gpu1", "kind": "KIND_MODEL", "gpus": [1]}]
    for entry in entries:
        d = make_model_dir(tmp_path, entry)
        name = entry["name"]
        assert (d / "config.pbtxt").read_text() == (RUN / f"placement-{name}-config.pbtxt").read_text()
        assert (json.loads((d / "model.json").read_text())
                == json.loads((RUN / f"placement-{name}-model.json").read_text()))
    assert "gpus: [ 0 ]" in (RUN / "placement-gpu0-config.pbtxt").read_text()
    gpu1 = (RUN / "placement-gpu1-config.pbtxt").read_text()
    assert "kind: KIND_MODEL" in gpu1 and "gpus:" not in gpu1
    assert json.loads((RUN / "placement-gpu1-model.json").read_text())["llmhost"]["visible_gpus"] == "1"


def test_triton_loaded_each_model_on_its_own_gpu():
    case = _run(1)["placement"]
    assert case["ready_s"] is not None and "exception" not in case
    models = case["models"]
    assert models["gpu0"]["loaded_config"]["instance_group"] == [{"kind": "KIND_GPU", "count": 1, "gpus": [0]}]
    assert models["gpu1"]["loaded_config"]["instance_group"] == [{"kind": "KIND_MODEL", "count": 1, "gpus": []}]
    for name in ("gpu0", "gpu1"):
        assert _smoke_ok(models[name]["smoke"])
        assert _smoke_file_ok(f"smoke-{name}")
    engines = [a for a in case["compute_apps"] if a["command"].startswith("VLLM::EngineCore")]
    assert sorted(a["gpu"] for a in engines) == [0, 1]  # one engine per GPU
    assert len({a["pid"] for a in engines}) == 2 and all(a["used_mib"] > GIB for a in engines)
    assert all(m > GIB for m in case["gpu_memory_used_mib_serving"])
    assert (RUN / "nvidia-smi-placement.txt").read_text().count("VLLM::EngineCore") == 2
    assert sum(_engine_tp([line]) == 1 for line in case["engine_config"]) == 2
    assert _freed(case["stop"]) and case["stop"]["compute_apps_after"] == []


# --- llmhost serve with TP=2: smoke, worker kill, drain and stop ------------------------------


def test_llmhost_serve_tp2_served_on_both_gpus():
    case = _run(2)["serve_tp"]
    assert "exception" not in case
    assert "--kind" in case["command"] and case["command"][case["command"].index("--kind") + 1] == "KIND_MODEL"
    assert "tensor_parallel_size=2" in case["command"]
    assert case["loaded_config"]["instance_group"] == [{"kind": "KIND_MODEL", "count": 1, "gpus": []}]
    assert _smoke_ok(case["smoke"]) and _smoke_file_ok("smoke-serve_tp")
    assert _engine_tp(case["engine_config"]) == 2
    assert all(s - b > GIB for s, b in zip(case["gpu_memory_used_mib_serving"], case["gpu_memory_used_mib_before"],
                                            strict=True))
    workers = {a["command"].strip(): a["gpu"] for a in case["compute_apps"] if "Worker_TP" in a["command"]}
    assert workers == {"VLLM::Worker_TP0": 0, "VLLM::Worker_TP1": 1}


def test_a_killed_tp_worker_is_noticed_and_serve_restarts_the_model():
    kill = _run(2)["serve_tp"]["worker_kill"]
    by_pid = {p["pid"]: p for p in kill["processes"]}
    assert by_pid[kill["worker_pid"]]["name"] == "VLLM::Worker_TP1"
    assert kill["not_ready_after_s"] is not None and kill["ready_again_after_s"] is not None
    assert kill["serve_alive"] is True and kill["old_processes_left"] == []
    log = "\n".join(kill["serve_log"])
    assert "EngineDeadError" in log and "stopping tritonserver so that its supervisor restarts it" in log
    assert "restarting it in" in log and "llmhost serve: ready." in log
    assert _smoke_ok(kill["smoke_after_restart"])
    assert _smoke_file_ok("smoke-serve-tp-after-kill")
    assert all(m > GIB for m in kill["gpu_memory_used_mib_after_restart"])


@pytest.mark.parametrize("run", [1, 2])
def test_drain_at_sigterm_finishes_the_streams_and_frees_both_gpus(run):
    """Run 1's serve_tp phase stopped before its smoke (commands.txt); its drain and stop still ran."""
    stop = _run(run)["serve_tp"]["drain_stop"]
    assert stop["tokens"] == [stop["max_tokens"]] * stop["streams"] and stop["errors"] == []
    assert _freed(stop) and stop["compute_apps_after"] == []


# --- the bench against vllm serve --tensor-parallel-size 2 ---------------------------------------


def _bench_runs() -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {"llmhost": [], "vllm": []}
    for n in (1, 2, 3):
        for side, levels in _run(n)["bench"]["runs"].items():
            runs[side] += levels
    return runs


def test_vllm_serve_tp2_served_on_both_gpus_and_stopped_clean():
    for n in (1, 3):
        case = _run(n)["vllm"]
        assert "exception" not in case and "--tensor-parallel-size" in case["command"]
        assert case["command"][case["command"].index("--tensor-parallel-size") + 1] == "2"
        assert _engine_tp(case["engine_config"]) == 2
        assert sorted(a["gpu"] for a in case["compute_apps"]) == [0, 1]
        assert _freed(case["stop"])


def test_bench_levels_and_rounds_and_no_failed_request():
    runs = _bench_runs()
    workload = _run(2)["bench"]["workload"]
    assert workload["concurrency"] == LEVELS and workload["ignore_eos"] is True
    assert workload["client"].startswith("vllm bench serve (in process")
    for side, rounds in (("llmhost", [0, 1]), ("vllm", [0, 1, 2])):
        assert sorted((r["round"], r["concurrency"]) for r in runs[side]) == [(n, c) for n in rounds for c in LEVELS]
        for level in runs[side]:
            assert level["failed"] == 0 and level["completed"] == int(workload["requests"][str(level["concurrency"])])
            assert level["output_tokens_per_s"] > 0 and level["tokens_per_event"] >= 1.0
