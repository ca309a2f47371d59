"""Tensor parallel: what guards tensor_parallel_size > 1, and the TP mode of lab/gpu_check.py.

The two-GPU run that served TP=2 (2 x H200, 2026-11-27) is checked from its record in
tests/records/test_h200x2_tensor_parallel_and_placement.py; these tests pin the decisions it relied on.

* `llmhost placement` (tests/unit/test_placement.py has its cases) and the roles agree:
  a TP=2 model is KIND_MODEL (the roles' default kind on profile gpu), on 2 GPUs.
* The backend refuses tensor_parallel_size x pipeline_parallel_size > 1 under KIND_GPU
  when Triton loads the model (Triton would pin the one engine to one GPU), and leaves
  the GPUs to vLLM under KIND_MODEL.
* The roles' own preflights do not look at tensor_parallel_size: a TP=2 model in the
  example inventory renders as KIND_MODEL with the engine argument, nothing refuses it.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from lab.gpucheck import check as gpu_check
from llmhost.server.layout import make_model_dir
from llmhost.server.placement import KIND_MODEL, PlacementError, plan
from tests.harness.paths import ROOT

RUN = ROOT / "tests" / "fixtures" / "gpu" / "h100-580.159.04-real" / "device-run-2026-11-24-check"


# --- the roles and `llmhost placement` ---------------------------------------------------


def test_the_roles_render_a_tp2_model_as_kind_model_without_pinned_gpus(tmp_path):
    entry = gpu_check.roles_model_entry(Path("/srv/m"), tensor_parallel_size=2)
    assert entry["kind"] == KIND_MODEL and entry["engine_args"]["tensor_parallel_size"] == 2
    d = make_model_dir(tmp_path, entry)
    config = (d / "config.pbtxt").read_text()
    assert "kind: KIND_MODEL" in config and "gpus:" not in config  # vLLM places the engine itself
    engine = json.loads((d / "model.json").read_text())
    assert engine["tensor_parallel_size"] == 2 and engine["model"] == str(Path("/srv/m").resolve())


def test_the_tp2_entry_keeps_the_keys_the_roles_render_with():
    text = (ROOT / "roles" / "model_repository" / "vars" / "main.yml").read_text()
    # The roles' kind is the placement rule's (filter llmhost_placement): KIND_MODEL for TP 2.
    assert "llmhost_placement" in yaml.safe_load(text)["_model_repository_placement"]
    assert plan([gpu_check.roles_model_entry(Path("/m"), 2)], None)[0].kind == KIND_MODEL
    assert set(gpu_check.roles_model_entry(Path("/m"), 2)) == set(gpu_check.roles_model_entry(Path("/m")))
    assert "tensor_parallel_size" not in gpu_check.roles_model_entry(Path("/m"))["engine_args"]


def test_placement_puts_the_tp2_entry_on_two_gpus_and_refuses_one():
    entry = gpu_check.roles_model_entry(Path("/m"), tensor_parallel_size=2)
    (p,) = plan([entry], gpu_count=2)
    assert (p.kind, p.gpus, p.tensor_parallel_size, p.cuda_visible_devices) == (KIND_MODEL, (0, 1), 2, None)
    with pytest.raises(PlacementError) as err:
        plan([entry], gpu_count=1)
    assert err.value.problems == ["model llm: tensor_parallel_size 2 needs 2 GPUs, the host has 1"]


def test_a_model_across_hosts_holds_its_share_of_the_ranks_on_each_host():
    """Tensor parallel 2 across two hosts of one GPU each: one GPU a host. 8 x 2 across two
    hosts: 8 a host, refused on a host of 4."""
    across = {"name": "big", "nodes": ["gpu-1", "gpu-2"], "engine_args": {"tensor_parallel_size": 2}}
    (p,) = plan([across], gpu_count=1)
    assert (p.kind, p.gpus, p.tensor_parallel_size) == (KIND_MODEL, (0,), 2)
    big = {"name": "big", "nodes": ["gpu-1", "gpu-2"],
           "engine_args": {"tensor_parallel_size": 8, "pipeline_parallel_size": 2}}
    assert plan([big], gpu_count=8)[0].gpus == tuple(range(8))
    with pytest.raises(PlacementError) as err:
        plan([big], gpu_count=4)
    assert err.value.problems == ["model big: tensor_parallel_size 8 needs 8 GPUs on each of its 2 hosts, "
                                  "the host has 4"]
    # On one host the same layout needs tensor_parallel_size GPUs, as before.
    with pytest.raises(PlacementError):
        plan([{**across, "nodes": None}], gpu_count=1)


def test_the_example_inventorys_tp2_model_passes_through_the_roles_unrefused():
    """The roles' preflights (llmhost, model_repository) check names, sources, sizes and
    engine_args being a dict, not tensor_parallel_size: the example's TP=2 model is
    rendered with the roles' default kind, KIND_MODEL."""
    for role in ("llmhost", "model_repository"):
        preflight = (ROOT / "roles" / role / "tasks" / "preflight.yml").read_text()
        assert "tensor_parallel" not in preflight, role
    inventory = yaml.safe_load((ROOT / "inventory" / "example.yml").read_text())
    hosts = inventory["all"]["children"]["inference"]["hosts"]
    (model,) = hosts["gpu-node-02"]["llmhost_models"]
    assert model["engine_args"]["tensor_parallel_size"] == 2 and "kind" not in model and "gpus" not in model


# --- the backend at model load ---------------------------------------------------------------


class _TritonModelException(Exception):
    pass


@pytest.fixture
def fake_pb() -> Iterator[None]:
    mod = types.ModuleType("triton_python_backend_utils")
    mod.TritonModelException = _TritonModelException  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    yield
    del sys.modules[mod.__name__]


def _model(engine_args: dict, visible_gpus: str = "") -> object:
    from llmhost.backend.model import TritonPythonModel

    m = TritonPythonModel()
    m.config = SimpleNamespace(engine_args=engine_args,  # type: ignore[attr-defined]
                               settings=SimpleNamespace(visible_gpus=visible_gpus))
    return m


@pytest.mark.parametrize("engine_args", [{"tensor_parallel_size": 2},
                                         {"pipeline_parallel_size": 2},
                                         {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}])
def test_backend_refuses_a_multi_gpu_engine_under_kind_gpu(fake_pb, monkeypatch, engine_args):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(_TritonModelException) as err:
        _model(engine_args)._apply_placement({"model_instance_kind": "GPU", "model_instance_device_id": "1"})
    n = engine_args.get("tensor_parallel_size", 1) * engine_args.get("pipeline_parallel_size", 1)
    assert str(err.value) == (f"tensor_parallel_size x pipeline_parallel_size = {n}: use instance_group kind "
                              "KIND_MODEL for a model spanning several GPUs (KIND_GPU pins one GPU per instance)")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"  # untouched


def test_backend_pins_a_kind_gpu_instance_to_its_device(fake_pb, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    _model({"tensor_parallel_size": 1})._apply_placement({"model_instance_kind": "GPU",
                                                          "model_instance_device_id": "1"})
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_backend_gives_a_kind_model_engine_the_models_own_gpus(fake_pb, monkeypatch):
    """The roles write a KIND_MODEL model's `gpus` as visible_gpus: two TP=2 models on a
    4-GPU host get GPUs 0,1 and 2,3, not both the first two."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    _model({"tensor_parallel_size": 2}, "2,3")._apply_placement({"model_instance_kind": "MODEL",
                                                                 "model_instance_device_id": "0"})
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


@pytest.mark.parametrize("kind", ["MODEL", "CPU"])
def test_backend_leaves_the_gpus_of_a_tp2_engine_to_vllm(fake_pb, monkeypatch, kind):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    _model({"tensor_parallel_size": 2})._apply_placement({"model_instance_kind": kind,
                                                          "model_instance_device_id": "0"})
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


# --- lab/gpu_check.py's TP mode ---------------------------------------------------------


def test_tp_mode_serves_kind_model_alone():
    assert gpu_check.check_tensor_parallel(1, ["KIND_GPU", "KIND_MODEL"]) is None
    assert gpu_check.check_tensor_parallel(2, ["KIND_MODEL"]) is None
    assert "needs --kinds KIND_MODEL alone" in gpu_check.check_tensor_parallel(2, ["KIND_GPU", "KIND_MODEL"])
    assert "needs --kinds KIND_MODEL alone" in gpu_check.check_tensor_parallel(2, ["KIND_GPU"])
    assert gpu_check.check_tensor_parallel(0, ["KIND_MODEL"]) == "--tensor-parallel-size must be >= 1, got 0"


def test_tp_mode_refuses_kind_gpu_before_touching_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main([str(tmp_path / "out"), "--tensor-parallel-size", "2", "--kinds", "KIND_GPU,KIND_MODEL"])
    assert exc.value.code == 2
    assert "needs --kinds KIND_MODEL alone" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_multicast_stays_off_on_shared_multi_gpu_machines():
    assert gpu_check.NO_MULTICAST == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                      "NVSHMEM_DISABLE_NVLS": "1"}


def test_engine_tensor_parallel_size_is_read_from_vllms_config_line():
    recorded = (RUN / "serve-kind_model.log").read_text()  # vLLM 0.20.2's own line, TP=1
    assert gpu_check.engine_tensor_parallel_size(recorded) == 1
    two = recorded.replace("tensor_parallel_size=1,", "tensor_parallel_size=2,")
    assert gpu_check.engine_tensor_parallel_size(two) == 2
    assert gpu_check.engine_tensor_parallel_size("no engine here") is None


def test_engine_gpus_are_those_whose_memory_rose():
    assert gpu_check.engine_gpus([3, 3], [70_000, 69_000]) == [0, 1]
    assert gpu_check.engine_gpus([3, 3], [70_000, 500]) == [0]
    with pytest.raises(ValueError):
        gpu_check.engine_gpus([3], [70_000, 69_000])


def _tp2_case() -> dict:
    """The recorded KIND_MODEL case as a TP=2 run that did what it should."""
    case = copy.deepcopy(json.loads((RUN / "result.json").read_text())["kinds"]["KIND_MODEL"])
    case.update(tensor_parallel_size=2, engine_tensor_parallel_size=2, engine_gpus=[0, 1])
    return case


def test_a_tp1_run_has_no_tensor_parallel_verdict():
    case = json.loads((RUN / "result.json").read_text())["kinds"]["KIND_MODEL"]
    assert "tensor_parallel" not in gpu_check.passed(case)


@pytest.mark.parametrize(("change", "ok"), [
    ({}, True),
    ({"engine_gpus": [0]}, False),                      # the second GPU never took the engine
    ({"engine_tensor_parallel_size": 1}, False),        # vLLM started a TP=1 engine
    ({"engine_tensor_parallel_size": None}, False),     # no engine config line in the log
])
def test_tensor_parallel_verdict(change, ok):
    case = _tp2_case()
    case.update(change)
    verdicts = gpu_check.passed(case)
    assert verdicts["tensor_parallel"] is ok
    assert all(v for k, v in verdicts.items() if k != "tensor_parallel")
