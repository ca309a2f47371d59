"""The OpenAI-compatible gateway (`llmhost gateway`) in front of the real stack,
driven by the official `openai` client, sync and async, streaming and not."""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmhost.gateway.keys import hash_key
from tests.e2e._client import more_than, shaped
from tests.harness.gateway import KEY, Gateway, start_gateway, stop_gateway
from tests.harness.net import CLIENT_TIMEOUT_S, free_port

CAPPED_KEY = "capped-key-0123456789abcdef"
LIMITED_KEY = "limited-key-0123456789abcdef"
MAX_BODY = 64 * 1024
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    keys = tmp_path_factory.mktemp("gateway-keys") / "keys.yml"
    keys.write_text(f"keys:\n  - name: tester\n    sha256: {hash_key(KEY)}\n"
                    f"  - name: capped\n    sha256: {hash_key(CAPPED_KEY)}\n    max_tokens: 8\n"
                    f"  - name: limited\n    sha256: {hash_key(LIMITED_KEY)}\n    rpm: 2\n    tpm: 100000\n"
                    "    max_concurrent: 2\n")
    return keys


@pytest.fixture(scope="module")
def gateway(server, keys_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("gateway")
    port, metrics_port = free_port(), free_port()
    log = work / "gateway.log"
    # Streams go through the server's engine sockets, as on an inference host.
    cmd = [str(Path(sys.executable).parent / "llmhost"), "gateway", "--upstream", server.grpc,
           "--engine-sockets", f"{server.grpc}={server.engine_sockets}",
           "--listen", f"127.0.0.1:{port}", "--keys-file", str(keys_file), "--model", server.name,
           "--max-body-bytes", str(MAX_BODY), "--metrics-listen", f"127.0.0.1:{metrics_port}",
           "--health-interval-s", "1"]
    url = f"http://127.0.0.1:{port}/v1"
    proc = start_gateway(cmd, log, url)
    yield Gateway(url, proc, log, f"http://127.0.0.1:{metrics_port}/metrics")
    stop_gateway(proc, log)


@pytest.fixture
def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S)


@pytest.fixture
def aclient(gateway: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S)


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
    async def once() -> tuple[dict[int, str], dict[int, list[str]]]:
        out: dict[int, str] = {0: "", 1: ""}
        reasons: dict[int, list[str]] = {0: [], 1: []}
        stream = await aclient.chat.completions.create(model=server.name, messages=_chat(), max_tokens=6, n=2,
                                                       stream=True, seed=3, extra_body={"ignore_eos": True})
        async for c in stream:
            for choice in c.choices:
                out[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    reasons[choice.index].append(choice.finish_reason)
        return out, reasons

    async def run() -> list[tuple[dict[int, str], dict[int, list[str]]]]:
        # The two completions finish in one response or in two (one step apart).
        return [await once() for _ in range(4)]

    for out, reasons in asyncio.run(run()):
        assert out[0] and out[1]
        assert reasons == {0: ["length"], 1: ["length"]}, reasons  # once per choice


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
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"echo": True}, "echo"),
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


@pytest.mark.parametrize("declared", [True, False])
def test_a_64_mib_body_gets_its_413_not_a_reset(gateway, server, declared):
    """Sent as a slow client sends it (1 MiB at a time), with its Content-Length or chunked: the
    client gets the 413 (not a reset connection), and the gateway serves the next request."""
    body = b'{"model": "tiny", "prompt": "' + b"x" * (64 << 20) + b'"}'

    def slowly() -> Iterator[bytes]:
        for i in range(0, len(body), 1 << 20):
            time.sleep(0.01)
            yield body[i:i + (1 << 20)]

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if declared:
        headers["Content-Length"] = str(len(body))
    r = httpx.post(f"{gateway.url}/completions", content=slowly(), timeout=120, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
    ok = httpx.post(f"{gateway.url}/completions", json={"model": server.name, "prompt": PROMPT, "max_tokens": 2},
                    headers=_auth(), timeout=60)
    assert ok.status_code == 200, ok.text


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


def test_metrics_count_requests_by_key_and_status_and_show_the_upstream_up(gateway, client, server):
    def requests_total(status: str) -> float:
        text = httpx.get(gateway.metrics, timeout=10).text
        line = f'llmhost_gateway_requests_total{{key="tester",model="{server.name}",status="{status}"}} '
        return sum(float(x[len(line):]) for x in text.splitlines() if x.startswith(line))

    ok, bad = requests_total("200"), requests_total("400")
    client.completions.create(model=server.name, prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.name, prompt=PROMPT, max_tokens=4, temperature=-1)
    assert requests_total("200") == ok + 1 and requests_total("400") == bad + 1
    text = httpx.get(gateway.metrics, timeout=10).text
    assert f'llmhost_gateway_upstream_up{{upstream="{server.grpc}"}} 1.0' in text, text[-3000:]
    assert KEY not in text and PROMPT not in text


def _gateway_series(gateway: Gateway, series: str) -> float:
    text = httpx.get(gateway.metrics, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + "{"))


def test_streams_go_through_the_engine_socket_one_event_per_engine_step(gateway, server):
    assert server.engine_sockets is not None
    sockets = [p.name for p in (server.engine_sockets / server.name).iterdir()]
    assert len(sockets) == 1 and sockets[0].startswith("1-") and sockets[0].endswith(".sock"), sockets
    lines = _gateway_series(gateway, "llmhost_gateway_upstream_transit_seconds_count")
    tokens = _gateway_series(gateway, "llmhost_gateway_tokens_per_event_sum")
    counted = _gateway_series(gateway, "llmhost_gateway_tokens_per_event_count")
    delays = server.metric("llmhost:response_delay_seconds_count")
    body = {"model": server.name, "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    # One event per engine step: each step one token on this model. vLLM hands over the
    # steps its consumer has not taken yet as one output, so on a loaded machine a line
    # may carry two; then there are fewer events, never more.
    n = len(events)
    assert 0 < n <= 16
    # Every event came as its own line of the socket, and the gateway counted it.
    assert _gateway_series(gateway, "llmhost_gateway_upstream_transit_seconds_count") == lines + n
    assert _gateway_series(gateway, "llmhost_gateway_tokens_per_event_count") == counted + n
    assert _gateway_series(gateway, "llmhost_gateway_tokens_per_event_sum") == tokens + 16
    # The backend's own stage: its responses' delay is counted as they leave (pushed periodically).
    deadline = time.monotonic() + 30
    while server.metric("llmhost:response_delay_seconds_count") < delays + n and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.metric("llmhost:response_delay_seconds_count") >= delays + n


# --- phase 2: native API, limits, access log, several upstreams, TLS, config, drain ---

def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _native(gateway: Gateway) -> str:
    return gateway.url.removesuffix("/v1")


def test_native_generate_and_generate_stream(gateway, server):
    base = f"{_native(gateway)}/v2/models/{server.name}"
    body = {"text_input": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0,
            "exclude_input_in_output": True, "return_num_output_tokens": True}
    r = httpx.post(f"{base}/generate", json=body, headers=_auth(), timeout=120)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["model_name"] == server.name and isinstance(whole["text_output"], str)
    assert whole["num_output_tokens"] == 8 and "num_input_tokens" not in whole

    def take() -> list[dict[str, Any]]:
        counted = _gateway_series(gateway, "llmhost_gateway_tokens_per_event_count")
        with httpx.stream("POST", f"{base}/generate_stream", json={**body, "stream": True}, headers=_auth(),
                          timeout=120) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line.startswith("data: ")]
        # Each response counts its own output tokens (vllm_backend's num_output_tokens).
        assert "".join(e["text_output"] for e in events) == whole["text_output"]
        assert sum(e["num_output_tokens"] for e in events) == 8
        # The stream's events are counted as the OpenAI door's are (tokens per event).
        assert _gateway_series(gateway, "llmhost_gateway_tokens_per_event_count") == counted + len(events)
        return events

    shaped(take, more_than(1))
    r = httpx.post(f"{base}/generate", json={**body, "temperature": -1}, headers=_auth(), timeout=60)
    assert r.status_code == 400 and "temperature" in r.json()["error"]
    assert httpx.post(f"{base}/generate", json=body, timeout=60).status_code == 401


def test_native_health_metadata_and_no_admin_paths(gateway, server):
    base = _native(gateway)
    for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{server.name}/ready"):
        assert httpx.get(base + path, headers=_auth()).status_code == 200, path
        assert httpx.get(base + path).status_code == 401, path
    meta = httpx.get(f"{base}/v2/models/{server.name}", headers=_auth()).json()
    assert meta["name"] == server.name and "text_input" in [i["name"] for i in meta["inputs"]]
    for method, path in (("POST", "/v2/repository/index"), ("POST", f"/v2/repository/models/{server.name}/load"),
                         ("POST", f"/v2/repository/models/{server.name}/unload"), ("GET", "/v2/logging"),
                         ("GET", "/v2/trace/setting"), ("GET", f"/v2/models/{server.name}/stats"),
                         ("GET", "/v2/systemsharedmemory/status"), ("GET", "/v2/cudasharedmemory/status"),
                         ("GET", f"/v2/models/{server.name}/config"), ("GET", "/v2")):
        r = httpx.request(method, base + path, headers=_auth(), json={})
        assert r.status_code == 404, (method, path, r.status_code)


def test_rate_limit_is_openais_429_with_retry_after(gateway, server):
    c = openai.OpenAI(base_url=gateway.url, api_key=LIMITED_KEY, max_retries=0)
    for _ in range(2):
        c.completions.create(model=server.name, prompt=PROMPT, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        c.completions.create(model=server.name, prompt=PROMPT, max_tokens=1)
    err = _error(info.value)
    assert err["type"] == "requests" and err["code"] == "rate_limit_exceeded"
    # rpm 2 refills one request every 30 s: the wait is whole seconds, at least 1 and
    # at most one refill (a bucket that never refilled, or a wrong rate, would fail).
    assert 1 <= int(info.value.response.headers["retry-after"]) <= 30
    text = httpx.get(gateway.metrics, timeout=10).text
    assert 'llmhost_gateway_rate_limited_total{key="limited",limit="rpm"} 1.0' in text


def test_access_log_has_a_json_line_per_request_without_key_or_prompt(gateway, client, server):
    secret = "a prompt nobody may log 8812"
    client.completions.create(model=server.name, prompt=secret, max_tokens=2)
    def done() -> list[dict[str, object]]:
        entries = [json.loads(x) for x in gateway.log.read_text().splitlines() if x.startswith("{")]
        return [e for e in entries if e["path"] == "/v1/completions" and e["status"] == 200
                and e["completion_tokens"] == 2]

    deadline = time.monotonic() + 10
    while not done() and time.monotonic() < deadline:  # the line is written once the response is sent
        time.sleep(0.2)
    entry = done()[-1]
    assert entry["key"] == "tester" and entry["model"] == server.name and entry["upstream"] == server.grpc
    assert entry["prompt_tokens"] > 0 and entry["client"].startswith("127.0.0.1:")
    text = gateway.log.read_text()
    assert secret not in text and KEY not in text and LIMITED_KEY not in text and "Bearer" not in text


def test_a_second_gateway_from_a_config_file_with_tls_a_dead_upstream_and_a_drain(server, keys_file, tmp_path):
    """Also the gRPC path: this gateway has no engine sockets."""
    from tests.harness.certs import self_signed

    cert, key = self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=str(cert))
    port, metrics_port, dead = free_port(), free_port(), free_port()
    config = tmp_path / "gateway.yml"
    config.write_text(f"upstreams: ['127.0.0.1:{dead}', '{server.grpc}']\nmodels: [{server.name}]\n"
                      f"listen: '127.0.0.1:{port}'\nmetrics_listen: '127.0.0.1:{metrics_port}'\n"
                      f"keys_file: {keys_file}\nhealth: {{interval_s: 0.5, timeout_s: 1}}\n"
                      f"limits: {{max_concurrent_upstream: 4, max_queue: 8, queue_timeout_s: 30}}\n"
                      f"tls: {{cert: {cert.name}, key: {key.name}}}\ndrain_timeout_s: 60\n")
    log = tmp_path / "gateway2.log"
    url = f"https://127.0.0.1:{port}/v1"
    proc = start_gateway([str(Path(sys.executable).parent / "llmhost"), "gateway", "--config", str(config)], log, url,
                  verify=trust)
    try:
        c = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, http_client=httpx.Client(verify=trust))
        for _ in range(4):  # every request is served, none goes to the dead upstream
            # Served whole: two tokens (their text may be empty: the random model can
            # pick a special token or half a UTF-8 character, about 1 in 400 times).
            r = c.completions.create(model=server.name, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "length", r
        assert [m.id for m in c.models.list()] == [server.name]
        with pytest.raises(httpx.TransportError):  # HTTPS only
            httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=_auth(), timeout=5)
        # /metrics has the API's TLS too.
        text = httpx.get(f"https://127.0.0.1:{metrics_port}/metrics", timeout=10, verify=trust).text
        assert f'llmhost_gateway_upstream_up{{upstream="127.0.0.1:{dead}"}} 0.0' in text, text[-2000:]
        assert f'llmhost_gateway_upstream_up{{upstream="{server.grpc}"}} 1.0' in text
        assert f'llmhost_gateway_upstream_outstanding{{upstream="{server.grpc}"}} 0.0' in text

        # SIGTERM while a stream is in flight: the stream still finishes.
        body = {"model": server.name, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/completions", json=body, headers=_auth(), timeout=120,
                          verify=trust) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]", rest[-3:]
        # An error event has an "error" member; the random model may also write the word "error".
        errors = [line for line in rest if line.startswith("data: {") and "error" in json.loads(line[6:])]
        assert not errors, (errors, log.read_text()[-3000:])
        assert len(rest) > 2 and '"finish_reason":"length"' in rest[-2]  # chunks came after the SIGTERM
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.mark.parametrize("kind", ["openai", "http"])
def test_llmhost_bench_drives_vllms_own_client_through_the_gateway(gateway, server, tiny_model, tmp_path, kind):
    """vLLM's client on the OpenAI door, and (with llmhost's request function for it) on
    Triton's generate_stream through the gateway's native door."""
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    out = tmp_path / "bench.json"
    url = gateway.url if kind == "openai" else _native(gateway)

    def take() -> dict[str, Any]:
        r = subprocess.run([str(Path(sys.executable).parent / "llmhost"), "bench", "--client", "vllm",
                            "--kind", kind, "--url", url, "--model", server.name, "--tokenizer", str(tiny_model),
                            "--api-key-file", str(key_file), "--concurrency", "2", "--requests", "4",
                            "--prompt-words", "16", "--output-tokens", "8", "--json", str(out)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "tok/event" in r.stdout
        level: dict[str, Any] = json.loads(out.read_text())["levels"][0]
        assert (level["concurrency"], level["completed"], level["failed"]) == (2, 4, 0), level
        assert level["output_tokens_per_s"] > 0 and level["itl_ms"]["median"] > 0
        return level

    def per_step(level: dict[str, Any]) -> None:
        # About one token an event: vLLM's client counts only events with text, and the
        # random model's token is now and then half a UTF-8 character (an event without text).
        assert 1.0 <= level["tokens_per_event"] < 1.5, level

    shaped(take, per_step)


@pytest.mark.parametrize("path", ["grpc", "socket"])
def test_a_client_naming_unavailability_cannot_take_the_upstream_out(gateway, server, keys_file, tmp_path, path):
    """Error text that echoes the client's words (an unknown parameter) is the client's 400,
    on both paths: the upstream stays in for everyone."""
    url = gateway.url
    proc = None
    if path == "grpc":  # a gateway of its own without engine sockets
        port = free_port()
        url = f"http://127.0.0.1:{port}/v1"
        proc = start_gateway([str(Path(sys.executable).parent / "llmhost"), "gateway", "--upstream", server.grpc,
                       "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{free_port()}",
                       "--keys-file", str(keys_file), "--model", server.name, "--health-interval-s", "30"],
                      tmp_path / "gateway.log", url)
    try:
        native = f"{url.removesuffix('/v1')}/v2/models/{server.name}/generate"
        for words in ("the model is shutting down", "the model's engine stopped (", "Server not ready",
                      "Request for unknown model: "):
            r = httpx.post(native, json={"text_input": PROMPT, "max_tokens": 2, words: 1}, headers=_auth(),
                           timeout=60)
            assert r.status_code == 400 and words in r.json()["error"], r.text
            ok = httpx.post(native, json={"text_input": PROMPT, "max_tokens": 2}, headers=_auth(), timeout=60)
            assert ok.status_code == 200, ok.text  # the same gateway still has its upstream
    finally:
        if proc is not None:
            stop_gateway(proc, tmp_path / "gateway.log")


def test_vllms_structured_outputs_and_stop_token_ids(client, gateway, server):
    choice = client.chat.completions.create(model=server.name, messages=_chat("yes or no?"), max_tokens=8,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no"), choice
    digits = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=6, temperature=0,
                                       extra_body={"guided_regex": "[0-9]{3}"})
    assert len(digits.choices[0].text) == 3 and digits.choices[0].text.isdigit(), digits
    # The first token the model picks at temperature 0 (its id from the native door's logprobs),
    # as a stop token: nothing is generated.
    r = httpx.post(f"{_native(gateway)}/v2/models/{server.name}/generate", headers=_auth(), timeout=60,
                   json={"text_input": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 0,
                         "return_logprobs": True, "exclude_input_in_output": True})
    assert r.status_code == 200, r.text
    ids = [int(token) for position in json.loads(r.json()["logprobs"]) for token in position]
    assert len(ids) == 1, r.text
    stopped = client.completions.create(model=server.name, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": ids})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == "", stopped
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.name, prompt=PROMPT, max_tokens=2,
                                  extra_body={"structured_outputs": {"regexp": "x"}})
    assert "regexp" in _error(info.value)["message"]
