"""Tool calls and reasoning: the gateway's mapping of tools, tool_choice and tool turns,
the backend's checks of them, vLLM's parsers on the tiny model's tokenizer
(llmhost.backend.replies), and the gateway's chunks and bodies built from the
parsed messages."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from llmhost.backend.coalesce import merge
from llmhost.backend.config import ConfigError, parse_model_config
from llmhost.backend.engine import Chunk
from llmhost.backend.errors import RequestError
from llmhost.backend.outputs import response_outputs
from llmhost.backend.request import parse_messages, parse_tools
from llmhost.gateway.doors.openai.completion_bodies import Accumulator, completion_body, stream_chunks
from llmhost.gateway.doors.openai.mapping import parse_body, to_backend
from llmhost.gateway.errors import ApiError
from llmhost.gateway.upstreams.client import Piece, socket_piece
from llmhost.gateway.upstreams.request import BackendRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"unit": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"unit\": \"c\"}"}}


def _chat(**kw: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def _map(raw: bytes) -> BackendRequest:
    return to_backend(parse_body(raw, True))


# --- the gateway's mapping ---------------------------------------------------

def test_tools_and_tool_choice_reach_the_backend():
    req = _map(_chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                     parallel_tool_calls=False))
    assert req.sampling == {"tools": [WEATHER], "parallel_tool_calls": False,
                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    assert _map(_chat(tools=[WEATHER], tool_choice="required")).sampling["tool_choice"] == "required"
    assert "tool_choice" not in _map(_chat(tools=[WEATHER])).sampling


def test_tool_turns_reach_the_backend():
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    req = _map(json.dumps({"model": "m", "messages": messages, "tools": [WEATHER]}).encode())
    assert req.messages == [messages[0], {"role": "assistant", "content": "", "tool_calls": [CALL]}, messages[2]]


@pytest.mark.parametrize(("body", "param"), [
    (_chat(tool_choice="sometimes", tools=[WEATHER]), "tool_choice"),
    (_chat(tool_choice={"type": "function", "function": {"name": "elsewhere"}}, tools=[WEATHER]),
     "tool_choice.function.name"),
    (_chat(tool_choice={"type": "function"}, tools=[WEATHER]), "tool_choice.function"),
    (_chat(tool_choice="required"), "tool_choice"),
    (_chat(tools=[]), "tools"),
    (_chat(tools=[{"type": "function", "function": {"description": "x"}}]), "tools[0].function.name"),
    (_chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type"),
    (_chat(functions=[{"name": "f"}]), "functions"),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": None}]}).encode(), "messages[0].content"),
    (json.dumps({"model": "m", "messages": [{"role": "tool", "content": "x", "tool_calls": [CALL]}]}).encode(),
     "messages[0].tool_calls"),
])
def test_bad_tool_fields_name_the_field(body, param):
    with pytest.raises(ApiError) as info:
        _map(body)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert param.split("[")[0].split(".")[0] in info.value.message


# --- the backend's checks ------------------------------------------------------

def test_backend_takes_tools_out_of_the_parameters():
    params = {"tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": True, "temperature": 0}
    assert parse_tools(params) == ([WEATHER], "auto", True)
    assert params == {"temperature": 0}


@pytest.mark.parametrize(("params", "words"), [
    ({"tools": []}, "'tools'"),
    ({"tools": [{"type": "function", "function": {}}]}, "'tools[0]'"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "maybe"}, "'tool_choice'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "'tool_choice.function.name'"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "'parallel_tool_calls'"),
])
def test_backend_refuses_bad_tool_fields(params, words):
    with pytest.raises(RequestError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_tools(params)


def test_backend_messages_take_tool_turns():
    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "r"}]
    assert parse_messages(json.dumps(turn)) == turn
    with pytest.raises(RequestError, match=r"messages\[0\].tool_calls"):
        parse_messages(json.dumps([{"role": "user", "content": "q", "tool_calls": [CALL]}]))
    with pytest.raises(RequestError, match=r"messages\[1\].content"):
        parse_messages(json.dumps([turn[0], {"role": "assistant", "content": None}]))


def test_tool_parser_setting_is_a_name():
    assert parse_model_config({"model": "m", "llmhost": {"tool_parser": "hermes"}}).settings.tool_parser == "hermes"
    with pytest.raises(ConfigError, match="tool_parser"):
        parse_model_config({"model": "m", "llmhost": {"tool_parser": "a b"}})


# --- vLLM's parsers on the tiny model's tokenizer ---------------------------

@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(tiny_model))


def _job(**kw: Any) -> Any:
    from llmhost.backend.request import GenerateJob

    base: dict[str, Any] = {"prompt": None, "messages": [{"role": "user", "content": "weather?"}], "stream": False,
                            "exclude_input": True, "sampling": {"n": 1}}
    return GenerateJob(**{**base, **kw})


def test_named_tool_choice_is_constrained_and_parsed_as_vllms_server_does(tokenizer):
    from llmhost.backend.replies import ChatParsing

    parsing = ChatParsing(tokenizer, None, "hermes", "")
    replies = parsing.replies(_job(tools=[WEATHER], tool_choice={"type": "function",
                                                                 "function": {"name": "get_weather"}}), 1)
    assert replies is not None
    changes = replies.adjust([1, 2, 3])
    assert changes["structured_outputs"] is not None  # the tools' schema or the parser's structural tag
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>'
    plain = '{"unit": "c"}'
    message, reason = replies.message(0, text if "structural_tag" in repr(changes) else plain, [], "stop")
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"unit": "c"}'}
    assert message["tool_calls"][0]["id"] and message["tool_calls"][0]["type"] == "function"
    assert reason == "stop"  # a named function: "stop", as vLLM's server says


def test_auto_tool_calls_stream_as_deltas(tokenizer):
    from llmhost.backend.replies import ChatParsing

    replies = ChatParsing(tokenizer, None, "hermes", "").replies(_job(tools=[WEATHER], stream=True), 1)
    assert replies is not None
    replies.adjust([1, 2, 3])
    text = 'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>'
    deltas = []
    for at in range(0, len(text), 7):
        piece = text[at:at + 7]
        delta = replies.delta(0, piece, [5], at + 7 >= len(text))
        if delta is not None:
            deltas.append(delta)
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert content.strip() == "Let me see."
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads("".join(tc["function"].get("arguments") or "" for tc in calls)) == {"unit": "c"}
    assert replies.stream_finish(0, "stop") == "tool_calls"


def test_tools_without_a_tool_parser(tokenizer):
    from llmhost.backend.replies import ChatParsing

    parsing = ChatParsing(tokenizer, None, "", "")
    # tool_choice "none": the tools only reach the template; the output stays plain text.
    assert parsing.replies(_job(tools=[WEATHER], tool_choice="none"), 1) is None
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(RequestError, match=r"'tool_choice'.*tool_parser"):
            parsing.replies(_job(tools=[WEATHER], tool_choice=choice), 1)
    with pytest.raises(RequestError, match="'tool_choice'"):
        parsing.replies(_job(tools=[WEATHER]), 1)  # tools alone mean auto, as vLLM's server reads them


def test_an_unknown_parser_fails_the_load(tokenizer):
    from llmhost.backend.replies import ChatParsing

    with pytest.raises(ValueError, match="tool_parser"):
        ChatParsing(tokenizer, None, "no-such-parser", "")


def test_tool_turns_render_through_the_tiny_models_template(tokenizer):
    from llmhost.backend.prompts import template_messages

    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = tokenizer.apply_chat_template(template_messages(turn), tools=[WEATHER], tokenize=False,
                                         add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and '"name": "get_weather"' in text
    assert turn[1]["tool_calls"][0]["function"]["arguments"] == '{"unit": "c"}'  # the job's own copy is kept
    plain = [{"role": "user", "content": "q"}]
    assert tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"


# --- the backend's output and the gateway's answer ------------------------------

def test_parsed_messages_travel_as_the_message_output():
    a = Chunk(["x"], [""], 3, [1], final=False, messages=[[{"content": "x"}]])
    b = Chunk(["y"], ["stop"], 3, [1], final=True, messages=[[{"tool_calls": []}, {"content": "y"}]])
    merged = merge(a, b)
    assert merged.messages == [[{"content": "x"}, {"tool_calls": []}, {"content": "y"}]]
    outputs = response_outputs(merged, frozenset(), counted=False)
    assert json.loads(outputs["message"][0]) == merged.messages[0]
    assert "message" not in response_outputs(Chunk(["x"], [""], 3, [1], final=False), frozenset(), counted=False)
    assert socket_piece(outputs, True).messages == outputs["message"]


def _req(stream: bool) -> BackendRequest:
    return BackendRequest(model="m", text_input=None, messages=[{"role": "user", "content": "q"}], sampling={},
                          stream=stream, n=1, include_usage=False, chat=True)


def test_a_parsed_message_is_the_answers_message():
    acc = Accumulator(1)
    message = {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                                    "function": {"name": "f", "arguments": "{}"}}]}
    acc.add(Piece(["{}"], ["tool_calls"], 3, [2], True, messages=[json.dumps([message])]))
    body = completion_body(_req(False), acc, "id", 0)
    assert body["choices"][0]["message"] == message
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_deltas_become_one_chunk_each():
    call = {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}
    pieces = [Piece(["<tool"], [], 3, [1], False, messages=[json.dumps([])]),
              Piece(["..."], ["tool_calls"], None, [2], True,
                    messages=[json.dumps([{"tool_calls": [call]},
                                          {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}])])]

    async def rest() -> Any:
        for piece in pieces[1:]:
            yield piece

    async def run() -> list[bytes]:
        return [e async for e in stream_chunks(_req(True), pieces[0], rest(), "id")]

    events = asyncio.run(run())
    chunks = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks]
    assert deltas == [({"role": "assistant", "content": ""}, None), ({"tool_calls": [call]}, None),
                      ({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, "tool_calls")]
    assert events[-1] == b"data: [DONE]\n\n"


# --- reasoning ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm.tokenizers import get_tokenizer

    from llmhost.tiny.model import write_tiny_model

    return get_tokenizer(str(write_tiny_model(tmp_path_factory.mktemp("thinker"), think=True)))


def test_reasoning_is_split_from_the_answer_as_vllms_server_does(thinker):
    from llmhost.backend.replies import ChatParsing

    parsing = ChatParsing(thinker, None, "", "deepseek_r1")
    replies = parsing.replies(_job(), 1)  # a chat without tools: the reasoning parser still reads it
    assert replies is not None
    replies.adjust([1, 2])
    ids = thinker.encode("<think>why</think>because", add_special_tokens=False)
    message, reason = replies.message(0, "<think>why</think>because", ids, "stop")
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == ("why", "why", "because")
    assert reason == "stop" and "tool_calls" not in message

    streamed = parsing.replies(_job(stream=True), 1)
    assert streamed is not None
    streamed.adjust([1, 2])
    deltas = [streamed.delta(0, thinker.decode([t]), [t], i == len(ids) - 1) for i, t in enumerate(ids)]
    said = [d for d in deltas if d is not None]
    assert "".join(d.get("reasoning") or "" for d in said) == "why"
    assert "".join(d.get("content") or "" for d in said) == "because"
    assert all(d.get("reasoning_content") == d.get("reasoning") for d in said)


def test_a_model_without_parsers_answers_plain_text(tokenizer):
    from llmhost.backend.replies import ChatParsing

    parsing = ChatParsing(tokenizer, None, "", "")
    assert parsing.parser_cls is None and parsing.replies(_job(), 1) is None
    assert parsing.replies(_job(messages=None, prompt="x"), 1) is None
