"""Every bad input gets an error naming the problem, and the server answers the
next good request (it stays ready)."""

from __future__ import annotations

import base64
import io
import json

import pytest
import requests
from PIL import Image

from tests.e2e._client import generate, grpc_stream

GOOD = {"text_input": "hello", "max_tokens": 2}
LONG_PROMPT = "def f(x):\n    return x\n" * 200  # far beyond max_model_len 512


def _png_b64() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"text_input": "x", "sampling_parameters": "{bad json"}, "'sampling_parameters' is not valid JSON"),
        ({"text_input": "x", "sampling_parameters": json.dumps({"nucleus": 0.9})},
         "unknown sampling parameter(s) ['nucleus']"),
        ({"text_input": "x", "temperature": "warm"}, "'temperature' must be a number"),
        ({"text_input": "x", "max_tokens": 0}, "'max_tokens' must be >= 1"),
        ({"text_input": "x", "max_tokens": -3}, "'max_tokens' must be >= 1"),
        ({"text_input": "x", "temperature": -1}, "'temperature' must be >= 0"),
        ({"text_input": "x", "top_p": 0}, "'top_p' must be in (0, 1]"),
        ({"text_input": "x", "top_p": 1.01}, "'top_p' must be in (0, 1]"),
        ({"text_input": LONG_PROMPT}, "max_model_len is 512"),
        ({"max_tokens": 3}, "missing input"),
        ({"text_input": ""}, "'text_input' is empty"),
        ({"messages": json.dumps({"role": "user", "content": "hi"})}, "must be a non-empty JSON list"),
        ({"messages": json.dumps([{"role": "user"}])}, "messages[0].content must be a string"),
        ({"messages": json.dumps([{"role": "robot", "content": "hi"}])}, "messages[0].role must be one of"),
        ({"messages": "not json"}, "'messages' is not valid JSON"),
        ({"text_input": "x", "n": 64}, "'n' must be between 1 and 8"),
        ({"text_input": "x", "json_schema": "not a schema"}, "must be a JSON schema object"),
        # The tiny model is text only: a real picture is refused naming the input, as is bad base64.
        ({"text_input": "<image> what is it", "image": [_png_b64()]},
         "input 'image' needs a multimodal model; this model takes text only (vLLM reports no multimodal "
         "support for Qwen2ForCausalLM)"),
        ({"text_input": "x", "image": ["not base64!"]}, "input 'image'[0] is not valid base64"),
    ],
)
def test_http_bad_input(server, body, needle):
    r = generate(server, **body)
    assert "error" in r, r
    assert needle in r["error"]
    ok = generate(server, **GOOD)
    assert ok["_status"] == 200 and "text_output" in ok, ok


def test_stream_bad_input_is_an_sse_error(server):
    with requests.post(f"{server.http}/v2/models/{server.name}/generate_stream",
                       json={"text_input": "x", "stream": True, "max_tokens": 0}, stream=True, timeout=60) as r:
        body = r.text
    assert "'max_tokens' must be >= 1" in body


def test_grpc_non_utf8_bytes(server):
    results, error = grpc_stream(server, {"text_input": b"caf\xe9 \xff"})
    assert not results
    assert error is not None and "not valid UTF-8: byte 0xe9 at position 3" in error


def test_grpc_wrong_type_for_bool_input(server):
    _, error = grpc_stream(server, {"text_input": "x", "stream": "yes"})
    assert error is not None  # Triton itself refuses BYTES for a BOOL input, naming it
    assert "stream" in error


def test_failures_are_counted_and_server_stays_ready(server):
    before = server.metric("vllm:request_failed_total", reason="invalid_request")
    generate(server, text_input="x", top_k="many")
    r = requests.get(f"{server.http}/v2/health/ready", timeout=10)
    assert r.status_code == 200
    import time

    time.sleep(1.5)  # metrics are pushed once a second
    assert server.metric("vllm:request_failed_total", reason="invalid_request") >= before + 1
