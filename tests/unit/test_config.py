from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmhost.backend.config import BackendSettings, ConfigError, load_model_config, parse_model_config


def test_split_engine_args_and_settings():
    cfg = parse_model_config({"model": "/m", "max_model_len": 64, "llmhost": {"default_max_tokens": 100}})
    assert cfg.engine_args == {"model": "/m", "max_model_len": 64}
    assert cfg.settings.default_max_tokens == 100
    assert cfg.settings.max_n == BackendSettings().max_n
    assert (cfg.settings.response_threads, cfg.settings.stream_interval_ms) == (1, 50.0)
    cfg = parse_model_config({"model": "/m", "llmhost": {"response_threads": 4, "stream_interval_ms": 0}})
    assert (cfg.settings.response_threads, cfg.settings.stream_interval_ms) == (4, 0.0)


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
