"""Triton's native API through the gateway: generate, generate_stream (SSE),
health, metadata and readiness over the gRPC pool, behind keys and limits; every
other /v2 path 404."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.upstreams.client import UpstreamDown, classify
from tests.unit._gateway_fakes import Fake, client, infer_response, keystore, make_app


def _run(app: Any, method: str, path: str, key: Any = "default", **kw: Any) -> Any:
    async def go() -> Any:
        c = client(app) if key == "default" else client(app, key)
        async with c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def _inputs(msg: Any) -> dict[str, tuple[str, bytes]]:
    return {t.name: (t.datatype, raw) for t, raw in zip(msg.inputs, msg.raw_input_contents, strict=True)}


def test_generate_maps_inputs_and_parameters_and_answers_as_triton():
    fake = Fake()
    body = {"text_input": "def f():", "max_tokens": 8, "exclude_input_in_output": True,
            "parameters": {"temperature": 0.5, "stop": ["\n"]}}
    r = _run(make_app(fake), "POST", "/v2/models/m/generate", json=body)
    assert r.status_code == 200
    assert r.json() == {"model_name": "m", "model_version": "1", "text_output": "hello", "finish_reason": "length"}
    msg = fake.seen[0]
    inputs = _inputs(msg)
    assert inputs["text_input"] == ("BYTES", b"\x08\x00\x00\x00def f():")
    assert inputs["exclude_input_in_output"] == ("BOOL", b"\x01")
    assert inputs["return_num_output_tokens"] == ("BOOL", b"\x01")  # asked always, for usage and limits
    assert msg.parameters["max_tokens"].int64_param == 8
    assert msg.parameters["temperature"].double_param == 0.5
    assert json.loads(msg.parameters["stop"].string_param) == ["\n"]
    assert msg.parameters["triton_enable_empty_final_response"].bool_param


def test_images_pass_through_as_one_bytes_input_of_shape_n():
    fake = Fake()
    for image, shape in (("aGk=", [1]), (["aGk=", "eW8="], [2])):
        r = _run(make_app(fake), "POST", "/v2/models/m/generate", json={"text_input": "<image> x", "image": image})
        assert r.status_code == 200
        msg = fake.seen[-1]
        t = next(t for t in msg.inputs if t.name == "image")
        assert (t.datatype, list(t.shape)) == ("BYTES", shape)
        items = [image] if isinstance(image, str) else image
        assert _inputs(msg)["image"][1] == b"".join(len(v).to_bytes(4, "little") + v.encode() for v in items)
        assert "image" not in msg.parameters


def test_generate_returns_the_counts_the_client_asked_for():
    r = _run(make_app(Fake()), "POST", "/v2/models/m/generate",
             json={"text_input": "x", "return_num_output_tokens": True})
    assert r.json()["num_output_tokens"] == 2 and "num_input_tokens" not in r.json()  # 1 + 1: per response


def test_one_answer_from_several_responses_joins_each_completions_parts():
    from llmhost.gateway.doors.triton_generate import _JOIN

    top = {"5": {"logprob": -1.0, "rank": 1, "decoded_token": "a"}}
    joined = _JOIN["logprobs"](json.dumps([top]), json.dumps([top, top]))
    assert json.loads(joined) == [top, top, top]
    assert _JOIN["logprobs"]("null", "null") == "null"
    assert _JOIN["num_output_tokens"](2, 3) == 5 and _JOIN["text_output"]("he", "llo") == "hello"
    assert "finish_reason" not in _JOIN and "cumulative_logprob" not in _JOIN  # the latest wins


def test_the_new_return_inputs_are_inputs_checked_by_name():
    from llmhost.gateway.doors.triton_generate import BOOL_INPUTS

    assert {"return_cumulative_logprob", "return_logprobs"} <= set(BOOL_INPUTS)
    r = _run(make_app(Fake()), "POST", "/v2/models/m/generate", json={"text_input": "x", "return_logprobs": "yes"})
    assert r.status_code == 400 and "return_logprobs" in r.json()["error"]


def test_generate_stream_sends_each_response_as_an_sse_event():
    r = _run(make_app(Fake()), "POST", "/v2/models/m/generate_stream",
             json={"messages": json.dumps([{"role": "user", "content": "hi"}]), "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(block[len("data: "):]) for block in r.text.split("\n\n") if block]
    assert [e["text_output"] for e in events] == ["he", "llo"]
    assert events[1]["finish_reason"] == "length" and events[0]["model_name"] == "m"


def test_a_backend_error_is_tritons_error_object():
    fake = Fake(fail="sampling parameter 'temperature' must be >= 0")
    r = _run(make_app(fake), "POST", "/v2/models/m/generate", json={"text_input": "x", "temperature": -1})
    assert r.status_code == 400 and r.json() == {"error": "sampling parameter 'temperature' must be >= 0"}
    r = _run(make_app(fake), "POST", "/v2/models/m/generate_stream", json={"text_input": "x"})
    assert r.status_code == 400 and "temperature" in r.json()["error"]


def test_an_error_mid_stream_is_an_error_event():
    class Dies(Fake):
        async def infer_stream(self, msg: Any) -> AsyncIterator[Any]:
            yield infer_response(False, text_output=["he"])
            raise classify("internal error: KeyError; the server log has the details")

    r = _run(make_app(Dies()), "POST", "/v2/models/m/generate_stream", json={"text_input": "x", "stream": True})
    events = [json.loads(block[len("data: "):]) for block in r.text.split("\n\n") if block]
    assert events[0]["text_output"] == "he" and events[-1] == {
        "error": "internal error: KeyError; the server log has the details"}


def test_native_generate_is_retried_on_another_upstream_when_the_first_is_down():
    from llmhost.gateway.config import GatewayConfig
    from llmhost.gateway.routing.pool import UpstreamPool

    class Down(Fake):
        async def infer_stream(self, msg: Any) -> AsyncIterator[Any]:
            self.calls += 1
            raise UpstreamDown(self.name)
            yield  # an async generator

    a, b = Down("a"), Fake("b")
    pool = UpstreamPool([("a:1", a), ("b:1", b)], ["m"])
    app = make_app(pool, config=GatewayConfig(upstreams=["a:1", "b:1"], models=["m"]))
    r = _run(app, "POST", "/v2/models/m/generate", json={"text_input": "x"})
    assert r.status_code == 200 and (a.calls, b.calls) == (1, 1)


@pytest.mark.parametrize(("body", "names"), [
    ({"text_input": "x", "stream": "yes"}, "stream"),
    ({"text_input": 5}, "text_input"),
    ({"text_input": "x", "parameters": [1]}, "parameters"),
    ({"text_input": "x", "seed": None}, "seed"),
    ({"text_input": "x", "id": 3}, "id"),
    ({"text_input": "x", "image": []}, "image"),
    ({"text_input": "x", "image": ["aGk=", 5]}, "image"),
    ({"text_input": "x", "image": {"a": 1}}, "image"),
    ([1, 2], "JSON object"),
])
def test_bad_generate_bodies_are_400_naming_the_field(body, names):
    fake = Fake()
    r = _run(make_app(fake), "POST", "/v2/models/m/generate", json=body)
    assert r.status_code == 400 and names in r.json()["error"]
    assert fake.calls == 0


def test_a_body_that_is_not_json_is_400_and_a_large_one_413():
    app = make_app(Fake())
    r = _run(app, "POST", "/v2/models/m/generate", content=b"{nope")
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    r = _run(app, "POST", "/v2/models/m/generate", content=b"x" * 5000)
    assert r.status_code == 413


def test_the_keys_max_tokens_cap_applies():
    fake = Fake()
    app = make_app(fake, keystore(max_tokens=16))
    r = _run(app, "POST", "/v2/models/m/generate", json={"text_input": "x", "max_tokens": 17})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]
    r = _run(app, "POST", "/v2/models/m/generate", json={"text_input": "x",
                                                          "sampling_parameters": '{"max_tokens": 99}'})
    assert r.status_code == 400 and "16" in r.json()["error"]
    assert _run(app, "POST", "/v2/models/m/generate", json={"text_input": "x"}).status_code == 200
    assert fake.seen[-1].parameters["max_tokens"].int64_param == 16


@pytest.mark.parametrize("spelling", [4096.0, "4096", " 4096 ", "+4096", "100_000", "4_0_9_6", {"sp": '"4096"'}])
def test_no_spelling_of_a_number_passes_the_keys_cap(spelling: Any):
    """The gateway reads max_tokens as the backend will (llmhost.numbers.integer)."""
    body: dict[str, Any] = {"text_input": "x"}
    if isinstance(spelling, dict):  # in the JSON input instead of a parameter
        body["sampling_parameters"] = '{"max_tokens": ' + spelling["sp"] + "}"
    else:
        body["max_tokens"] = spelling
    fake = Fake()
    r = _run(make_app(fake, keystore(max_tokens=16)), "POST", "/v2/models/m/generate", json=body)
    assert r.status_code == 400 and "at most 16" in r.json()["error"], r.text
    assert not fake.seen  # nothing reached the backend


def test_a_max_tokens_that_is_no_number_is_refused_naming_it():
    r = _run(make_app(Fake(), keystore(max_tokens=16)), "POST", "/v2/models/m/generate",
             json={"text_input": "x", "max_tokens": "lots"})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"], r.text


@pytest.mark.parametrize("body", [
    b'{"text_input": "x", "max_tokens": "\xc2\xb2"}',  # a superscript two: a digit to str.isdigit
    b'{"text_input": "x", "n": "\xc2\xb2"}',
    b'{"text_input": "x", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"text_input": "x", "sampling_parameters": "{\\"max_tokens\\": \\"\xc2\xb2\\"}"}',
])
def test_malformed_native_input_is_a_400_without_a_traceback(body: bytes):
    config = GatewayConfig(upstreams=["up:1"], models=["m"], max_body_bytes=1 << 20)
    app = make_app(Fake(), keystore(max_tokens=16), config=config)
    r = _run(app, "POST", "/v2/models/m/generate", content=body)
    assert r.status_code == 400, r.text
    assert "Traceback" not in r.text and "File " not in r.text


@pytest.mark.parametrize("body", [
    {"text_input": "x", "triton_enable_empty_final_response": False},
    {"text_input": "x", "parameters": {"triton_enable_empty_final_response": False}},
    {"text_input": "x", "parameters": {"triton_priority": 1}},
])
def test_a_client_cannot_set_tritons_own_parameters(body):
    fake = Fake()
    r = _run(make_app(fake), "POST", "/v2/models/m/generate", json=body)
    assert r.status_code == 400 and "set by the gateway" in r.json()["error"], r.text
    assert fake.calls == 0


def test_native_requests_take_the_keys_rate_limits():
    app = make_app(Fake(), keystore(rpm=1))
    assert _run(app, "POST", "/v2/models/m/generate", json={"text_input": "x"}).status_code == 200
    r = _run(app, "POST", "/v2/models/m/generate_stream", json={"text_input": "x"})
    assert r.status_code == 429 and "requests per min" in r.json()["error"] and r.headers["retry-after"] == "60"


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v2/models/m/generate"), ("POST", "/v2/models/m/generate_stream"), ("GET", "/v2/health/live"),
    ("GET", "/v2/health/ready"), ("GET", "/v2/models/m"), ("GET", "/v2/models/m/ready"),
])
def test_native_paths_need_a_key(method, path):
    fake = Fake()
    for key in (None, "wrong-key-0123456789"):
        r = _run(make_app(fake), method, path, key=key, json={"text_input": "x"})
        assert r.status_code == 401 and "error" in r.json() and r.headers["www-authenticate"] == "Bearer"
    assert fake.calls == 0


def test_health_readiness_and_metadata():
    fake = Fake()
    app = make_app(fake)
    assert _run(app, "GET", "/v2/health/live").status_code == 200
    assert _run(app, "GET", "/v2/health/ready").status_code == 200
    assert _run(app, "GET", "/v2/models/m/ready").status_code == 200
    meta = _run(app, "GET", "/v2/models/m").json()
    assert meta["name"] == "m" and meta["inputs"][0]["name"] == "text_input"
    r = _run(app, "GET", "/v2/models/other/ready")
    assert r.status_code == 404 and "other" in r.json()["error"]
    assert _run(app, "POST", "/v2/models/other/generate", json={"text_input": "x"}).status_code == 404
    not_ready = make_app(Fake(ready=()))
    assert _run(not_ready, "GET", "/v2/health/ready").status_code == 400
    assert _run(not_ready, "GET", "/v2/models/m/ready").status_code == 400
    assert _run(not_ready, "GET", "/v2/health/live").status_code == 200
    down = make_app(Fake(reachable=False))
    r = _run(down, "GET", "/v2/models/m")
    assert r.status_code == 503 and "error" in r.json()


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v2"), ("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/m/load"),
    ("POST", "/v2/repository/models/m/unload"), ("GET", "/v2/models/m/stats"), ("GET", "/v2/models/stats"),
    ("GET", "/v2/trace/setting"), ("POST", "/v2/trace/setting"), ("GET", "/v2/models/m/trace/setting"),
    ("GET", "/v2/logging"), ("POST", "/v2/logging"), ("GET", "/v2/systemsharedmemory/status"),
    ("POST", "/v2/systemsharedmemory/region/r/register"), ("GET", "/v2/cudasharedmemory/status"),
    ("POST", "/v2/cudasharedmemory/region/r/unregister"), ("GET", "/v2/models/m/config"),
    ("POST", "/v2/models/m/infer"), ("POST", "/v2/models/m/versions/1/infer"),
    ("POST", "/v2/models/m/versions/1/generate"),
])
def test_every_other_v2_path_is_404(method, path):
    fake = Fake()
    r = _run(make_app(fake), method, path, json={})
    assert r.status_code == 404 and r.json()["error"]  # GET /v2/models/stats: no model named "stats"
    assert fake.calls == 0 and fake.seen == []
