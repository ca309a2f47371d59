"""The OpenAI API as applications use it, checked with the official `openai` client and
a one-tool agent of OpenAI's Agents SDK against a running gateway: the booted host's
(tests/system/test_gateway_on_host.py) and `make demo`'s (`make demo-check`, which runs
this module).

The models are random (inventory/demo.yml): token counts are held with ignore_eos, and
tool calls are forced (by name, or "required" with one call), where vLLM holds the
output to the tools' schema. Each check raises AssertionError with what it got.

    python -m tests.harness.openai_checks --base-url URL --key-file FILE \\
        --triton-url URL --model tiny [--embed-model embed]
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

PROMPT = "def fibonacci(n):"
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
# Small strict tools (their arguments held to their schemas): one of two words, or none.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "strict": True,
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
EXACT: dict[str, Any] = {"ignore_eos": True}


@dataclass(frozen=True)
class Target:
    """A gateway to check: the client, the chat model, Triton's own HTTP door (for a
    token id by its log probability) and the embedding model, if one is served."""

    client: Any  # openai.OpenAI
    model: str
    triton_url: str
    embed_model: str = ""


def _chat(text: str = PROMPT) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def logprobs_chat_streamed_and_completions(t: Target) -> str:
    chat = t.client.chat.completions.create(model=t.model, messages=_chat(), max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=2, extra_body=EXACT)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4, chat
    assert all(x.logprob <= 0 and len(x.top_logprobs) == 2 for x in content), content
    assert "".join(x.token for x in content) == chat.choices[0].message.content
    streamed = []
    for chunk in t.client.chat.completions.create(model=t.model, messages=_chat(), max_tokens=4, temperature=0,
                                                  logprobs=True, top_logprobs=2, stream=True, extra_body=EXACT):
        for choice in chunk.choices:
            streamed += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    assert [x.token for x in streamed] == [x.token for x in content], (streamed, content)
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-3) for a, b in zip(streamed, content, strict=True))
    done = t.client.completions.create(model=t.model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                       extra_body=EXACT)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4, lp
    assert "".join(lp.tokens) == done.choices[0].text and all(v <= 0 for v in lp.token_logprobs)
    return f"chat {len(content)} tokens (streamed the same), completions {len(lp.tokens)} tokens"


def _calls_ok(calls: Any) -> None:
    assert calls, calls
    for c in calls:
        assert c.id and c.type == "function" and c.function.name in ("get_weather", "get_time"), c
        args = json.loads(c.function.arguments)
        if c.function.name == "get_weather":
            assert args["unit"] in ("celsius", "fahrenheit"), args


def named_and_required_tool_calls_and_a_tool_result_turn(t: Target) -> str:
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = t.client.chat.completions.create(model=t.model, messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                             tool_choice=named, temperature=0, max_tokens=64)
    calls = first.choices[0].message.tool_calls
    _calls_ok(calls)
    assert all(c.function.name == "get_weather" for c in calls), calls
    # "required" with one call: a random model left free to add calls fills its tokens with them.
    required = t.client.chat.completions.create(model=t.model, messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                                tool_choice="required", parallel_tool_calls=False,
                                                temperature=0, max_tokens=64)
    _calls_ok(required.choices[0].message.tool_calls)
    assert len(required.choices[0].message.tool_calls) == 1, required
    assert required.choices[0].finish_reason == "tool_calls", required
    # The tool's result, back through the model's chat template.
    turn = [*ASK_WEATHER,
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": c.id, "type": "function",
                             "function": {"name": c.function.name, "arguments": c.function.arguments}}
                            for c in calls]},
            *({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 degrees"} for c in calls)]
    answer = t.client.chat.completions.create(model=t.model, messages=turn, tools=[WEATHER, TIME],
                                              tool_choice="none", temperature=0, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length"), answer
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the calls and results were in the prompt
    one = required.choices[0].message.tool_calls[0].function
    return (f"named: {calls[0].function.name}({calls[0].function.arguments}); required: {one.name}"
            f"({one.arguments}); tool-result turn: {answer.usage.prompt_tokens} prompt tokens")


def json_object_and_structured_choice(t: Target) -> str:
    obj = t.client.chat.completions.create(model=t.model, messages=_chat("a JSON object, please"), max_tokens=64,
                                           temperature=0, response_format={"type": "json_object"})
    text = obj.choices[0].message.content
    assert text.lstrip().startswith("{"), obj
    if obj.choices[0].finish_reason == "stop":  # a random model may run out of tokens inside it
        assert isinstance(json.loads(text), dict), text
    choice = t.client.chat.completions.create(model=t.model, messages=_chat("yes or no?"), max_tokens=8,
                                              extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no"), choice
    return f"json_object {text[:40]!r} ({obj.choices[0].finish_reason}); choice {choice.choices[0].message.content!r}"


def token_id_prompts_and_echo(t: Target) -> str:
    ids = t.client.completions.create(model=t.model, prompt=[11, 12, 13, 14], max_tokens=3, temperature=0,
                                      extra_body=EXACT)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 3, ids
    two = t.client.completions.create(model=t.model, prompt=[[11, 12, 13, 14], [21, 22]], max_tokens=3,
                                      temperature=0, extra_body=EXACT)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == ids.choices[0].text, two
    echo = t.client.completions.create(model=t.model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                       extra_body=EXACT)
    plain = t.client.completions.create(model=t.model, prompt=PROMPT, max_tokens=3, temperature=0, extra_body=EXACT)
    assert echo.choices[0].text == PROMPT + plain.choices[0].text, (echo, plain)
    return f"ids -> {ids.choices[0].text!r}; two prompts -> 2 choices; echo -> {echo.choices[0].text!r}"


def n_streamed_and_a_fixed_seed(t: Target) -> str:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in t.client.chat.completions.create(model=t.model, messages=_chat(), max_tokens=4, n=2,
                                                  temperature=1.0, stream=True, extra_body=EXACT):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert set(texts) == {0, 1} and all(texts.values()) and reasons == {0: "length", 1: "length"}, (texts, reasons)

    def seeded(seed: int) -> str:
        return str(t.client.completions.create(model=t.model, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                               seed=seed, extra_body=EXACT).choices[0].text)

    first = seeded(1234)
    assert first and seeded(1234) == first, first
    return f"n=2 streamed: {sorted(texts.values())!r}; seed 1234 twice: {first!r}"


def stop_token_ids_and_max_completion_tokens(t: Target) -> str:
    # The first token the model picks at temperature 0, by id (Triton's own door, with
    # log probabilities keyed by token id), as a stop token.
    r = requests.post(f"{t.triton_url}/v2/models/{t.model}/generate", timeout=120,
                      json={"text_input": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 0,
                            "return_logprobs": True, "exclude_input_in_output": True})
    assert r.status_code == 200, r.text
    first = [int(token) for position in json.loads(r.json()["logprobs"]) for token in position]
    assert len(first) == 1, r.text
    stopped = t.client.completions.create(model=t.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                          extra_body={"stop_token_ids": first})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == "", stopped
    capped = t.client.chat.completions.create(model=t.model, messages=_chat(), max_completion_tokens=3,
                                              extra_body=EXACT)
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length", capped
    return f"stop_token_ids {first} -> stop, ''; max_completion_tokens 3 -> 3 tokens, length"


def embeddings_of_two_inputs(t: Target) -> str:
    inputs = [PROMPT, "hello world"]
    floats = t.client.embeddings.create(model=t.embed_model, input=inputs, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1], floats
    a, b = (d.embedding for d in floats.data)
    assert len(a) == len(b) > 0 and a != b and all(math.isfinite(v) for v in a + b), (len(a), len(b))
    assert floats.usage.prompt_tokens > 0, floats
    # base64: the same floats, as little-endian float32 (the raw reply: the client would decode it).
    raw = t.client.embeddings.with_raw_response.create(model=t.embed_model, input=inputs, encoding_format="base64")
    packed = json.loads(raw.text)["data"]
    decoded = [struct.unpack(f"<{len(a)}f", base64.b64decode(d["embedding"])) for d in packed]
    assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(decoded[0], a, strict=True)), decoded[0][:4]
    return f"{len(floats.data)} embeddings of {len(a)} floats (base64 the same), {floats.usage.prompt_tokens} tokens"


def a_one_tool_agent_of_the_agents_sdk(t: Target) -> str:
    """OpenAI's Agents SDK (openai-agents), which calls /v1/responses by default: one agent
    with one function tool, whole and streamed. The random model never ends a text turn
    by itself, so the agent is told to call the tool and stop on its first result."""
    import asyncio

    import openai
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_time() -> str:
        """The time now."""
        calls.append("get_time")
        return "12:00"

    async def run(stream: bool) -> Any:
        client = openai.AsyncOpenAI(base_url=str(t.client.base_url), api_key=t.client.api_key, max_retries=0,
                                    timeout=t.client.timeout)
        agent = Agent(name="clock", instructions="Tell the time.", tools=[get_time],
                      tool_use_behavior="stop_on_first_tool",
                      model=OpenAIResponsesModel(model=t.model, openai_client=client),
                      model_settings=ModelSettings(tool_choice="get_time", temperature=0, max_tokens=24))
        if not stream:
            return await Runner.run(agent, "What time is it?", max_turns=4)
        result = Runner.run_streamed(agent, "What time is it?", max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    for stream in (False, True):
        result = asyncio.run(run(stream))
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds == ["ToolCallItem", "ToolCallOutputItem"], (stream, kinds)
        assert result.final_output == "12:00", (stream, result.final_output)
    assert calls == ["get_time", "get_time"], calls
    return "an agent with one tool called it and stopped on its result, whole and streamed (/v1/responses)"


CHECKS: list[Callable[[Target], str]] = [
    logprobs_chat_streamed_and_completions, named_and_required_tool_calls_and_a_tool_result_turn,
    json_object_and_structured_choice, token_id_prompts_and_echo, n_streamed_and_a_fixed_seed,
    stop_token_ids_and_max_completion_tokens, a_one_tool_agent_of_the_agents_sdk, embeddings_of_two_inputs]


def run_all(t: Target) -> int:
    """Runs every check (embeddings only with an embedding model), printing each; the
    number that failed."""
    failed = 0
    for check in CHECKS:
        if check is embeddings_of_two_inputs and not t.embed_model:
            continue
        started = time.monotonic()
        try:
            said = check(t)
        except Exception as exc:  # noqa: BLE001 - every check runs; each failure is printed
            failed += 1
            print(f"FAIL {check.__name__} ({time.monotonic() - started:.1f} s): {type(exc).__name__}: "
                  f"{str(exc)[:600]}", flush=True)
        else:
            print(f"ok   {check.__name__} ({time.monotonic() - started:.1f} s): {said}", flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    import openai

    p = argparse.ArgumentParser(prog="python -m tests.harness.openai_checks", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the gateway's OpenAI base URL (…/v1)")
    p.add_argument("--key-file", type=Path, required=True, help="a file holding an API key of the gateway")
    p.add_argument("--triton-url", required=True, help="Triton's HTTP URL on the host (for a token id)")
    p.add_argument("--model", required=True)
    p.add_argument("--embed-model", default="", help="an embedding model to check (none: skipped)")
    a = p.parse_args(argv)
    client = openai.OpenAI(base_url=a.base_url, api_key=a.key_file.read_text().strip(), timeout=180, max_retries=0)
    failed = run_all(Target(client, a.model, a.triton_url.rstrip("/"), a.embed_model))
    total = len(CHECKS) - (0 if a.embed_model else 1)
    print(f"openai checks against {a.base_url}: {total - failed} of {total} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
