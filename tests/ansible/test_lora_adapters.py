"""LoRA adapters deployed from the inventory: the model_repository role stages each
model's adapters like its weights (a generated tiny one, a local directory, a URL
archive) and writes multi_lora.json beside model.json, which then sets enable_lora.

The whole role runs for real on this machine (connection local) into a temporary
prefix; the backend's own loader (llmhost.backend.lora) then reads what it wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tarfile
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmhost.backend.config import load_model_config
from llmhost.backend.lora import check_published, with_adapters
from llmhost.tiny.lora import write_tiny_lora
from tests.ansible._helpers import PlaybookRun, ansible_playbook, ansible_playbook_on_hosts, batch_inventory

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the role writes root-owned directories")


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def files(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A directory served over HTTP (a stand-in for a site's artifact server) and its URL."""
    root = tmp_path / "files"
    root.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _fake_model(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen2"}\n')
    return path


def _venv(tmp_path: Path) -> Path:
    """A venv for the role whose bin/llmhost is this checkout's (tiny-lora)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    exe = venv / "bin" / "llmhost"
    src = Path(__file__).resolve().parents[2] / "src"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH={src} exec {sys.executable} -m llmhost.cli "$@"\n')
    exe.chmod(0o755)
    return venv


def _variables(tmp_path: Path, models: list[dict[str, Any]]) -> dict[str, Any]:
    """The variables of a deployment of `models` into tmp_path (prefix/, venv/)."""
    return {
        "llmhost_profile": "cpu",
        "llmhost_prefix": str(tmp_path / "prefix"),
        "llmhost_venv_dir": str(_venv(tmp_path)),
        "llmhost_models": models,
    }


def _book(tmp_path: Path) -> Path:
    """The play: the model_repository role on the group inference, a handler that says it changed."""
    play = [{"name": "Deploy the model repository", "hosts": "inference", "gather_facts": False,
             "roles": ["model_repository"],
             "handlers": [{"name": "Note the change", "ansible.builtin.debug": {"msg": "model repository changed"},
                           "listen": "model_repository changed"}]}]
    book = tmp_path / "deploy.yml"
    book.write_text(yaml.safe_dump(play, sort_keys=False))
    return book


def _run(tmp_path: Path, models: list[dict[str, Any]]) -> PlaybookRun:
    (tmp_path / "vars.json").write_text(json.dumps(_variables(tmp_path, models)))
    return ansible_playbook("-i", "inventory/localhost.yml", "-e", f"@{tmp_path / 'vars.json'}", str(_book(tmp_path)),
                            timeout=600)


def _runs_per_host(folder: Path, deployments: list[tuple[Path, list[dict[str, Any]]]]) -> list[PlaybookRun]:
    """_run(tmp_path, models) for every (tmp_path, models), in one ansible-playbook run: one host
    per deployment, its variables its host vars; per deployment what its host alone printed."""
    hosts = [_variables(tmp_path, models) for tmp_path, models in deployments]
    return ansible_playbook_on_hosts(batch_inventory(hosts), len(hosts), str(_book(folder)), timeout=600)


def test_adapters_are_staged_and_listed_idempotently(tmp_path: Path, files: tuple[Path, str]) -> None:
    root, url = files
    base = _fake_model(tmp_path / "base-weights")
    mine = write_tiny_lora(tmp_path / "mine", seed=3)
    packed = write_tiny_lora(tmp_path / "packed-src" / "adapter", seed=4)
    with tarfile.open(root / "packed.tar.gz", "w:gz") as tar:
        tar.add(packed, arcname="adapter")
    sha = hashlib.sha256((root / "packed.tar.gz").read_bytes()).hexdigest()
    adapters = [
        {"name": "gen", "source": "tiny", "seed": 5},
        {"name": "mine", "source": "local", "path": str(mine)},
        {"name": "packed", "source": "url", "url": f"{url}/packed.tar.gz", "sha256": sha, "archive_root": "adapter"},
    ]
    models = [{"name": "base", "source": "local", "path": str(base), "lora_adapters": adapters,
               "engine_args": {"max_lora_rank": 8}},
              {"name": "plain", "source": "local", "path": str(base)}]
    run = _run(tmp_path, models)
    assert run.rc == 0, run.output
    weights = tmp_path / "prefix" / "weights"
    repo = tmp_path / "prefix" / "models"
    multi = json.loads((repo / "base" / "multi_lora.json").read_text())
    assert list(multi) == ["gen", "mine", "packed"]  # the inventory's order: the ids follow it
    assert multi == {"gen": str(weights / "base" / "lora-gen" / "tiny-seed5"), "mine": str(mine),
                     "packed": str(weights / "base" / f"lora-packed/url-{sha[:16]}/adapter")}
    for directory in multi.values():
        assert json.loads((Path(directory) / "adapter_config.json").read_text())["peft_type"] == "LORA"
    # The backend loads what the role wrote: enable_lora on, the adapters in order with ids 1, 2, 3.
    config, note = with_adapters(load_model_config(repo / "base" / "model.json"), repo / "base" / "model.json")
    assert "gen, mine, packed" in note
    assert config.engine_args["enable_lora"] is True and config.engine_args["max_lora_rank"] == 8
    assert [(a.name, a.int_id, a.path) for a in config.adapters] == [
        (name, i, multi[name]) for i, name in enumerate(multi, start=1)]
    assert not (repo / "plain" / "multi_lora.json").exists()
    assert "enable_lora" not in json.loads((repo / "plain" / "model.json").read_text())
    # config.pbtxt publishes the names for the gateway, and the backend's load check takes them.
    assert _published(repo / "base") == '["gen", "mine", "packed"]'
    check_published({"parameters": {"lora_adapters": {"string_value": _published(repo / "base")}}}, config.adapters)
    assert _published(repo / "plain") is None

    again = _run(tmp_path, models)
    assert again.rc == 0, again.output
    assert again.recap()["localhost"]["changed"] == 0, again.output

    # Adapters removed from the inventory: multi_lora.json and enable_lora go.
    models[0] = {k: v for k, v in models[0].items() if k != "lora_adapters"}
    removed = _run(tmp_path, models)
    assert removed.rc == 0, removed.output
    assert not (repo / "base" / "multi_lora.json").exists()
    assert "enable_lora" not in json.loads((repo / "base" / "model.json").read_text())
    assert "model repository changed" in removed.output
    assert _published(repo / "base") is None


def _published(model_dir: Path) -> str | None:
    """config.pbtxt's lora_adapters parameter, as Triton reads it (None: not set)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return config.parameters["lora_adapters"].string_value if "lora_adapters" in config.parameters else None


BAD_ADAPTERS: list[tuple[Any, tuple[str, ...]]] = [
    # The role's argument_specs refuse a wrong type or an unknown source; the preflight the rest.
    ([{"name": "a", "source": "ftp"}],
     ("value of source must be one of", "got: ftp", "llmhost_models -> lora_adapters")),
    ([{"name": "a", "source": "url", "url": "http://x/a.tgz"}], ("LoRA adapter a of model base", "missing: sha256")),
    ([{"name": "a", "source": "tiny"}, {"name": "a", "source": "tiny"}], ("LoRA adapter a of model base", "unique")),
    ([{"name": "../up", "source": "tiny"}], ("LoRA adapter ../up of model base", "must be unique and match")),
    ("alpha", ("'lora_adapters' found in 'llmhost_models' is of type str",)),
]


@pytest.fixture(scope="module")
def failed_runs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, PlaybookRun]]:
    """The deployments that must fail, all in one ansible-playbook run, as (their folder, run):
    the i-th of BAD_ADAPTERS, then last an adapter directory without adapter_config.json
    (the folder's not-an-adapter)."""
    base = tmp_path_factory.mktemp("failing")
    folders = [base / f"case-{i}" for i in range(len(BAD_ADAPTERS) + 1)]
    adapters = [bad for bad, _ in BAD_ADAPTERS]
    empty = folders[-1] / "not-an-adapter"
    empty.mkdir(parents=True)
    adapters.append([{"name": "x", "source": "local", "path": str(empty)}])
    deployments = [(folder, [{"name": "base", "source": "local", "path": str(_fake_model(folder / "base-weights")),
                              "lora_adapters": bad}])
                   for folder, bad in zip(folders, adapters, strict=True)]
    runs = _runs_per_host(base, deployments)
    return list(zip(folders, runs, strict=True))


@pytest.mark.parametrize(("adapters", "needles"), BAD_ADAPTERS)
def test_bad_adapters_fail_naming_model_and_adapter(failed_runs: list[tuple[Path, PlaybookRun]], adapters: Any,
                                                    needles: tuple[str, ...]) -> None:
    tmp_path, run = failed_runs[BAD_ADAPTERS.index((adapters, needles))]
    failure = run.failure()
    for needle in needles:
        assert needle in failure, failure[:3000]
    assert not (tmp_path / "prefix" / "models").exists(), "nothing is written when preflight fails"


def test_adapter_directory_without_adapter_config_fails(failed_runs: list[tuple[Path, PlaybookRun]]) -> None:
    tmp_path, run = failed_runs[-1]
    empty = tmp_path / "not-an-adapter"
    failure = run.failure()
    assert "No adapter_config.json" in failure and "base/x" in failure and str(empty) in failure, failure[:3000]
