from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmhost.backend.config import (
    BackendSettings,
    ConfigError,
    load_model_config,
    locate_model_json,
    parse_model_config,
)


def test_split_engine_args_and_settings():
    cfg = parse_model_config({"model": "/m", "max_model_len": 64, "llmhost": {"default_max_tokens": 100}})
    assert cfg.engine_args == {"model": "/m", "max_model_len": 64}
    assert cfg.settings.default_max_tokens == 100
    assert cfg.settings.max_n == BackendSettings().max_n
    # Streams send one response per engine step by default, as NVIDIA's vllm_backend does.
    assert (cfg.settings.response_threads, cfg.settings.stream_interval_ms) == (1, 0.0)
    cfg = parse_model_config({"model": "/m", "llmhost": {"response_threads": 4, "stream_interval_ms": 50}})
    assert (cfg.settings.response_threads, cfg.settings.stream_interval_ms) == (4, 50.0)


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ([], "JSON object"),
        ({}, "'model'"),
        ({"model": "/m", "llmhost": []}, "'llmhost' must be an object"),
        ({"model": "/m", "llmhost": {"max_tokens": 5}}, "unknown llmhost setting(s) ['max_tokens']"),
        ({"model": "/m", "llmhost": {"default_max_tokens": 0}}, "must be >= 1"),
        ({"model": "/m", "llmhost": {"default_max_tokens": "5"}}, "must be an integer"),
        ({"model": "/m", "llmhost": {"drain_timeout_s": -1}}, "must be >= 0"),
        ({"model": "/m", "llmhost": {"exclude_input_in_output": 1}}, "true or false"),
        ({"model": "/m", "llmhost": {"response_threads": 0}}, "llmhost.response_threads must be >= 1"),
        ({"model": "/m", "llmhost": {"response_threads": 2.5}}, "must be an integer"),
        ({"model": "/m", "llmhost": {"response_threads": 65}}, "llmhost.response_threads must be <= 64"),
        ({"model": "/m", "llmhost": {"stream_interval_ms": -1}}, "llmhost.stream_interval_ms must be >= 0"),
        ({"model": "/m", "llmhost": {"stream_interval_ms": 5000}}, "llmhost.stream_interval_ms must be <= 1000"),
        ({"model": "/m", "llmhost": {"stream_interval_ms": "20"}}, "must be a number"),
    ],
)
def test_bad_config(raw, needle):
    with pytest.raises(ConfigError) as err:
        parse_model_config(raw)
    assert needle in str(err.value)


def test_load_errors_name_the_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_model_config(tmp_path / "model.json")
    (tmp_path / "model.json").write_text("{oops")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_model_config(tmp_path / "model.json")
    (tmp_path / "model.json").write_text(json.dumps({"model": "/m"}))
    assert load_model_config(tmp_path / "model.json").engine_args == {"model": "/m"}


def _write_model_json(path: Path, model: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model}))
    return path


@pytest.mark.parametrize("where", ["1/model.json", "model.json"])
def test_model_json_is_found_in_the_version_or_the_model_directory(tmp_path: Path, where: str):
    """NVIDIA's vllm_backend repositories keep it in the version directory, ours in the model's."""
    expected = _write_model_json(tmp_path / where, "/m")
    assert locate_model_json(tmp_path, "1") == (expected, [])
    assert load_model_config(expected).engine_args == {"model": "/m"}


def test_the_version_directory_wins_over_the_model_directory(tmp_path: Path):
    version_level = _write_model_json(tmp_path / "2" / "model.json", "/from-version")
    model_level = _write_model_json(tmp_path / "model.json", "/from-model")
    path, ignored = locate_model_json(tmp_path, "2")
    assert (path, ignored) == (version_level, [model_level])
    assert load_model_config(path).engine_args == {"model": "/from-version"}
    # Another version's model.json is not this version's.
    assert locate_model_json(tmp_path, "1") == (model_level, [])


def test_no_model_json_names_both_places_looked_at(tmp_path: Path):
    (tmp_path / "1").mkdir()
    with pytest.raises(ConfigError) as err:
        locate_model_json(tmp_path, "1")
    assert str(err.value) == f"no model.json: looked for {tmp_path}/1/model.json and {tmp_path}/model.json"


class _Pb:
    """The python backend module as TritonPythonModel._load_config uses it."""

    class TritonModelException(Exception):
        pass

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []
        self.Logger = SimpleNamespace(log_info=lambda m: self.lines.append(("info", m)),
                                      log_warn=lambda m: self.lines.append(("warn", m)))


def test_the_backend_reads_the_version_directorys_and_names_the_one_it_ignores(tmp_path: Path):
    from llmhost.backend.model import TritonPythonModel

    version_level = _write_model_json(tmp_path / "1" / "model.json", "/from-version")
    model_level = _write_model_json(tmp_path / "model.json", "/from-model")
    pb = _Pb()
    config = TritonPythonModel._load_config(pb, {"model_repository": str(tmp_path), "model_version": "1"})
    assert config.engine_args == {"model": "/from-version"}
    assert pb.lines == [("warn", f"[llmhost] {model_level} is ignored: {version_level} takes precedence"),
                        ("info", f"[llmhost] settings from {version_level}")]


def test_the_backend_fails_the_load_naming_both_places(tmp_path: Path):
    from llmhost.backend.model import TritonPythonModel

    pb = _Pb()
    with pytest.raises(_Pb.TritonModelException) as err:
        TritonPythonModel._load_config(pb, {"model_repository": str(tmp_path), "model_version": "3"})
    assert str(err.value) == f"no model.json: looked for {tmp_path}/3/model.json and {tmp_path}/model.json"


def test_engine_args_unknown_key_and_nested_config():
    from llmhost.backend.engine import build_engine_args

    with pytest.raises(ConfigError, match="'max_model_length' is not a vLLM engine argument"):
        build_engine_args({"model": "/m", "max_model_length": 5})
    nested = {"backend": "xgrammar", "disable_any_whitespace": True}
    args = build_engine_args({"model": "/m", "structured_outputs_config": nested})
    assert args.structured_outputs_config.disable_any_whitespace is True
    assert args.disable_log_stats is True  # our server default
    with pytest.raises(ConfigError, match="bad 'structured_outputs_config'"):
        build_engine_args({"model": "/m", "structured_outputs_config": {"nope": 1}})


@pytest.mark.parametrize("value", ["", "0", "2,3", "0,1,2,3"])
def test_visible_gpus_takes_cuda_visible_devices_lists(value: str):
    assert parse_model_config({"model": "m", "llmhost": {"visible_gpus": value}}).settings.visible_gpus == value


@pytest.mark.parametrize("value", ["a", "2,", ",2", "2 3", 3, None, ["2", "3"]])
def test_visible_gpus_refuses_anything_else_naming_the_setting(value: object):
    with pytest.raises(ConfigError, match=r"llmhost.visible_gpus must be GPU ids separated by commas"):
        parse_model_config({"model": "m", "llmhost": {"visible_gpus": value}})


def test_engine_start_method_defaults_to_spawn_and_takes_fork():
    assert parse_model_config({"model": "m"}).settings.engine_start_method == "spawn"
    given = {"model": "m", "llmhost": {"engine_start_method": "fork"}}
    assert parse_model_config(given).settings.engine_start_method == "fork"


@pytest.mark.parametrize("value", ["forkserver", "Spawn", "", 1, None])
def test_engine_start_method_refuses_anything_else_naming_the_choices(value: object):
    with pytest.raises(ConfigError, match=r"llmhost.engine_start_method must be one of spawn, fork, got"):
        parse_model_config({"model": "m", "llmhost": {"engine_start_method": value}})
