"""The four-GPU run recorded on the lent machine (lab/gpu_multi_check.py --tp 4, 4x H200,
vLLM 0.20.2, 2026-11-27): tensor parallel size 4 the roles' way and through `llmhost
serve`, stop, drain and the SIGKILL of a tensor parallel worker, and the bench against
`vllm serve --tensor-parallel-size 4`.

What docs/gpu.md and docs/performance.md say of the run is checked here from the
recorded numbers and files; what the roles render for TP=4 today is compared with what
the run served. No timing is asserted."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from lab.gpucheck import check as gpu_check
from llmhost.server.layout import make_model_dir
from tests.harness.paths import ROOT

RUN = ROOT / "tests" / "fixtures" / "gpu" / "h200x4-580.159.04-real" / "device-run-2026-11-27-tp4"
GIB = 1024  # MiB
GPUS = [0, 1, 2, 3]
SMOKE_CHECKS = {"server live", "server ready", "model ready", "generate", "generate_stream (SSE)", "gRPC stream",
                "metrics"}
LEVELS = [16, 64, 256]
MODEL = Path("/tmp/lh-qwen3")  # where the run wrote the model


def _res() -> dict[str, Any]:
    return json.loads((RUN / "result.json").read_text())


def _smoke_ok(smoke: dict[str, Any]) -> bool:
    return smoke["rc"] == 0 and set(smoke["checks"]) == SMOKE_CHECKS and all(smoke["checks"].values())


def _smoke_file_ok(name: str) -> bool:
    smoke = json.loads((RUN / f"{name}.json").read_text())
    return smoke["ok"] is True and {c["name"] for c in smoke["checks"]} == SMOKE_CHECKS and all(
        c["ok"] for c in smoke["checks"])


def _freed(stop: dict[str, Any]) -> bool:
    return (stop["rc"] == 0 and stop["processes_left"] == [] and stop["shm_left"] == []
            and len(stop["gpu_memory_used_mib_after"]) == 4 and all(m < GIB for m in stop["gpu_memory_used_mib_after"]))


def _engine_tp(lines: list[str]) -> int | None:
    return gpu_check.engine_tensor_parallel_size("\n".join(lines))


def test_recorded_on_four_gpus_with_multicast_off():
    res = _res()
    assert len(res["gpus"]) == 4 and all("NVIDIA H200, 580.159.04" in g for g in res["gpus"]), res["gpus"]
    assert res["vllm_version"] == "0.20.2" and res["tensor_parallel_size"] == 4
    assert res["no_multicast"] == gpu_check.NO_MULTICAST
    assert res["phases"] == ["roles_tp", "serve_tp", "vllm", "serve_tp_again"]
    assert len((RUN / "nvidia-smi-L.txt").read_text().strip().splitlines()) == 4
    assert re.search(r"GPU0\s+X(\s+NV\d+){3}", (RUN / "nvidia-smi-topo.txt").read_text())
    assert "admin-key=<redacted>" in (RUN / "result.json").read_text()


def test_roles_tp4_served_on_all_four_gpus_with_the_units_command():
    case = _res()["roles_tp"]
    assert all(case["passed"].values()) and set(case["passed"]) >= {"served", "smoke", "stop", "tensor_parallel"}
    assert gpu_check.passed(case) == case["passed"]
    assert case["rendered_kind"] == "KIND_MODEL"
    assert case["loaded_config"]["instance_group"] == [{"kind": "KIND_MODEL", "count": 1, "gpus": []}]
    assert {k: case["environment"][k] for k in gpu_check.NO_MULTICAST} == gpu_check.NO_MULTICAST
    assert case["engine_tensor_parallel_size"] == 4 and _engine_tp(case["engine_config"]) == 4
    assert case["engine_gpus"] == GPUS
    rise = [s - b for s, b in zip(case["gpu_memory_used_mib_serving"], case["gpu_memory_used_mib_before"],
                                  strict=True)]
    assert len(rise) == 4 and all(r > GIB for r in rise)
    assert _smoke_ok(case["smoke"]) and _smoke_file_ok("smoke-kind_model")
    assert _freed(case["stop"]) and case["stop"]["compute_apps_after"] == []


def test_the_roles_render_today_what_the_tp4_run_served(tmp_path):
    d = make_model_dir(tmp_path, gpu_check.roles_model_entry(MODEL, tensor_parallel_size=4))
    assert (d / "config.pbtxt").read_text() == (RUN / "roles-tp-config.pbtxt").read_text()
    assert json.loads((d / "model.json").read_text()) == json.loads((RUN / "roles-tp-model.json").read_text())
    assert json.loads((RUN / "roles-tp-model.json").read_text())["tensor_parallel_size"] == 4


def test_llmhost_serve_tp4_a_killed_worker_and_the_drains():
    res = _res()
    for phase in ("serve_tp", "serve_tp_again"):
        case = res[phase]
        assert "tensor_parallel_size=4" in case["command"] and _engine_tp(case["engine_config"]) == 4
        assert _smoke_ok(case["smoke"])
        workers = {a["command"].strip(): a["gpu"] for a in case["compute_apps"] if "Worker_TP" in a["command"]}
        assert workers == {f"VLLM::Worker_TP{i}": i for i in GPUS}
        stop = case["drain_stop"]
        assert stop["tokens"] == [stop["max_tokens"]] * stop["streams"] and stop["errors"] == []
        assert _freed(stop) and stop["compute_apps_after"] == []
    kill = res["serve_tp"]["worker_kill"]
    assert {p["pid"]: p for p in kill["processes"]}[kill["worker_pid"]]["name"] == "VLLM::Worker_TP1"
    assert kill["not_ready_after_s"] is not None and kill["ready_again_after_s"] is not None
    assert kill["serve_alive"] is True and kill["old_processes_left"] == []
    assert _smoke_ok(kill["smoke_after_restart"]) and _smoke_file_ok("smoke-serve-tp-after-kill")


def test_vllm_serve_tp4_served_on_all_four_gpus_and_stopped_clean():
    case = _res()["vllm"]
    assert case["command"][case["command"].index("--tensor-parallel-size") + 1] == "4"
    assert _engine_tp(case["engine_config"]) == 4
    assert sorted(a["gpu"] for a in case["compute_apps"]) == GPUS
    assert _freed(case["stop"])


def medians(res: dict[str, Any]) -> dict[int, dict[str, tuple[float, float, float, float]]]:
    """Per level and side: medians over rounds of tok/s, TTFT p50, ITL p50, and the worst
    tokens per event (what docs/performance.md's TP=4 table shows)."""
    out: dict[int, dict[str, tuple[float, float, float, float]]] = {}
    for side, levels in res["bench"]["runs"].items():
        for c in LEVELS:
            rows = [r for r in levels if r["concurrency"] == c]
            out.setdefault(c, {})[side] = (
                statistics.median(r["output_tokens_per_s"] for r in rows),
                statistics.median(r["ttft_ms"]["median"] for r in rows),
                statistics.median(r["itl_ms"]["median"] for r in rows), max(r["tokens_per_event"] for r in rows))
    return out


def test_bench_rounds_no_failed_request_and_the_documented_table():
    res = _res()
    for side in ("llmhost", "vllm"):
        runs = res["bench"]["runs"][side]
        assert sorted((r["round"], r["concurrency"]) for r in runs) == [(n, c) for n in (0, 1) for c in LEVELS]
        assert all(r["failed"] == 0 and r["completed"] == 4 * r["concurrency"] for r in runs)
    doc = (ROOT / "docs" / "performance.md").read_text()
    for c, sides in medians(res).items():
        a, b = sides["llmhost"], sides["vllm"]
        row = (f"| {c} | {a[0]:,.0f} / {b[0]:,.0f} | {a[1]:.0f} / {b[1]:.0f} | {a[2]:.2f} / {b[2]:.2f} | "
               f"{a[3]:.2f} / {b[3]:.2f} | 0 / 0 |")
        assert row in doc, row
