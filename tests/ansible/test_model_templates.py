"""The package's model templates rendered by Ansible's template module as the
model_repository role renders them (trim_blocks off): the same
bytes as `llmhost serve` renders, and no warnings on the way."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from llmhost.server.layout import render
from tests.harness.paths import ROOT

from ._helpers import ansible_playbook

MODEL = {"name": "tiny", "path": "/srv/weights/tiny", "kind": "KIND_CPU", "instance_count": 1,
         "default_max_tokens": 64, "max_n": 4, "drain_timeout_s": 20,
         "engine_args": {"max_model_len": 512, "enforce_eager": True, "served_model_name": "tiny"},
         "settings": {"stream_interval_ms": 5, "response_threads": 2}}


# A model over two GPUs of a GPU host (the roles' default kind there).
TP2 = {**MODEL, "name": "big", "kind": "KIND_MODEL", "gpus": [2, 3], "settings": {},
       "engine_args": {"tensor_parallel_size": 2, "served_model_name": "big"}}


@pytest.mark.parametrize("template", ["model.json.j2", "config.pbtxt.j2"])
def test_a_kind_model_models_gpus_reach_the_backend_not_triton(template: str, tmp_path: Path) -> None:
    out = tmp_path / template.removesuffix(".j2")
    src = ROOT / "src" / "llmhost" / "server" / "templates" / template
    play = [{"hosts": "localhost", "gather_facts": False, "connection": "local",
             "vars": {"ansible_python_interpreter": sys.executable},
             "tasks": [{"name": "Render", "ansible.builtin.template": {"src": str(src), "dest": str(out),
                                                                   "trim_blocks": False},
                        "vars": {"model": TP2}}]}]
    book = tmp_path / "render.yml"
    book.write_text(yaml.safe_dump(play))
    run = ansible_playbook("-i", "localhost,", str(book))
    assert run.rc == 0, run.output
    assert out.read_text() == render(template, model=TP2)
    if template == "model.json.j2":
        assert json.loads(out.read_text())["llmhost"]["visible_gpus"] == "2,3"
    else:
        assert "kind: KIND_MODEL" in out.read_text() and "gpus:" not in out.read_text()


@pytest.mark.parametrize("template", ["model.json.j2", "config.pbtxt.j2"])
def test_ansible_renders_what_serve_renders_without_warnings(template: str, tmp_path: Path) -> None:
    out = tmp_path / template.removesuffix(".j2")
    src = ROOT / "src" / "llmhost" / "server" / "templates" / template
    play = [{"hosts": "localhost", "gather_facts": False, "connection": "local",
             "vars": {"ansible_python_interpreter": sys.executable},
             "tasks": [{"name": "Render", "ansible.builtin.template": {"src": str(src), "dest": str(out),
                                                                   "trim_blocks": False},  # as the role
                        "vars": {"model": MODEL}}]}]
    book = tmp_path / "render.yml"
    book.write_text(yaml.safe_dump(play))
    run = ansible_playbook("-i", "localhost,", str(book))
    assert run.rc == 0, run.output
    assert "[WARNING]" not in run.output.replace("[WARNING]: No inventory", ""), run.output
    assert out.read_text() == render(template, model=MODEL)
    if template == "model.json.j2":
        settings = json.loads(out.read_text())["llmhost"]
        assert settings == {"default_max_tokens": 64, "max_n": 4, "drain_timeout_s": 20,
                            "stream_interval_ms": 5, "response_threads": 2}
