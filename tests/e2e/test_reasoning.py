"""A reasoning model's thinking through the gateway, with the official `openai` client,
against vLLM's own server (`--reasoning-parser deepseek_r1`) on the same tiny model
(its tokenizer with <think> and </think>): at temperature 0 the same reasoning and
content, as `reasoning` (and `reasoning_content`) in the message and in the streamed
deltas. The model's reasoning parser is vLLM's own engine argument."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.harness.gateway import openai_client
from tests.harness.net import CLIENT_TIMEOUT_S
from tests.harness.server import Server, start_server, wait_gone
from tests.harness.vllm_server import ENGINE_ARGS, vllm_server

PARSER = "deepseek_r1"
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmhost.tiny.model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-thinker"), seed=0, think=True)


@pytest.fixture(scope="module")
def served(thinker: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(thinker, tmp_path_factory.mktemp("serve-thinker"), name="thinker",
                       extra=["--engine-arg", f"reasoning_parser={PARSER}"])
    yield srv
    kids = srv.descendants()
    srv.stop()
    assert not wait_gone(kids)


@pytest.fixture(scope="module")
def ours(served: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with openai_client(served, tmp_path_factory.mktemp("thinker-gateway")) as client:
        yield client


@pytest.fixture(scope="module")
def theirs(thinker: Path, ours: openai.OpenAI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with vllm_server(thinker, tmp_path_factory.mktemp("vllm-thinker"), "thinker",
                     [*ENGINE_ARGS, "--reasoning-parser", PARSER]) as vllm:
        yield openai.OpenAI(base_url=vllm.url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)


KW: dict[str, Any] = {"model": "thinker", "messages": MESSAGES, "temperature": 0, "max_tokens": 16}


def _said(message: Any) -> tuple[str | None, str | None]:
    extra = message.model_extra or {}
    return extra.get("reasoning"), message.content


def test_reasoning_matches_vllm_serve(ours, theirs):
    mine, vllms = ours.chat.completions.create(**KW), theirs.chat.completions.create(**KW)
    assert _said(mine.choices[0].message) == _said(vllms.choices[0].message)
    reasoning, _ = _said(mine.choices[0].message)
    assert reasoning, mine
    assert (mine.choices[0].message.model_extra or {})["reasoning_content"] == reasoning
    assert mine.choices[0].finish_reason == vllms.choices[0].finish_reason
    assert mine.usage.completion_tokens == vllms.usage.completion_tokens


def _streamed(client: openai.OpenAI) -> tuple[str, str, set[str]]:
    reasoning, content, keys = "", "", set()
    for chunk in client.chat.completions.create(stream=True, **KW):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            keys |= set(extra)
            reasoning += extra.get("reasoning") or ""
            content += choice.delta.content or ""
    return reasoning, content, keys


def test_streamed_reasoning_matches_vllm_serve(ours, theirs):
    (reasoning, content, keys), (vllm_reasoning, vllm_content, _) = _streamed(ours), _streamed(theirs)
    assert (reasoning, content) == (vllm_reasoning, vllm_content)
    assert reasoning and "reasoning_content" in keys
    whole = ours.chat.completions.create(**KW).choices[0].message
    assert _said(whole) == (reasoning, content or None)


TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("choice", ["required", "auto", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "auto", "named"])
def test_tools_on_a_model_without_a_tool_parser_are_400(ours, theirs, choice):
    """This model has no tool_parser: as vLLM's server without --tool-call-parser, only
    tool_choice "none" is served (the tools reach the template)."""
    with pytest.raises(openai.BadRequestError):
        theirs.chat.completions.create(**KW, tools=TOOLS, tool_choice=choice)
    with pytest.raises(openai.BadRequestError) as err:
        ours.chat.completions.create(**KW, tools=TOOLS, tool_choice=choice)
    assert "'tool_choice'" in err.value.body["message"] and "tool_parser" in err.value.body["message"]
    answer = ours.chat.completions.create(**KW, tools=TOOLS, tool_choice="none")
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason


SWITCHES = [{"include_reasoning": False}, {"reasoning_effort": "low"}, {"reasoning_effort": "none"},
            {"chat_template_kwargs": {"enable_thinking": False, "not_in_the_template": 1}}]


@pytest.mark.parametrize("extra", SWITCHES, ids=["include_reasoning", "effort-low", "effort-none", "template-kwargs"])
def test_reasoning_switches_match_vllm_serve(ours, theirs, extra):
    mine = ours.chat.completions.create(**KW, extra_body=extra)
    vllms = theirs.chat.completions.create(**KW, extra_body=extra)
    assert _said(mine.choices[0].message) == _said(vllms.choices[0].message)
    assert (mine.usage.prompt_tokens, mine.usage.completion_tokens) == (vllms.usage.prompt_tokens,
                                                                         vllms.usage.completion_tokens)
    if extra.get("include_reasoning") is False:
        reasoning, _ = _said(mine.choices[0].message)
        assert reasoning is None and "reasoning_content" not in (mine.choices[0].message.model_extra or {})
        assert _said(ours.chat.completions.create(**KW).choices[0].message)[0]  # it does think


def test_streamed_without_reasoning_matches_vllm_serve(ours, theirs):
    def streamed(client: openai.OpenAI) -> tuple[str, str]:
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(stream=True, extra_body={"include_reasoning": False}, **KW):
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
                content += choice.delta.content or ""
        return reasoning, content

    mine = streamed(ours)
    assert mine == streamed(theirs) and mine[0] == ""


def test_hidden_thinking_sends_no_log_probabilities_as_vllm_serve(ours, theirs):
    """Log probabilities would show the thinking's tokens: with include_reasoning false
    vLLM's server sends none (whole or streamed), and neither does the gateway."""
    kw = {**KW, "logprobs": True, "top_logprobs": 2}
    shown = ours.chat.completions.create(**kw)
    assert shown.choices[0].logprobs.content, shown  # asked for and sent while the thinking is shown
    hide = {"include_reasoning": False}
    mine, vllms = (c.chat.completions.create(**kw, extra_body=hide) for c in (ours, theirs))
    assert vllms.choices[0].logprobs is None and mine.choices[0].logprobs is None, mine
    assert mine.choices[0].message.content == vllms.choices[0].message.content

    def streamed(client: openai.OpenAI) -> tuple[str, list[Any]]:
        content, sent = "", []
        for chunk in client.chat.completions.create(stream=True, **kw, extra_body=hide):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                sent += [choice.logprobs] if choice.logprobs is not None else []
        return content, sent

    assert streamed(ours) == streamed(theirs) == (vllms.choices[0].message.content or "", [])


@pytest.mark.parametrize(("extra", "needle"), [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"include_reasoning": "no"}, "include_reasoning"),
])
def test_bad_reasoning_switches_are_400_naming_them(ours, extra, needle):
    with pytest.raises(openai.BadRequestError) as err:
        ours.chat.completions.create(**KW, extra_body=extra)
    assert needle in err.value.body["message"], err.value.body


def test_the_responses_api_gives_the_thinking_as_a_reasoning_item(ours):
    reasoning, content = _said(ours.chat.completions.create(**KW).choices[0].message)
    kw = {"model": "thinker", "input": MESSAGES[0]["content"], "temperature": 0, "max_output_tokens": 16}
    resp = ours.responses.create(**kw)
    assert reasoning and resp.output[0].type == "reasoning", resp.output
    assert resp.output[0].content[0].text == reasoning
    assert resp.output_text == (content or "")
    events = list(ours.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (content or "")
