from __future__ import annotations

import pytest

from llmhost.smoke import Check, parse_sse, render, series_for_model


def test_parse_sse_events_and_errors():
    lines = ['data: {"text_output": "a"}', "", 'data: {"text_output": "b", "num_output_tokens": 2}']
    assert [e["text_output"] for e in parse_sse(lines)] == ["a", "b"]
    with pytest.raises(RuntimeError, match="stream error: boom"):
        parse_sse(['data: {"error": "boom"}'])


def test_series_for_model_reads_raw_names():
    text = (
        "# TYPE vllm:x_bucket counter\n"
        'vllm:x_bucket{le="+Inf",model="tiny",version="1"} 3\n'
        'nv_inference_request_success{model="tiny",version="1"} 7\n'
        'vllm:y{model="other",version="1"} 1\n'
        "nv_cpu_utilization 0.5\n"
    )
    assert series_for_model(text, "tiny") == {"vllm:x_bucket", "nv_inference_request_success"}


def test_render_names_failures():
    out = render([Check("generate", True, "16 tokens", 0.1), Check("metrics", False, "missing", 0.0)], False)
    assert "FAILED: metrics" in out
    assert '"ok": false' in render([Check("x", False, "d", 0.0)], True)
