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


def test_textfile_metrics(tmp_path):
    from llmhost.smoke import write_textfile

    path = tmp_path / "llmhost_smoke.prom"
    write_textfile([Check("generate", True, "ok", 0.5), Check("metrics", False, "missing", 0.25)], str(path), "tiny")
    text = path.read_text()
    assert 'llmhost_smoke_success{model="tiny"} 0.0' in text
    assert 'llmhost_smoke_check_success{check="generate",model="tiny"} 1.0' in text
    assert 'llmhost_smoke_check_success{check="metrics",model="tiny"} 0.0' in text
    assert 'llmhost_smoke_duration_seconds{model="tiny"} 0.75' in text
    assert "llmhost_smoke_last_run_timestamp_seconds" in text


def test_smoke_cli_against_nothing_fails_and_writes_textfile(tmp_path):
    from llmhost.cli import main
    from tests.harness.net import free_port

    path = tmp_path / "s.prom"
    rc = main(["smoke", "--url", f"http://127.0.0.1:{free_port()}", "--no-grpc", "--model", "m",
               "--timeout", "2", "--textfile", str(path)])
    assert rc == 1
    assert 'llmhost_smoke_check_success{check="server live",model="m"} 0.0' in path.read_text()
