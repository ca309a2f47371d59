"""Backend directory and model repository layout, from the real pytriton wheel."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llmhost.server.layout import LayoutError, TritonInstall, make_backend_dir, make_model_dir


def test_backend_dir_from_bundled_triton(tmp_path: Path):
    triton = TritonInstall.from_pytriton()
    assert triton.server.is_file() and os.access(triton.server, os.X_OK)
    d = make_backend_dir(tmp_path / "backends", triton)
    assert (d / "python" / "libtriton_python.so").is_file()
    assert (d / "python" / "triton_python_backend_utils.py").is_file()
    assert os.access(d / "python" / "triton_python_backend_stub", os.X_OK)
    shim = (d / "vllm" / "model.py").read_text()
    assert "from llmhost.backend.model import TritonPythonModel" in shim
    before = (d / "python" / "libtriton_python.so").stat().st_mtime_ns
    make_backend_dir(tmp_path / "backends", triton)  # idempotent: nothing rewritten
    assert (d / "python" / "libtriton_python.so").stat().st_mtime_ns == before


def test_missing_stub_is_named():
    with pytest.raises(LayoutError, match=r"no python backend stub for Python 2\.7"):
        TritonInstall.from_pytriton("2.7")


def test_model_dir_renders_templates(tmp_path: Path):
    model = {"name": "tiny", "path": "/srv/models/tiny", "kind": "KIND_CPU", "instance_count": 1,
             "engine_args": {"max_model_len": 512, "enforce_eager": True}, "default_max_tokens": 64}
    d = make_model_dir(tmp_path, model)
    cfg = (d / "config.pbtxt").read_text()
    assert 'name: "tiny"' in cfg and 'backend: "vllm"' in cfg and "decoupled: true" in cfg
    assert "max_batch_size: 0" in cfg and "kind: KIND_CPU" in cfg
    data = json.loads((d / "model.json").read_text())
    assert data["model"] == "/srv/models/tiny" and data["max_model_len"] == 512
    assert data["llmhost"]["default_max_tokens"] == 64
    assert (d / "1").is_dir()


def test_engine_args_override_and_gpu_placement(tmp_path: Path):
    model = {"name": "big", "path": "/m", "kind": "KIND_GPU", "gpus": [0, 1],
             "engine_args": {"model": "/other", "tensor_parallel_size": 2}}
    d = make_model_dir(tmp_path, model)
    assert json.loads((d / "model.json").read_text())["model"] == "/other"
    assert "gpus: [ 0, 1 ]" in (d / "config.pbtxt").read_text()


def test_serve_passes_extra_tritonserver_arguments_last(tmp_path: Path):
    from llmhost.cli import build_parser
    from llmhost.server.serve import ServeOptions, server_command

    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--triton-arg=--http-thread-count=32",
                                      "--triton-arg=--log-info=false"])
    assert args.triton_arg == ["--http-thread-count=32", "--log-info=false"]
    triton = TritonInstall.from_pytriton()
    cmd = server_command(triton, tmp_path, ServeOptions(model=tmp_path, triton_args=args.triton_arg), "cpu",
                         "k" * 64)
    assert cmd[-2:] == ["--http-thread-count=32", "--log-info=false"]
    assert f"--model-repository={tmp_path / 'models'}" in cmd


def test_backend_settings_reach_model_json_and_win(tmp_path: Path):
    from llmhost.backend.config import load_model_config
    from llmhost.cli import build_parser
    from llmhost.server.serve import ServeOptions, model_entry

    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--setting", "stream_interval_ms=0",
                                      "--setting", "response_threads=2", "--default-max-tokens", "64"])
    opts = ServeOptions(model=tmp_path, default_max_tokens=args.default_max_tokens, settings=dict(args.setting))
    d = make_model_dir(tmp_path / "repo", model_entry(opts, "cpu"))
    settings = load_model_config(d / "model.json").settings
    assert (settings.stream_interval_ms, settings.response_threads, settings.default_max_tokens) == (0.0, 2, 64)
    model = {"name": "m", "path": "/m", "default_max_tokens": 64, "settings": {"default_max_tokens": 32}}
    d = make_model_dir(tmp_path / "repo2", model)
    assert json.loads((d / "model.json").read_text())["llmhost"]["default_max_tokens"] == 32
