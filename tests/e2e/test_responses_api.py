"""POST /v1/responses through the gateway with the official `openai` client
(`client.responses.create`), against the e2e tritonserver + vLLM on the tiny model
(tool_parser hermes) and vLLM's own server on the same model (`vllm_tiny`): the same
text as the equivalent chat and as `vllm serve`'s own /v1/responses at temperature 0,
streamed events as the client parses them, function tools in and function_call items
out, and the field named in every refusal."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.harness.gateway import openai_client
from tests.harness.net import CLIENT_TIMEOUT_S
from tests.harness.openai_checks import WEATHER, Target, a_one_tool_agent_of_the_agents_sdk
from tests.harness.vllm_server import VllmServer

INSTRUCTIONS = "Complete the code."
PROMPT = "def fibonacci(n):"
# The Responses API's function tool: chat's function, flattened.
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def ours(server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with openai_client(server, tmp_path_factory.mktemp("responses-gateway")) as client:
        yield client


def _kw(server: Any, **more: Any) -> dict[str, Any]:
    return {"model": server.name, "input": PROMPT, "instructions": INSTRUCTIONS, "temperature": 0,
            "max_output_tokens": 12, **more}


def test_an_answer_is_the_same_chats_answer(ours, server):
    resp = ours.responses.create(**_kw(server))
    chat = ours.chat.completions.create(model=server.name, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": PROMPT}])
    assert resp.output_text == chat.choices[0].message.content
    assert resp.output_text, resp
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    finished = {"length": "incomplete", "stop": "completed"}[chat.choices[0].finish_reason]
    assert resp.status == finished and resp.instructions == INSTRUCTIONS and resp.model == server.name


def test_an_answer_matches_vllm_serve(ours, server, vllm_tiny: VllmServer):
    theirs = openai.OpenAI(base_url=vllm_tiny.url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    mine, vllms = ours.responses.create(**_kw(server)), theirs.responses.create(**_kw(server))
    assert mine.output_text == vllms.output_text
    assert (mine.usage.input_tokens, mine.usage.output_tokens) == (vllms.usage.input_tokens,
                                                                   vllms.usage.output_tokens)
    assert mine.status == vllms.status
    assert [item.type for item in mine.output] == [item.type for item in vllms.output]


def _events(client: openai.OpenAI, **kw: Any) -> list[Any]:
    return list(client.responses.create(stream=True, **kw))


def test_a_stream_says_the_same_as_the_answer(ours, server):
    events = _events(ours, **_kw(server))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          events[-1].type]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    whole = ours.responses.create(**_kw(server))
    assert streamed == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_function_call_and_its_result(ours, server):
    kw = _kw(server, input="What is the weather in Paris?", tools=[WEATHER_TOOL], max_output_tokens=64,
             tool_choice={"type": "function", "name": "get_weather"})
    resp = ours.responses.create(**kw)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1, resp.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id
    assert set(json.loads(call.arguments)) == {"unit"}
    # The next turn: the call goes back with its result, as an agent loop sends it.
    turn = [{"role": "user", "content": "What is the weather in Paris?"}, *resp.output,
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 degrees"}]
    follow = ours.responses.create(**{**kw, "input": turn, "tool_choice": "none", "max_output_tokens": 8})
    assert [item.type for item in follow.output] == ["message"]
    assert follow.usage.input_tokens > resp.usage.input_tokens


def test_a_streamed_function_call(ours, server):
    events = _events(ours, **_kw(server, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                 tool_choice="required", parallel_tool_calls=False, max_output_tokens=64))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = events[-1].response
    calls = [item for item in done.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_weather"], done.output
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == calls[0].arguments
    assert set(json.loads(deltas)) == {"unit"}


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
], ids=["previous-response", "item-reference", "hosted-tool", "zero-tokens", "temperature"])
def test_bad_fields_get_400_naming_the_field(ours, server, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        ours.responses.create(**{**_kw(server), **extra})
    assert err.value.body["param"] == param, err.value.body


def test_a_wrong_key_is_401(ours, server):
    wrong = ours.with_options(api_key="not-a-key-0123456789")
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.create(**_kw(server))


def test_a_one_tool_agent_of_the_agents_sdk(ours, server):
    """The check `make demo-check` and the booted host run too (tests/harness/openai_checks.py)."""
    print(a_one_tool_agent_of_the_agents_sdk(Target(ours, server.name, server.http)))
