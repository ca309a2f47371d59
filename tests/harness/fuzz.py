"""Property-based fuzzing of a serving endpoint (hypothesis): thousands of
generated requests over HTTP and gRPC; each gets a response or a clear error, and
the server stays ready. Used against a local `llmhost serve` (tests/e2e/test_fuzz.py)
and against the booted host's tritonserver unit (tests/system/test_serving_on_host.py).

Derandomized (the same cases every run) so CI is reproducible; FUZZ_EXAMPLES
raises the count for a longer local run.
"""


from __future__ import annotations

import json
import os
import queue
import time
from typing import Any

import numpy as np
import requests
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness.endpoint import Endpoint

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "2000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
# Keys the backend knows, plus junk; values of any type.
KNOWN = ["temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "ignore_eos",
         "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
         "bad_words", "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens",
         "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
         "exclude_input_in_output", "choice", "regex", "json_schema", "structured_outputs",
         "spaces_between_special_tokens", "tokenize", "detokenize", "bogus_key"]
small_max_tokens = st.one_of(st.integers(-3, 6), st.sampled_from(["4", "x", 2.5, None, True, [1]]))
# JSON nested around the depth bound (100), and far beyond it.
deep_json = st.one_of(st.integers(95, 105), st.sampled_from([1000, 100_000])).flatmap(
    lambda n: st.sampled_from(["[" * n + "]" * n, "[" * n, '{"a":' * n + "1" + "}" * n]))
messages = st.one_of(
    deep_json,
    st.text(max_size=40),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot", 7]),
                                    "content": st.one_of(st.text(max_size=30), st.integers())}),
             max_size=4).map(json.dumps),
    json_values.map(json.dumps),
)
valid_bodies = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 6)},
    optional={
        "text_input": st.text(min_size=1, max_size=60).filter(str.strip),
        "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
        "seed": st.integers(0, 2**31), "n": st.integers(1, 3), "stop": st.text(min_size=1, max_size=3),
        "ignore_eos": st.booleans(), "return_num_output_tokens": st.booleans(),
        "exclude_input_in_output": st.booleans(), "repetition_penalty": st.floats(0.5, 2),
    },
).map(lambda b: {"text_input": "def f(x):", **b})
wild_bodies = st.fixed_dictionaries(
    {"max_tokens": small_max_tokens},
    optional={
        "text_input": st.one_of(st.text(max_size=80), st.integers(), st.none()),
        "messages": messages,
        "sampling_parameters": st.one_of(st.text(max_size=30), deep_json,
                                         st.dictionaries(st.sampled_from(KNOWN), json_values,
                                                         max_size=3).map(json.dumps)),
        "stream": st.one_of(st.booleans(), st.integers(0, 2)),
        **{k: json_values for k in KNOWN[:6]},
    },
)
bodies = st.one_of(valid_bodies, wild_bodies)


# A response must never show a Python traceback or a path of the server's files
# (unless the request itself carried the string and an error quotes it back).
LEAKS = ("Traceback", 'File "', "/site-packages/", "/usr/", "/opt/", "/tmp/", ".py")


def sent_text(*values: Any) -> str:
    """Every string a request carried, as an error may quote it back: each value's repr
    and text, and the string keys and values inside any JSON among them (JSON text
    within JSON too), unescaped: a parameter sent as "File \\"" comes back as 'File "'."""
    out: list[str] = []

    def walk(value: Any, depth: int = 0) -> None:
        if depth > 8:
            return
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, str):
            out.append(value)
            try:
                parsed = json.loads(value)
            except (ValueError, RecursionError):
                return
            if not isinstance(parsed, str) or parsed != value:
                walk(parsed, depth + 1)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k, depth + 1)
                walk(v, depth + 1)
        elif isinstance(value, list):
            for v in value:
                walk(v, depth + 1)
        else:
            out.append(str(value))

    for v in values:
        out.append(repr(v))
        walk(v)
    return "\n".join(out)


def assert_no_leak(text: str, request_text: str = "") -> None:
    for needle in LEAKS:
        assert needle not in text or needle in request_text, (needle, text[:500])


def _check_answer(status: int, text: str, request_text: str = "") -> None:
    data = json.loads(text)
    if "error" in data:
        assert_no_leak(str(data["error"]), request_text)
    if status == 500:
        # Triton's own HTTP frontend answers 500 when a JSON value does not fit the
        # input's type (e.g. a number for text_input), before our backend sees it.
        assert data["error"].startswith("Unable to parse "), data
        return
    assert status in (200, 400), (status, text[:300])
    if status == 400 or "error" in data:
        assert isinstance(data["error"], str) and len(data["error"]) > 5, data
    else:
        assert "text_output" in data, data


def fuzz_http_generate(server: Endpoint, examples: int = EXAMPLES) -> dict[str, int]:
    session = requests.Session()
    url = f"{server.http}/v2/models/{server.name}/generate"
    seen = {"ok": 0, "error": 0}

    @settings(FUZZ, max_examples=examples)
    @given(body=bodies)
    def one(body: dict[str, Any]) -> None:
        if body.get("stream") is True:
            body["stream"] = False  # /generate takes exactly one response; streams are fuzzed below
        sent = json.dumps(body)
        r = session.post(url, data=sent, timeout=60)
        _check_answer(r.status_code, r.text, sent_text(sent, body))
        seen["ok" if r.status_code == 200 and "error" not in r.json() else "error"] += 1

    one()
    assert seen["ok"] > 10 and seen["error"] > 10, seen  # both kinds were exercised
    assert_healthy(server)
    return seen


def fuzz_http_generate_stream(server: Endpoint) -> int:
    session = requests.Session()
    url = f"{server.http}/v2/models/{server.name}/generate_stream"

    seen = [0]

    @settings(FUZZ, max_examples=max(EXAMPLES // 4, 50))
    @given(body=bodies)
    def one(body: dict[str, Any]) -> None:
        seen[0] += 1
        body["stream"] = True
        sent = json.dumps(body)
        with session.post(url, data=sent, stream=True, timeout=60) as r:
            assert r.status_code in (200, 400, 500), r.status_code
            lines = list(r.iter_lines(decode_unicode=True))
        events = [ln for ln in lines if ln.startswith("data:")]
        if r.status_code == 200:
            assert events
            for e in events:
                payload = json.loads(e[5:])
                assert "text_output" in payload or isinstance(payload.get("error"), str)
                if "error" in payload:
                    assert_no_leak(payload["error"], sent_text(sent, body))
        else:
            assert_no_leak("\n".join(lines), sent_text(sent, body))

    one()
    assert_healthy(server)
    return seen[0]


def fuzz_grpc(server: Endpoint, examples: int = EXAMPLES, target: str | None = None,
              headers: dict[str, str] | None = None) -> dict[str, int]:
    """EXAMPLES streamed requests to SERVER's gRPC port, or to TARGET (a gateway's gRPC
    door, with HEADERS): each ends with its final response or an error that leaks nothing."""
    client = grpcclient.InferenceServerClient(target or server.grpc)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
    counts = {"ok": 0, "error": 0}

    @settings(FUZZ, max_examples=examples)
    @given(text=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode)),
           params=st.one_of(st.binary(max_size=20), deep_json.map(str.encode),
                            st.dictionaries(st.sampled_from(KNOWN), json_values, max_size=3)
                            .map(lambda d: json.dumps({**d, "max_tokens": 3}).encode())),
           stream=st.booleans(), as_messages=st.booleans())
    def one(text: bytes, params: bytes, stream: bool, as_messages: bool) -> None:
        inputs = []
        for name, value, dtype in (("messages" if as_messages else "text_input", text, "BYTES"),
                                   ("sampling_parameters", params, "BYTES"), ("stream", stream, "BOOL")):
            t = grpcclient.InferInput(name, [1], dtype)
            t.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else np.bool_))
            inputs.append(t)
        client.async_stream_infer(server.name, inputs, parameters={"max_tokens": 3},
                                  enable_empty_final_response=True)
        deadline = time.monotonic() + 60
        while True:
            result, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                assert len(str(error)) > 5
                assert_no_leak(str(error), sent_text(text, params))
                counts["error"] += 1
                return
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                counts["ok"] += 1
                return

    try:
        one()
    finally:
        client.stop_stream()
        client.close()
    assert counts["ok"] > 10 and counts["error"] > 10, counts
    assert_healthy(server)
    return counts


def disconnect_mid_stream(server: Endpoint, clients: int = 100) -> None:
    """CLIENTS streams start, then every client disconnects: the engine ends with
    no request running and the server still answers."""
    body = {"text_input": "def main():", "max_tokens": 300, "ignore_eos": True, "stream": True}
    url = f"{server.http}/v2/models/{server.name}/generate_stream"
    responses = [requests.post(url, json=body, stream=True, timeout=60) for _ in range(clients)]
    for r in responses:
        next(r.iter_lines())  # each stream has started
    for r in responses:
        r.close()
    deadline = time.monotonic() + 60
    while server.metric("vllm:num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.metric("vllm:num_requests_running") == 0
    assert_healthy(server)


def assert_healthy(server: Endpoint) -> None:
    assert requests.get(f"{server.http}/v2/health/ready", timeout=10).status_code == 200
    r = requests.post(f"{server.http}/v2/models/{server.name}/generate",
                      json={"text_input": "ok", "max_tokens": 2, "return_num_output_tokens": True}, timeout=60)
    assert r.status_code == 200 and r.json()["num_output_tokens"] >= 1, r.text


# --- the gateway's POST /v1/responses ------------------------------------------------

RESPONSES_FIELDS = ["instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
                    "parallel_tool_calls", "previous_response_id", "reasoning", "text", "store", "include",
                    "metadata", "truncation", "background", "user", "top_k", "stop", "seed", "bogus_key"]
_parts = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", "input_file",
                                                         7]),
                                "text": st.one_of(st.text(max_size=20), st.integers())})
_items = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "robot"]),
                           "content": st.one_of(st.text(max_size=30), st.lists(_parts, max_size=2))},
                          optional={"type": st.sampled_from(["message", "item_reference", "reasoning"])}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output"]),
                           "call_id": st.sampled_from(["c1", "c2", ""])},
                          optional={"name": st.sampled_from(["f", ""]), "arguments": st.sampled_from(["{}", "{", 3]),
                                    "output": st.one_of(st.text(max_size=10), st.integers())}),
    json_values,
)
_function_tool = st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "get_time"])},
                                       optional={"parameters": st.sampled_from([{"type": "object"}, "x", None])})


def responses_bodies(model: str) -> st.SearchStrategy[Any]:
    """/v1/responses bodies for MODEL: valid ones (a few tokens each) and wild ones
    (junk fields, values and items of every type), as dicts, and raw bytes."""
    valid = st.fixed_dictionaries(
        {"model": st.just(model), "input": st.one_of(st.text(min_size=1, max_size=40).filter(str.strip),
                                                     st.lists(st.fixed_dictionaries(
                                                         {"role": st.sampled_from(["user", "developer"]),
                                                          "content": st.text(min_size=1, max_size=30)}),
                                                         min_size=1, max_size=2)),
         "max_output_tokens": st.integers(1, 6)},
        optional={"instructions": st.text(max_size=30), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
                  "stream": st.booleans(), "tools": st.lists(_function_tool, min_size=1, max_size=2),
                  "tool_choice": st.sampled_from(["none", "auto"]), "store": st.booleans()})
    wild = st.fixed_dictionaries(
        {"model": st.one_of(st.just(model), json_values)},
        optional={"input": st.one_of(st.lists(_items, max_size=3), json_values, deep_json),
                  "stream": st.one_of(st.booleans(), st.integers(0, 2)),
                  "max_output_tokens": small_max_tokens,
                  **{k: json_values for k in RESPONSES_FIELDS}})
    raw = st.one_of(deep_json.map(str.encode), st.binary(max_size=40))
    return st.one_of(valid, wild, raw)


def check_responses_answer(status: int, body: str, sent: str) -> str:
    """One /v1/responses answer: 200 with a response (a stream of events that ends as a
    response does), or 400/404/413 with OpenAI's error object naming no server internals.
    Returns "ok" or "error"."""
    if status != 200:
        assert status in (400, 404, 413), (status, body[:300])
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and len(error["message"]) > 5, error
        assert_no_leak(json.dumps(error), sent)
        return "error"
    if body.startswith("event:"):
        events = [json.loads(line[5:]) for line in body.split("\n") if line.startswith("data:")]
        assert [e["sequence_number"] for e in events] == list(range(len(events))), body[:300]
        assert events[0]["type"] == "response.created", events[0]
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "error"), events[-1]
        return "ok"
    answer = json.loads(body)
    assert answer["object"] == "response" and answer["status"] in ("completed", "incomplete"), answer
    return "ok"


def fuzz_gateway_responses(url: str, key: str, model: str, examples: int) -> dict[str, int]:
    """EXAMPLES generated bodies to a gateway's /v1/responses (URL: its /v1 base)."""
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key}"
    seen = {"ok": 0, "error": 0}

    @settings(FUZZ, max_examples=examples)
    @given(body=responses_bodies(model))
    def one(body: Any) -> None:
        sent = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = session.post(f"{url}/responses", data=sent, timeout=60)
        seen[check_responses_answer(r.status_code, r.text, sent_text(sent, body))] += 1

    one()
    assert seen["ok"] > 10 and seen["error"] > 10, seen
    return seen
