"""POST /v1/responses: the translation to the chat path and back, checked with the
official `openai` client against the gateway's app on fake upstreams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from prometheus_client.parser import text_string_to_metric_families

from llmhost.gateway.doors.openai.responses import parse_request, to_chat
from llmhost.gateway.errors import ApiError
from llmhost.gateway.metrics import GatewayMetrics
from llmhost.gateway.upstreams.client import Piece
from llmhost.gateway.upstreams.request import BackendRequest
from tests.harness.fuzz import FUZZ, check_responses_answer, responses_bodies, sent_text
from tests.unit._gateway_fakes import KEY, Fake, client, keystore, make_app

CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _body(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **kw}


def _mapped(**kw: Any) -> BackendRequest:
    return to_chat(parse_request(_body(**kw)))


# --- the request as a chat --------------------------------------------------------

def test_text_input_follows_the_instructions_as_a_user_message():
    req = _mapped(instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9)
    assert req.chat and req.messages == [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "hi"}]
    assert req.sampling == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9}


def test_input_items_become_chat_turns():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Sunny in Paris.", "annotations": [], "logprobs": []}]},
    ]
    req = _mapped(input=items, tools=[WEATHER], tool_choice="auto")
    assert req.messages == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "rain", "tool_call_id": "c2"},
        {"role": "assistant", "content": [{"type": "text", "text": "Sunny in Paris."}]},
    ]
    assert req.sampling["tools"] == [{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                                       if k != "type"}}]
    assert req.sampling["tool_choice"] == "auto"


def test_named_tool_choice_reasoning_effort_and_text_format_map_to_chats():
    req = _mapped(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                  reasoning={"effort": "low", "summary": "auto"},
                  text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}})
    assert req.sampling["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert req.sampling["reasoning_effort"] == "low"
    assert req.sampling["json_schema"] == {"type": "object"}


BAD: list[tuple[dict[str, Any], str | None]] = [
    ({"model": "m"}, "input"),
    (_body(input=""), "input"),
    (_body(input=[]), "input"),
    (_body(input=["text"]), "input[0]"),
    (_body(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type"),
    (_body(input=[{"role": "robot", "content": "x"}]), "input[0].role"),
    (_body(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]), "input[0].content[0].type"),
    (_body(input=[{"role": "user", "content": [{"type": "input_text"}]}]), "input[0].content[0].text"),
    (_body(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]),
     "input[0].content[0].file_id"),
    (_body(input=[{"role": "user", "content": "x", "colour": 1}]), "input[0].colour"),
    (_body(input=[{"type": "function_call", "call_id": "c", "name": "f"}]), "input[0].arguments"),
    (_body(input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}]), "input[0].call_id"),
    (_body(tools=[{"type": "web_search"}]), "tools[0].type"),
    (_body(tools=[{"type": "function", "parameters": {}}]), "tools[0].name"),
    (_body(tools=[{"type": "function", "name": "f", "parameters": "x"}]), "tools[0].parameters"),
    (_body(tools=[WEATHER], tool_choice={"type": "function", "name": "other"}), "tool_choice.name"),
    (_body(tools=[]), "tools"),
    (_body(tool_choice={"type": "file_search"}), "tool_choice.type"),
    (_body(tool_choice="required"), "tool_choice"),
    (_body(previous_response_id="resp_1"), "previous_response_id"),
    (_body(background=True), "background"),
    (_body(conversation="conv_1"), "conversation"),
    (_body(max_tool_calls=2), "max_tool_calls"),
    (_body(top_logprobs=3), "top_logprobs"),
    (_body(max_output_tokens=0), "max_output_tokens"),
    (_body(max_output_tokens="9"), "max_output_tokens"),
    (_body(temperature=-1), "temperature"),
    (_body(top_p=2), "top_p"),
    (_body(stream="yes"), "stream"),
    (_body(reasoning={"effort": "huge"}), "reasoning.effort"),
    (_body(text={"format": {"type": "json_schema", "schema": {}}}), "text.format.name"),
    (_body(text={"format": {"type": "yaml"}}), "text.format.type"),
    (_body(truncation="auto"), "truncation"),
    (_body(colour="blue"), "colour"),
    (_body(model=""), "model"),
]


def _post(body: Any, key: str | None = KEY, upstream: Any = None, **app_kw: Any) -> tuple[httpx.Response, Fake]:
    fake = upstream or Fake()
    app = make_app(fake, **app_kw)

    async def run() -> httpx.Response:
        async with client(app, key) as c:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await c.post("/v1/responses", content=content)

    return asyncio.run(run()), fake


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p or "none" for _, p in BAD])
def test_bad_input_is_a_400_naming_the_field_and_never_reaches_the_engine(body, param):
    r, fake = _post(body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert param.split("[")[0].split(".")[0] in r.json()["error"]["message"]
    assert "Traceback" not in r.text
    assert fake.seen == []


@pytest.mark.parametrize("raw", [b"{", b"[1]", b'"x"', b"\xff"])
def test_a_body_that_is_no_json_object_is_a_400(raw):
    r, fake = _post(raw)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert fake.seen == []


@pytest.mark.parametrize("kind", ["x" * 1000, [["y" * 50] * 50]], ids=["long-text", "big-list"])
def test_an_unknown_type_is_quoted_back_short(kind):
    for body in (_body(input=[{"type": kind}]), _body(tools=[{"type": kind}])):
        r, _ = _post(body)
        assert r.status_code == 400 and len(r.json()["error"]["message"]) < 200, r.text[:300]


def test_previous_response_id_says_nothing_is_stored():
    r, _ = _post(_body(previous_response_id="resp_1"))
    assert "stores none" in r.json()["error"]["message"]


def test_keys_scopes_and_caps_hold_as_for_chat():
    r, fake = _post(_body(), key=None)
    assert r.status_code == 401
    r, fake = _post(_body(), keys=keystore(models=["other"]))
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r, fake = _post(_body(max_output_tokens=16), keys=keystore(max_tokens=8))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    r, fake = _post(_body(), keys=keystore(max_tokens=8))
    assert r.status_code == 200 and fake.seen[0].sampling["max_tokens"] == 8
    assert fake.seen[0].chat


# --- the answer ---------------------------------------------------------------------

class Scripted(Fake):
    """An upstream that answers with the pieces it is given."""

    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__()
        self.pieces = pieces

    async def generate(self, req: BackendRequest) -> AsyncIterator[Piece]:
        self.seen.append(req)
        for piece in self.pieces:
            yield piece


def _openai(upstream: Any, metrics: Any = None) -> openai.AsyncOpenAI:
    app = make_app(upstream, metrics=metrics)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False))
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=KEY, http_client=http, max_retries=0)


def test_the_official_client_reads_an_answer():
    async def run() -> Any:
        return await _openai(Fake()).responses.create(model="m", input="hi", instructions="Be brief.")

    resp = asyncio.run(run())
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == "hello from up!"
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.instructions == "Be brief."
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (3, 4, 7)


async def _events(upstream: Any, **kw: Any) -> list[Any]:
    stream = await _openai(upstream).responses.create(model="m", input="hi", stream=True, **kw)
    return [event async for event in stream]


def test_the_official_client_reads_a_stream():
    events = asyncio.run(_events(Scripted([Piece(["Hel"], ["None"], 3, [1], False),
                                           Piece(["lo"], ["stop"], 3, [1], True)])))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    done = events[-1].response
    assert done.status == "completed" and done.output_text == "Hello"
    assert done.usage.output_tokens == 2 and events[0].response.status == "in_progress"
    added = events[2]
    assert added.item.id == events[4].item_id == done.output[0].id


def _parsed(deltas: list[dict[str, Any]], final: bool, reason: str = "None") -> Piece:
    return Piece(["x"], [reason], 3, [1], final, messages=[json.dumps(deltas)])


def test_streamed_reasoning_and_a_function_call_become_their_items():
    pieces = [_parsed([{"reasoning": "Paris", "reasoning_content": "Paris"}], False),
              _parsed([{"reasoning": "?"}], False),
              _parsed([{"tool_calls": [CALL]}], False),
              _parsed([{"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                       {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}], True, "tool_calls")]
    events = asyncio.run(_events(Scripted(pieces), tools=[WEATHER]))
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning", "function_call"]
    assert done.output[0].content[0].text == "Paris?"
    call = done.output[1]
    assert (call.call_id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Paris"}')
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert done.tools[0].name == "get_weather"


def test_a_whole_parsed_answer_becomes_its_items():
    message = {"role": "assistant", "reasoning": "think", "content": "",
               "tool_calls": [{"id": "call_9", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}

    async def run() -> Any:
        return await _openai(Scripted([_parsed([message], True, "tool_calls")])).responses.create(
            model="m", input="hi", tools=[WEATHER], tool_choice="required")

    resp = asyncio.run(run())
    assert [item.type for item in resp.output] == ["reasoning", "function_call"]
    assert resp.output[1].call_id == "call_9" and resp.output[1].arguments == '{"city": "Oslo"}'
    assert resp.status == "completed"


def test_an_upstream_refusal_keeps_its_status_when_streamed():
    async def run() -> int:
        try:
            await _events(Fake(fail="temperature must be non-negative"))
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    assert asyncio.run(run()) == 400


class FailsMidway(Fake):
    """An upstream whose engine fails after the first piece."""

    async def generate(self, req: BackendRequest) -> AsyncIterator[Piece]:
        self.seen.append(req)
        yield Piece(["Hel"], ["None"], 3, [1], False)
        raise ApiError(503, "the model's engine stopped", "service_unavailable_error", None, "engine_dead")


def test_an_upstream_failure_midway_ends_the_stream_with_an_error_event():
    events = asyncio.run(_events(FailsMidway()))
    assert [e.type for e in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1].code == "engine_dead" and "engine stopped" in events[-1].message


def test_requests_are_counted_as_chats_are():
    metrics = GatewayMetrics(["m"])

    async def run() -> None:
        client_ = _openai(Fake(), metrics)
        await client_.responses.create(model="m", input="hi")
        [e async for e in await client_.responses.create(model="m", input="hi", stream=True)]
        with pytest.raises(openai.BadRequestError):
            await client_.responses.create(model="m", input="hi", temperature=-1)

    asyncio.run(run())
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    total = "llmhost_gateway_requests_total"
    assert got[(total, (("key", "alice"), ("model", "m"), ("status", "200")))] == 2
    assert got[(total, (("key", "alice"), ("model", "m"), ("status", "400")))] == 1
    assert got[("llmhost_gateway_output_tokens_total", (("key", "alice"), ("model", "m")))] == 8
    assert got[("llmhost_gateway_time_to_first_token_seconds_count", (("model", "m"),))] == 1


def test_a_translation_error_is_an_api_error():
    with pytest.raises(ApiError) as err:
        _mapped(input=[{"type": "function_call_output", "call_id": "x", "output": "y"}])
    assert err.value.status == 400


def test_fuzzed_bodies_get_an_answer_or_a_clear_error():
    """Generated bodies (tests/harness/fuzz.py's, which the e2e fuzz sends to the real
    gateway): a response, or a 400/404 naming no server internals; never a 500."""
    app = make_app(Fake(), config=None)
    seen = {"ok": 0, "error": 0}

    async def post(sent: bytes) -> httpx.Response:
        async with client(app) as c:
            return await c.post("/v1/responses", content=sent)

    @settings(FUZZ, max_examples=400)
    @given(body=responses_bodies("m"))
    def one(body: Any) -> None:
        sent = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = asyncio.run(post(sent))
        seen[check_responses_answer(r.status_code, r.text, sent_text(sent, body))] += 1

    one()
    assert seen["ok"] > 20 and seen["error"] > 20, seen
