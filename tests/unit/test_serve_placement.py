"""`llmhost serve` places its model by llmhost.server.placement, the rule the roles use
(tests/ansible/test_preflight.py shows the roles' side): KIND_CPU on cpu, KIND_MODEL on
gpu unless --kind says otherwise; --gpus pins; an impossible placement is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmhost import cli
from llmhost.server import serve
from llmhost.server.layout import make_model_dir
from llmhost.server.placement import PlacementError
from llmhost.server.serve import ServeOptions, model_entry


def test_cpu_serves_kind_cpu_and_gpu_serves_the_roles_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "gpu_count", lambda: 2)
    cpu = model_entry(ServeOptions(model=tmp_path, name="m"), "cpu")
    assert (cpu["kind"], "gpus" in cpu) == ("KIND_CPU", False)
    gpu = model_entry(ServeOptions(model=tmp_path, name="m"), "gpu")
    assert (gpu["kind"], "gpus" in gpu) == ("KIND_MODEL", False)
    # The engine arguments stay as given: no explicit tensor_parallel_size/gpu_memory_utilization.
    assert gpu["engine_args"] == {"served_model_name": "m"}


def test_kind_and_gpus_render_into_the_model_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "gpu_count", lambda: 2)
    entry = model_entry(ServeOptions(model=tmp_path, name="m", kind="KIND_GPU", gpus=[1]), "gpu")
    cfg = (make_model_dir(tmp_path / "repo", entry) / "config.pbtxt").read_text()
    assert "kind: KIND_GPU" in cfg and "gpus: [ 1 ]" in cfg
    entry = model_entry(ServeOptions(model=tmp_path, name="t", gpus=[0, 1],
                                     engine_args={"tensor_parallel_size": 2}), "gpu")
    spec = json.loads((make_model_dir(tmp_path / "repo", entry) / "model.json").read_text())
    assert entry["kind"] == "KIND_MODEL" and spec["llmhost"]["visible_gpus"] == "0,1"


def test_an_impossible_placement_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "gpu_count", lambda: 1)
    with pytest.raises(PlacementError) as err:
        model_entry(ServeOptions(model=tmp_path, name="m", engine_args={"tensor_parallel_size": 2}), "gpu")
    assert err.value.problems == ["model m: tensor_parallel_size 2 needs 2 GPUs, the host has 1"]


def test_the_command_line_says_why_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    rc = cli.main(["serve", "--model", str(tmp_path / "model"), "--device", "cpu", "--kind", "KIND_GPU",
                   "--workdir", str(tmp_path / "work")])
    assert rc == 2
    assert "kind KIND_GPU needs llmhost_profile gpu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--model", str(tmp_path / "model"), "--gpus", "0,0"])
    assert "GPU ids must be distinct" in capsys.readouterr().err
