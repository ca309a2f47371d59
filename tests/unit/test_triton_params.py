"""config.pbtxt parameters read as NVIDIA's vllm_backend reads them, and what our
template writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmhost.backend.triton_params import ENABLE_VLLM_HEALTH_CHECK, REPORT_CUSTOM_METRICS, bool_param, metrics_enabled
from llmhost.server.layout import make_model_dir


def config(**params: str) -> dict[str, Any]:
    return {"name": "tiny", "parameters": {k: {"string_value": v} for k, v in params.items()}}


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("TRUE", True), (" True ", True), ("false", False),
                                                 ("1", False), ("yes", False), ("", False)])
def test_a_parameter_is_true_only_when_it_says_true(value: str, expected: bool) -> None:
    assert bool_param(config(REPORT_CUSTOM_METRICS=value), REPORT_CUSTOM_METRICS) is expected


def test_an_absent_parameter_is_false() -> None:
    assert bool_param({"name": "tiny"}, ENABLE_VLLM_HEALTH_CHECK) is False
    assert bool_param(config(OTHER="true"), ENABLE_VLLM_HEALTH_CHECK) is False


@pytest.mark.parametrize(("report", "engine_args", "expected"), [
    ("true", {}, True),
    ("true", {"disable_log_stats": False}, True),
    ("true", {"disable_log_stats": True}, False),  # as vllm_backend: model.json's disable_log_stats wins
    ("false", {}, False),
    (None, {}, False),  # absent: off, as vllm_backend
])
def test_metrics_need_the_parameter_and_no_disable_log_stats(report: str | None, engine_args: dict[str, Any],
                                                             expected: bool) -> None:
    cfg = config(REPORT_CUSTOM_METRICS=report) if report is not None else config()
    assert metrics_enabled(cfg, engine_args) is expected


def _params(text: str) -> dict[str, str]:
    """key -> string_value of each parameters block in a rendered config.pbtxt."""
    import re

    return dict(re.findall(r'key: "([A-Z_]+)"\s*value: \{ string_value: "([a-z]*)" \}', text))


@pytest.mark.parametrize(("extra", "expected"), [
    ({}, {"REPORT_CUSTOM_METRICS": "true"}),
    ({"report_custom_metrics": False}, {"REPORT_CUSTOM_METRICS": "false"}),
    ({"enable_vllm_health_check": True}, {"REPORT_CUSTOM_METRICS": "true", "ENABLE_VLLM_HEALTH_CHECK": "true"}),
])
def test_the_template_writes_the_parameters(tmp_path: Path, extra: dict[str, Any], expected: dict[str, str]) -> None:
    model = {"name": "tiny", "path": "/srv/models/tiny", "kind": "KIND_CPU", "instance_count": 1,
             "engine_args": {}, **extra}
    text = (make_model_dir(tmp_path, model) / "config.pbtxt").read_text()
    assert _params(text) == expected
