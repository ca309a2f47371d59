"""Tool calling through the gateway, with the official `openai` client, against vLLM's
own server (`vllm serve --enable-auto-tool-choice --tool-call-parser hermes`) on the
same tiny model (tests/e2e/conftest.py's vllm_tiny): the e2e server's model has
tool_parser hermes.
The model is random, so the calls are forced (a named function, or "required"), where
vLLM constrains the output to the tools' schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.harness.gateway import openai_client
from tests.harness.net import CLIENT_TIMEOUT_S
from tests.harness.openai_checks import TIME, WEATHER
from tests.harness.vllm_server import VllmServer

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def theirs(vllm_tiny: VllmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_tiny.url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)


@pytest.fixture(scope="module")
def ours(server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with openai_client(server, tmp_path_factory.mktemp("tools-gateway")) as client:
        yield client


def _kw(server: Any, **more: Any) -> dict[str, Any]:
    return {"model": server.name, "messages": MESSAGES, "tools": [WEATHER, TIME], "temperature": 0,
            "max_tokens": 64, **more}


def _calls(message: Any) -> list[tuple[str, str]]:
    return [(c.type, c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[dict[int, dict[str, Any]], str | None, str]:
    """The streamed tool calls (merged by index as clients do), finish reason and content."""
    calls: dict[int, dict[str, Any]] = {}
    reason, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                one = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                one["id"] = one["id"] or tc.id
                if tc.function is not None:
                    one["name"] += tc.function.name or ""
                    one["arguments"] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    return calls, reason, content


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"],
                         ids=["named", "required"])
def test_forced_tool_call_matches_vllm_serve(ours, theirs, server, choice):
    mine = ours.chat.completions.create(**_kw(server, tool_choice=choice))
    vllms = theirs.chat.completions.create(**_kw(server, tool_choice=choice))
    assert _calls(mine.choices[0].message) == _calls(vllms.choices[0].message)
    assert mine.choices[0].message.tool_calls, mine
    call = mine.choices[0].message.tool_calls[0]
    assert call.id and call.function.name in ("get_weather", "get_time")
    json.loads(call.function.arguments)
    assert mine.choices[0].finish_reason == vllms.choices[0].finish_reason
    assert (mine.choices[0].message.content or "") == (vllms.choices[0].message.content or "")


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"],
                         ids=["named", "required"])
def test_streamed_tool_call_deltas_match_vllm_serve(ours, theirs, server, choice):
    (mine, reason, content), (vllms, vllm_reason, vllm_content) = (
        _streamed(c, **_kw(server, tool_choice=choice)) for c in (ours, theirs))
    assert [(c["name"], c["arguments"]) for c in mine.values()] == [(c["name"], c["arguments"]) for c in vllms.values()]
    assert mine and all(c["id"] for c in mine.values())
    assert (reason, content) == (vllm_reason, vllm_content)


def test_tool_result_turn_goes_through_the_template(ours, theirs, server):
    first = ours.chat.completions.create(**_kw(server, tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}}))
    call = first.choices[0].message.tool_calls[0]
    turn = [*MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    kw = _kw(server, messages=turn, tool_choice="none", max_tokens=8, logprobs=True)
    mine, vllms = ours.chat.completions.create(**kw), theirs.chat.completions.create(**kw)
    assert mine.choices[0].message.content == vllms.choices[0].message.content
    assert mine.usage.prompt_tokens == vllms.usage.prompt_tokens
    assert not mine.choices[0].message.tool_calls


def test_auto_and_parallel_tool_calls_are_answered(ours, theirs, server):
    kw = _kw(server, tool_choice="auto", parallel_tool_calls=False, max_tokens=8)
    mine, vllms = ours.chat.completions.create(**kw), theirs.chat.completions.create(**kw)
    assert mine.choices[0].message.content == vllms.choices[0].message.content
    assert mine.choices[0].finish_reason == vllms.choices[0].finish_reason
    kw = _kw(server, tool_choice="required", parallel_tool_calls=False)
    mine = ours.chat.completions.create(**kw)
    assert len(mine.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice.function.name"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": [], "tool_choice": "auto"}, "tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
], ids=["unknown-choice", "unknown-name", "no-function", "empty-tools", "choice-without-tools", "nameless-tool"])
def test_bad_tool_fields_get_400_naming_the_field(ours, server, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        ours.chat.completions.create(**{**_kw(server), **extra})
    assert err.value.body["param"] == param, err.value.body
    assert param.split(".")[0].split("[")[0] in err.value.body["message"]
