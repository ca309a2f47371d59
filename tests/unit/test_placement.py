"""llmhost.server.placement: per-model GPU placement, refused before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llmhost.server.layout import make_model_dir
from llmhost.server.placement import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    KIND_CPU,
    KIND_GPU,
    KIND_MODEL,
    PlacementError,
    main_placement,
    plan,
    shares_by_gpu,
)
from tests.harness.paths import ROOT


def refused(models: list[dict[str, Any]], gpu_count: int, profile: str = "gpu") -> list[str]:
    with pytest.raises(PlacementError) as exc:
        plan(models, gpu_count, profile)
    return exc.value.problems


def test_single_gpu_default():
    (p,) = plan([{"name": "qwen"}], gpu_count=1)
    # The one KIND rule (the roles' and llmhost serve's): KIND_MODEL on a GPU host.
    assert (p.kind, p.gpus, p.instance_count, p.tensor_parallel_size) == (KIND_MODEL, (0,), 1, 1)
    assert p.engine_args == {"tensor_parallel_size": 1, "gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION}
    # Not pinned by the inventory: the engine sees the server's GPUs, nothing is written.
    assert p.cuda_visible_devices is None and "gpus" not in p.template_vars()


def test_unknown_gpu_count_leaves_out_only_the_host_checks():
    (p,) = plan([{"name": "big", "engine_args": {"tensor_parallel_size": 8}}], gpu_count=None)
    assert (p.kind, p.gpus) == (KIND_MODEL, tuple(range(8)))
    # Checks across fields still hold without the host.
    assert refused([{"name": "m", "kind": "KIND_GPU", "tensor_parallel_size": 2}], None) == [
        "model m: tensor_parallel_size 2 needs kind KIND_MODEL (one vLLM engine spans 2 GPUs; Triton must not "
        "pin the instance to one GPU), got KIND_GPU"]
    assert refused([{"name": "a"}, {"name": "b"}], None)[0].startswith("GPU 0: gpu_memory_utilization adds up")
    (g,) = plan([{"name": "g", "kind": "KIND_GPU"}], gpu_count=None)
    assert g.gpus == () and g.memory_shares() == {}


def test_profile_engine_args_count_under_the_models_own():
    (p,) = plan([{"name": "m"}], gpu_count=2, engine_args={"tensor_parallel_size": 2})
    assert (p.kind, p.gpus, p.tensor_parallel_size) == (KIND_MODEL, (0, 1), 2)
    (q,) = plan([{"name": "m", "engine_args": {"tensor_parallel_size": 1}}], 2, engine_args={"tensor_parallel_size": 2})
    assert q.tensor_parallel_size == 1
    assert refused([{"name": "m", "engine_args": [1]}], 1) == ["model m: engine_args must be a dict, got [1]"]


def test_kind_gpu_without_gpus_counts_an_instance_on_every_gpu():
    (p,) = plan([{"name": "a", "kind": "KIND_GPU", "gpu_memory_utilization": 0.5}], gpu_count=3)
    assert p.memory_shares() == {0: 0.5, 1: 0.5, 2: 0.5} and "gpus" not in p.template_vars()


def test_tensor_parallel_becomes_kind_model_on_its_gpus():
    (p,) = plan([{"name": "big", "gpus": [2, 3], "engine_args": {"tensor_parallel_size": 2,
                                                                 "gpu_memory_utilization": 0.85,
                                                                 "max_model_len": 8192}}], gpu_count=4)
    assert (p.kind, p.gpus, p.cuda_visible_devices) == (KIND_MODEL, (2, 3), "2,3")
    assert p.engine_args == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.85, "max_model_len": 8192}
    assert p.memory_shares() == {2: 0.85, 3: 0.85}
    (q,) = plan([{"name": "big", "tensor_parallel_size": 2}], gpu_count=2)
    assert q.gpus == (0, 1) and q.kind == KIND_MODEL


def test_two_models_share_a_gpu_when_shares_fit():
    models = [{"name": "a", "gpus": [0], "gpu_memory_utilization": 0.45},
              {"name": "b", "gpus": [0], "engine_args": {"gpu_memory_utilization": 0.25}, "instance_count": 2},
              {"name": "gone", "state": "absent", "gpus": [7]}]
    placements = plan(models, gpu_count=1)
    assert [p.name for p in placements] == ["a", "b"]
    assert shares_by_gpu(placements) == {0: [("a", 0.45), ("b", 0.5)]}


def test_sum_over_one_names_gpu_and_models():
    problems = refused([{"name": "a", "gpus": [0, 1], "tensor_parallel_size": 2},   # 0.9 on 0 and 1
                        {"name": "b", "gpus": [1], "gpu_memory_utilization": 0.2, "instance_count": 2}], 2)
    assert problems == ["GPU 1: gpu_memory_utilization adds up to 1.30 > 1.0 (a: 0.9, b: 2 x 0.2); lower "
                        "gpu_memory_utilization or instance_count, or move a model to another GPU"]
    # Two models left at vLLM's default 0.9 on one GPU
    assert refused([{"name": "a"}, {"name": "b"}], 1)[0].startswith("GPU 0: gpu_memory_utilization adds up to 1.80")
    # Exactly 1.0 is allowed (floating point sums included)
    plan([{"name": f"m{i}", "gpu_memory_utilization": 0.1} for i in range(10)], 1)


def test_kind_gpu_instances_count_per_listed_gpu():
    (p,) = plan([{"name": "a", "kind": "KIND_GPU", "gpus": [0, 1], "instance_count": 2,
                  "gpu_memory_utilization": 0.4}], 2)
    assert p.kind == KIND_GPU and p.memory_shares() == {0: 0.8, 1: 0.8}
    assert refused([{"name": "a", "kind": "KIND_GPU", "gpus": [0, 1], "instance_count": 3,
                     "gpu_memory_utilization": 0.4}], 2) == [
        f"GPU {g}: gpu_memory_utilization adds up to 1.20 > 1.0 (a: 3 x 0.4); lower gpu_memory_utilization "
        "or instance_count, or move a model to another GPU" for g in (0, 1)]


def test_more_gpus_than_the_host_has():
    assert refused([{"name": "big", "tensor_parallel_size": 8}], 4) == [
        "model big: tensor_parallel_size 8 needs 8 GPUs, the host has 4"]
    assert refused([{"name": "m", "kind": "KIND_GPU", "gpus": [0, 2]}], 2) == [
        "model m: gpus [0, 2] names GPU 2, but the host has 2 GPUs (ids 0-1)"]
    assert refused([{"name": "m"}], 0) == ["model m: llmhost_profile is gpu but the host has no GPU"]


def test_tensor_parallel_needs_kind_model_and_matching_gpus():
    assert refused([{"name": "m", "kind": "KIND_GPU", "tensor_parallel_size": 2}], 2) == [
        "model m: tensor_parallel_size 2 needs kind KIND_MODEL (one vLLM engine spans 2 GPUs; Triton must not "
        "pin the instance to one GPU), got KIND_GPU"]
    assert refused([{"name": "m", "gpus": [0, 1, 2], "tensor_parallel_size": 2}], 4) == [
        "model m: tensor_parallel_size 2 needs exactly 2 GPUs in gpus, got [0, 1, 2]"]
    assert "kind KIND_CPU on a GPU host" in refused([{"name": "m", "kind": "KIND_CPU"}], 1)[0]


@pytest.mark.parametrize("model,message", [
    ({"instance_count": 0}, "instance_count must be an integer >= 1, got 0"),
    ({"instance_count": True}, "instance_count must be an integer >= 1, got True"),
    ({"tensor_parallel_size": "2"}, "tensor_parallel_size must be an integer >= 1, got '2'"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be a number in (0, 1], got 1.5"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be a number in (0, 1], got 0"),
    ({"gpus": [0, 0]}, "gpus must be a list of distinct GPU ids >= 0, got [0, 0]"),
    ({"gpus": "0"}, "gpus must be a list of distinct GPU ids >= 0, got '0'"),
    ({"kind": "KIND_TPU"}, "kind must be one of KIND_CPU, KIND_GPU, KIND_MODEL, got 'KIND_TPU'"),
    ({"tensor_parallel_size": 2, "engine_args": {"tensor_parallel_size": 4}},
     "tensor_parallel_size is 2 but engine_args.tensor_parallel_size is 4; set one"),
])
def test_bad_values_are_named(model: dict[str, Any], message: str):
    assert f"model m: {message}" in refused([{"name": "m", **model}], 4)


def test_all_problems_reported_at_once():
    problems = refused([{"name": "a", "gpus": [5]}, {"name": "b", "tensor_parallel_size": 3}], 2)
    assert len(problems) == 2 and problems[0].startswith("model a:") and problems[1].startswith("model b:")


def test_cpu_profile():
    (p,) = plan([{"name": "tiny", "engine_args": {"max_model_len": 512}}], gpu_count=0, profile="cpu")
    assert (p.kind, p.gpus, p.engine_args) == (KIND_CPU, (), {"max_model_len": 512})
    assert p.memory_shares() == {}
    assert refused([{"name": "tiny", "gpus": [0]}], 0, "cpu") == [
        "model tiny: gpus [0] given, but llmhost_profile is cpu"]
    assert refused([{"name": "tiny", "kind": "KIND_GPU"}], 0, "cpu") == [
        "model tiny: kind KIND_GPU needs llmhost_profile gpu (this host's profile is cpu)"]
    with pytest.raises(ValueError, match="profile must be gpu or cpu"):
        plan([], 0, "tpu")


def test_renders_into_the_model_templates(tmp_path: Path):
    """What plan() returns is what config.pbtxt.j2 and model.json.j2 read."""
    single, tp = plan([{"name": "one", "kind": "KIND_GPU", "gpus": [1], "instance_count": 2,
                        "gpu_memory_utilization": 0.4},
                       {"name": "two", "gpus": [2, 3], "tensor_parallel_size": 2}], gpu_count=4)
    d = make_model_dir(tmp_path, {"name": "one", "path": "/srv/m", **single.template_vars()})
    cfg = (d / "config.pbtxt").read_text()
    assert "count: 2" in cfg and "kind: KIND_GPU" in cfg and "gpus: [ 1 ]" in cfg
    assert json.loads((d / "model.json").read_text())["gpu_memory_utilization"] == 0.4
    d = make_model_dir(tmp_path, {"name": "two", "path": "/srv/m", **tp.template_vars()})
    cfg = (d / "config.pbtxt").read_text()
    assert "kind: KIND_MODEL" in cfg and "gpus:" not in cfg
    spec = json.loads((d / "model.json").read_text())
    assert spec["tensor_parallel_size"] == 2 and spec["llmhost"]["visible_gpus"] == "2,3"


def test_command(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    models = [{"name": "a", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.5},
              {"name": "b", "gpus": [1], "gpu_memory_utilization": 0.3}]
    f = tmp_path / "models.json"
    f.write_text(json.dumps(models))
    assert main_placement([str(f), "--gpu-count", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpus"] == {"0": 0.5, "1": 0.8}
    assert report["models"]["a"]["gpus"] == [0, 1] and report["models"]["a"]["cuda_visible_devices"] is None
    assert report["models"]["b"]["gpus"] == [1] and report["models"]["b"]["cuda_visible_devices"] == "1"
    assert main_placement(["--models-json", json.dumps(models), "--gpu-count", "1"]) == 1
    assert "needs 2 GPUs, the host has 1" in json.loads(capsys.readouterr().out)["problems"][0]
    assert main_placement(["--models-json", "{}", "--gpu-count", "1"]) == 2


def test_runs_as_a_plain_script_without_site_packages():
    proc = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "src" / "llmhost" / "server" / "placement.py"),
                           "--models-json", '[{"name": "a"}]', "--gpu-count", "1"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["models"]["a"]["kind"] == "KIND_MODEL"
