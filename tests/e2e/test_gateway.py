"""The OpenAI-compatible gateway (`llmhost gateway`) in front of the real stack,
driven by the official `openai` client, sync and async, streaming and not."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from llmhost.gateway.keys import hash_key
from tests.conftest import free_port

KEY = "test-key-0123456789abcdef"
CAPPED_KEY = "capped-key-0123456789abcdef"
MAX_BODY = 64 * 1024
PROMPT = "def fibonacci(n):"


@dataclass
class Gateway:
    url: str  # the OpenAI base URL, http://HOST:PORT/v1
    proc: subprocess.Popen[bytes]
    log: Path


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("gateway")
    keys = work / "keys.yml"
    keys.write_text(f"keys:\n  - name: tester\n    sha256: {hash_key(KEY)}\n"
                    f"  - name: capped\n    sha256: {hash_key(CAPPED_KEY)}\n    max_tokens: 8\n")
    port = free_port()
    log = work / "gateway.log"
    cmd = [str(Path(sys.executable).parent / "llmhost"), "gateway", "--upstream", server.grpc,
           "--listen", f"127.0.0.1:{port}", "--keys-file", str(keys), "--model", server.name,
           "--max-body-bytes", str(MAX_BODY)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    gw = Gateway(f"http://127.0.0.1:{port}/v1", proc, log)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{gw.url}/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.3)
    yield gw
    proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then ends by the signal it got.
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM), log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture
def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture
def aclient(gateway: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=120)


def _chat(text: str = PROMPT) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_models_lists_the_ready_model(client, server):
    assert [m.id for m in client.models.list()] == [server.name]
    assert client.models.retrieve(server.name).id == server.name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_usage_and_finish_reason(client, server):
    r = client.chat.completions.create(model=server.name, messages=_chat(), max_tokens=8,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == server.name
    assert len(r.choices) == 1 and r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_stream_matches_non_stream_and_reports_usage(client, server):
    args = {"model": server.name, "messages": _chat(), "max_completion_tokens": 12, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_n_and_usage(client, server):
    r = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=6, n=2, seed=1,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.text and c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 12


def test_async_streaming_completions(aclient, server):
    async def run() -> tuple[str, list[str], int]:
        stream = await aclient.completions.create(model=server.name, prompt=PROMPT, max_tokens=10, stream=True,
                                                  temperature=0, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        text, reasons, used = "", [], 0
        async for c in stream:
            for choice in c.choices:
                text += choice.text
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
            if c.usage:
                used = c.usage.completion_tokens
        whole = await aclient.completions.create(model=server.name, prompt=PROMPT, max_tokens=10, temperature=0,
                                                 extra_body={"ignore_eos": True})
        assert whole.choices[0].text == text
        return text, reasons, used

    text, reasons, used = asyncio.run(run())
    assert text and reasons == ["length"] and used == 10


def test_async_chat_stream_n2(aclient, server):
    async def run() -> dict[int, str]:
        out: dict[int, str] = {0: "", 1: ""}
        stream = await aclient.chat.completions.create(model=server.name, messages=_chat(), max_tokens=6, n=2,
                                                       stream=True, seed=3, extra_body={"ignore_eos": True})
        async for c in stream:
            for choice in c.choices:
                out[choice.index] += choice.delta.content or ""
        return out

    out = asyncio.run(run())
    assert out[0] and out[1]


def test_seed_is_deterministic(client, server):
    def once(seed: int) -> str:
        r = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    assert once(42) == once(42)
    assert once(42) != once(43)


def test_stop(client, server):
    args = {"model": server.name, "prompt": PROMPT, "max_tokens": 40, "temperature": 1.0, "seed": 3,
            "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**args).choices[0].text
    stop = next(full[k:k + 3] for k in range(5, len(full) - 3) if full.index(full[k:k + 3]) == k)
    r = client.completions.create(stop=[stop], **args)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]


def test_json_schema_output(client, server):
    # Bounded by construction, so even a random model must finish it.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M"]}},
              "required": ["ok", "size"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=server.name, messages=_chat(), max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "shirt", "schema": schema}})
    value = json.loads(r.choices[0].message.content)
    assert isinstance(value["ok"], bool) and value["size"] in ("S", "M")


def _error(exc: openai.APIStatusError) -> dict[str, object]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_missing_or_wrong_key_is_401(gateway, server):
    c = openai.OpenAI(base_url=gateway.url, api_key="wrong-key-0123456789abcdef", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        c.chat.completions.create(model=server.name, messages=_chat(), max_tokens=2)
    assert _error(info.value)["type"] == "authentication_error"
    r = httpx.get(f"{gateway.url}/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"logprobs": True}, "logprobs"),
    ({"bogus_field": 1}, "bogus_field"),
    ({"temperature": -1}, "temperature"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
])
def test_unsupported_or_bad_fields_are_400_naming_the_field(client, server, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.name, messages=_chat(), max_tokens=2, extra_body=extra)
    err = _error(info.value)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param.split(".")[0] in str(err["message"])


def test_backend_refusal_is_400(client, server):
    # Longer than the server's max_model_len (512): the backend refuses it.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.name, prompt="word " * 3000, max_tokens=2)
    err = _error(info.value)
    assert err["type"] == "invalid_request_error" and "Traceback" not in str(err["message"])


def test_key_max_tokens_cap(gateway, server):
    c = openai.OpenAI(base_url=gateway.url, api_key=CAPPED_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=server.name, prompt=PROMPT, max_tokens=9)
    assert _error(info.value)["param"] == "max_tokens"
    r = c.completions.create(model=server.name, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8  # the cap is the default


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=_chat(), max_tokens=2)
    assert _error(info.value)["code"] == "model_not_found"


def test_body_over_the_limit_is_413(client, server):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=server.name, prompt="x" * (MAX_BODY + 1), max_tokens=2)
    assert info.value.status_code == 413
    assert _error(info.value)["code"] == "request_too_large"


def test_disconnect_cancels_the_engine_request(gateway, server):
    cancelled = server.metric("vllm:request_cancelled_total")
    body = {"model": server.name, "prompt": "def main():", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(ln.startswith("data: {") for ln in got)
    # The client went away a few tokens in, long before the 400th.
    deadline = time.monotonic() + 30
    while server.metric("vllm:request_cancelled_total") <= cancelled and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.metric("vllm:request_cancelled_total") == cancelled + 1
    while server.metric("vllm:num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.metric("vllm:num_requests_running") == 0
