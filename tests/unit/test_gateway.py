"""The gateway without a server: request mapping, error objects, keys, SSE chunks,
and the ASGI app against a fake upstream."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from llmhost.gateway.app import create_app
from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.doors.openai.batch import merged, split
from llmhost.gateway.doors.openai.completion_bodies import Accumulator, completion_body, stream_chunks
from llmhost.gateway.doors.openai.mapping import parse_body, to_backend
from llmhost.gateway.errors import ApiError, unavailable
from llmhost.gateway.keys import KeysError, KeyStore, hash_key, parse_keys
from llmhost.gateway.upstreams.client import (
    Draining,
    NotStarted,
    Piece,
    build_request,
    classify,
    parse_response,
    socket_request,
)
from llmhost.gateway.upstreams.request import BackendRequest

KEY = "unit-key-0123456789abcdef"


def _chat(**kw: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def _map(raw: bytes, chat: bool = True, cap: int | None = None) -> BackendRequest:
    return to_backend(parse_body(raw, chat), cap)


# --- mapping ---------------------------------------------------------------

def test_chat_maps_every_sampling_field():
    req = _map(_chat(max_completion_tokens=7, temperature=0.5, top_p=0.9, n=2, stop="x", seed=3,
                     presence_penalty=0.1, frequency_penalty=0.2, top_k=5, min_p=0.1, repetition_penalty=1.1,
                     ignore_eos=True, min_tokens=2, user="u"))
    assert req.messages == [{"role": "user", "content": "hi"}] and req.text_input is None
    assert req.sampling == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["x"], "seed": 3,
                            "presence_penalty": 0.1, "frequency_penalty": 0.2, "top_k": 5, "min_p": 0.1,
                            "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2}
    assert req.n == 2 and req.chat and not req.stream and req.user == "u"


def test_content_parts_go_to_the_backend_as_parts_and_name_kept():
    # The backend joins them as the model's template wants (vLLM's rendering).
    raw = json.dumps({"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "s"},
        {"role": "user", "content": []}]})
    assert _map(raw.encode()).messages == [
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "s"},
        {"role": "user", "content": ""}]


def test_completion_prompt_and_stream_options():
    req = _map(json.dumps({"model": "m", "prompt": ["p"], "stream": True,
                           "stream_options": {"include_usage": True}}).encode(), chat=False)
    assert req.text_input == "p" and req.stream and req.include_usage and req.sampling == {}


def test_response_format_maps_to_the_backend_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = _map(_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert req.sampling == {"json_schema": schema}
    assert _map(_chat(response_format={"type": "json_object"})).sampling == {"json_schema": {"type": "object"}}
    assert _map(_chat(response_format={"type": "text"})).sampling == {}


def test_max_completion_tokens_wins_over_max_tokens_as_in_vllm():
    assert _map(_chat(max_tokens=3, max_completion_tokens=4)).sampling["max_tokens"] == 4


@pytest.mark.parametrize(("body", "param", "status"), [
    (_chat(tools=[{"type": "function"}]), "tools[0].function", 400),
    (_chat(logprobs="yes"), "logprobs", 400),
    (_chat(logprobs=True, top_logprobs=21), "top_logprobs", 400),
    (_chat(top_logprobs=2), "top_logprobs", 400),
    (_chat(echo=True), "echo", 400),
    (_chat(bogus=1), "bogus", 400),
    (_chat(temperature=-0.1), "temperature", 400),
    (_chat(top_p=0), "top_p", 400),
    (_chat(max_tokens=0), "max_tokens", 400),
    (_chat(n="2"), "n", 400),
    (_chat(stream_options={"include_usage": True}), "stream_options", 400),
    (_chat(response_format={"type": "json_schema"}), "response_format.json_schema", 400),
    (_chat(response_format={"type": "xml"}), "response_format.type", 400),
    (_chat(max_tokens=3, max_completion_tokens=0), "max_completion_tokens", 400),
    (_chat(stop_token_ids=[1, "2"]), "stop_token_ids[1]", 400),
    (_chat(skip_special_tokens="no"), "skip_special_tokens", 400),
    (_chat(structured_outputs="json"), "structured_outputs", 400),
    (_chat(response_format={"type": "json_object"}, guided_choice=["a"]), "guided_choice", 400),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]}).encode(),
     "messages[0].tool_calls", 400),
    (json.dumps({"model": "m", "messages": [{"role": "robot", "content": "x"}]}).encode(), "messages[0].role", 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "model", 400),
    (b"{not json", None, 400),
    (b"[1]", None, 400),
])
def test_bad_requests_name_the_field(body, param, status):
    with pytest.raises(ApiError) as info:
        _map(body)
    assert info.value.status == status and info.value.param == param
    if param:
        assert param.split("[")[0].split(".")[0] in info.value.message


def test_vllms_sampling_and_structured_output_fields_reach_the_backend():
    req = _map(_chat(stop_token_ids=[7, 9], include_stop_str_in_output=True, skip_special_tokens=False,
                     structured_outputs={"choice": ["yes", "no"]}))
    assert req.sampling == {"stop_token_ids": [7, 9], "include_stop_str_in_output": True,
                            "skip_special_tokens": False, "structured_outputs": {"choice": ["yes", "no"]}}
    assert _map(_chat(guided_regex="[0-9]+")).sampling == {"guided_regex": "[0-9]+"}


def test_null_or_false_unsupported_fields_are_accepted():
    assert _map(_chat(logprobs=False, tools=None)).sampling == {}


def test_log_probabilities_and_echo_reach_the_backend():
    assert _map(_chat(logprobs=True)).logprobs == 0
    chat = _map(_chat(logprobs=True, top_logprobs=3))
    assert chat.logprobs == 3 and chat.sampling == {"logprobs": 3}
    completion = _map(json.dumps({"model": "m", "prompt": "ab", "logprobs": 2}).encode(), chat=False)
    assert completion.logprobs == 2 and completion.sampling == {"logprobs": 2} and completion.echo is None
    assert _map(json.dumps({"model": "m", "prompt": "ab", "echo": True}).encode(), chat=False).echo == "ab"
    assert _map(_chat()).logprobs is None
    # The backend is asked for them on both paths only where the request wants them.
    flags = {t.name for t in build_request(chat, "r").inputs}
    assert "return_logprobs" in flags and "return_logprobs" not in {t.name for t in build_request(_map(_chat()),
                                                                                                  "r").inputs}
    line = json.loads(socket_request(completion, "r"))
    assert line["inputs"]["return_logprobs"] is True


def test_echo_with_logprobs_asks_for_the_prompts_log_probabilities():
    req = _map(json.dumps({"model": "m", "prompt": "ab", "echo": True, "logprobs": 1}).encode(), chat=False)
    assert req.sampling["prompt_logprobs"] == 1 and req.echo == "ab" and not req.prompt_logprobs
    with pytest.raises(ApiError) as info:  # the prompt's log probabilities are not streamed
        _map(json.dumps({"model": "m", "prompt": "ab", "echo": True, "logprobs": 1, "stream": True}).encode(),
             chat=False)
    assert info.value.status == 400 and info.value.param == "echo"


@pytest.mark.parametrize(("body", "chat"), [
    ({"model": "m", "prompt": "ab", "prompt_logprobs": 1, "stream": True}, False),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0, "stream": True}, True),
    ({"model": "m", "prompt": ["a", "b"], "prompt_logprobs": 1}, False),
    ({"model": "m", "prompt": "ab", "prompt_logprobs": 21}, False),
    ({"model": "m", "prompt": "ab", "prompt_logprobs": -1}, False),
])
def test_prompt_logprobs_refused_streamed_with_several_prompts_or_out_of_range(body, chat):
    with pytest.raises(ApiError) as info:
        _map(json.dumps(body).encode(), chat=chat)
    assert info.value.status == 400 and info.value.param == "prompt_logprobs", info.value.message


def test_prompt_logprobs_reach_the_backend_and_come_back_in_vllms_shape():

    raw = json.dumps([{"5": {"logprob": None, "rank": None, "decoded_token": "a"}},
                      {"6": {"logprob": -1.5, "rank": 3, "decoded_token": "b"},
                       "7": {"logprob": -0.5, "rank": 1, "decoded_token": "c"}}])
    for chat, body in ((False, {"model": "m", "prompt": "ab", "prompt_logprobs": 1}),
                       (True, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1})):
        req = _map(json.dumps(body).encode(), chat=chat)
        assert req.sampling["prompt_logprobs"] == 1 and req.prompt_logprobs
        acc = Accumulator(1)
        acc.add(Piece(["x"], ["length"], 2, [1], True, prompt_logprobs=raw))
        out = completion_body(req, acc, "id", 0)
        shown = out["prompt_logprobs"] if chat else out["choices"][0]["prompt_logprobs"]
        assert shown == [None, json.loads(raw)[1]]


def test_echo_with_logprobs_puts_the_prompts_tokens_first():

    req = _map(json.dumps({"model": "m", "prompt": "ab", "echo": True, "logprobs": 1}).encode(), chat=False)
    acc = Accumulator(1)
    acc.add(Piece(["x"], ["length"], 2, [1], True, prompt_logprobs=json.dumps(
        [{"5": {"logprob": None, "rank": None, "decoded_token": "a"}},
         {"6": {"logprob": -1.5, "rank": 3, "decoded_token": "b"}, "7": {"logprob": -0.5, "rank": 1,
                                                                          "decoded_token": "c"}}]),
        logprobs=[json.dumps([{"8": {"logprob": -0.25, "rank": 1, "decoded_token": "x"}}])]))
    choice = completion_body(req, acc, "id", 0)["choices"][0]
    assert choice["text"] == "abx" and "prompt_logprobs" not in choice
    assert choice["logprobs"] == {"tokens": ["a", "b", "x"], "token_logprobs": [None, -1.5, -0.25],
                                  "top_logprobs": [None, {"b": -1.5, "c": -0.5}, {"x": -0.25}],
                                  "text_offset": [0, 1, 2]}


def test_several_prompts_become_a_batch_of_requests():
    req = _map(json.dumps({"model": "m", "prompt": ["a", "b"], "n": 2}).encode(), chat=False)
    assert req.batch == ["a", "b"] and req.choices == 4
    one, two = split(req)
    assert (one.text_input, one.prompt_token_ids, one.n, one.batch) == ("a", None, 2, [])
    assert (two.text_input, two.prompt_token_ids) == ("b", None)
    ids = split(_map(json.dumps({"model": "m", "prompt": [[1, 2], [3]]}).encode(), chat=False))
    assert [(r.text_input, r.prompt_token_ids) for r in ids] == [(None, [1, 2]), (None, [3])]
    for bad, param in (({"prompt": ["a"] * 257}, "prompt"), ({"prompt": ["a", "b"], "echo": True}, "echo"),
                       ({"prompt": [[1], [2, -1]]}, "prompt[1][1]"), ({"prompt": [[1], []]}, "prompt[1]")):
        with pytest.raises(ApiError) as info:
            _map(json.dumps({"model": "m", **bad}).encode(), chat=False)
        assert info.value.param == param, (bad, info.value.param)


def test_a_batch_merges_its_streams_choice_by_prompt():
    async def stream(k: int) -> AsyncIterator[Piece]:
        await asyncio.sleep(0.01 * (2 - k))  # the second prompt answers first
        yield Piece([f"p{k}a", f"p{k}b"], [], 3 + k, [1, 1], False)
        yield Piece(["!", "?"], ["length", "stop"], 3 + k, [1, 0], True)

    async def run() -> list[Piece]:
        return [p async for p in merged([stream(0), stream(1)], 2)]

    pieces = asyncio.run(run())
    assert pieces[0].texts == ["", "", "p1a", "p1b"]
    acc = Accumulator(4)
    for p in pieces:
        acc.add(p)
    assert acc.texts == ["p0a!", "p0b?", "p1a!", "p1b?"]
    assert acc.reasons == ["length", "stop", "length", "stop"]
    assert acc.num_input == 7 and acc.num_output == [2, 1, 2, 1]


def test_a_failing_prompt_fails_the_batch_and_closes_the_others():
    closed: list[int] = []

    async def slow() -> AsyncIterator[Piece]:
        try:
            yield Piece(["x"], [], 1, [1], False)
            await asyncio.sleep(30)
            yield Piece(["y"], ["stop"], 1, [1], True)
        finally:
            closed.append(0)

    async def failing() -> AsyncIterator[Piece]:
        await asyncio.sleep(0.05)
        raise ApiError(400, "no", "invalid_request_error")
        yield  # an async generator

    async def run() -> None:
        async for _ in merged([slow(), failing()], 1):
            pass

    with pytest.raises(ApiError):
        asyncio.run(asyncio.wait_for(run(), 10))
    assert closed == [0]


def test_key_cap_refuses_above_and_is_the_default():
    with pytest.raises(ApiError) as info:
        _map(_chat(max_tokens=9), cap=8)
    assert info.value.param == "max_tokens" and "8" in info.value.message
    assert _map(_chat(), cap=8).sampling == {"max_tokens": 8}
    assert _map(_chat(max_tokens=4), cap=8).sampling == {"max_tokens": 4}


# --- error objects and upstream classification ------------------------------

def test_error_object_shape():
    body = json.loads(ApiError(400, "m", param="p", code="c").json())
    assert body == {"error": {"message": "m", "type": "invalid_request_error", "param": "p", "code": "c"}}


@pytest.mark.parametrize(("message", "status"), [
    ("sampling parameter 'temperature' must be >= 0", 400),
    ("the model's engine stopped (EngineCore died); the server is restarting; retry shortly", 503),
    ("the model is shutting down; retry on another instance", 503),
    ("internal error: KeyError; the server log has the details", 500),
    # Triton's answers while the model unloads (stop) or before it loads: this upstream
    # does not serve it now; the pool retries elsewhere.
    ("Request for unknown model: 'x' is not found", 503),
    ("Request for unknown model: 'tiny' has no available versions", 503),
    ("Server not ready", 503),
    ("Model is unavailable due to unhealthy vLLM engine", 503),
    # Triton's python backend missed one request (its stub's health thread waited a
    # second for a core): the pool tries it again and keeps the upstream in service.
    ("Stub process 'tiny_0_0' is not healthy.", 503),
    ("Stub process is not healthy.", 503),
    # A client's text echoed in the backend's error never makes an upstream unavailable.
    ("invalid sampling parameters: unknown parameter 'the model is shutting down'", 400),
    ("input 'x: engine stopped; Server not ready; Request for unknown model: ' is not an input", 400),
])
def test_backend_errors_are_classified(message, status):
    err = classify(message)
    assert err.status == status and err.message == message
    assert isinstance(err, NotStarted) == message.startswith("Stub process ")
    assert isinstance(err, Draining) == (status == 503 and not message.startswith("Stub process "))


# --- keys --------------------------------------------------------------------

def test_keys_from_yaml_and_json_authenticate():
    yml = f"keys:\n  - name: a\n    sha256: {hash_key(KEY)}\n    max_tokens: 5\n"
    for text in (yml, json.dumps({"keys": [{"name": "a", "sha256": hash_key(KEY), "max_tokens": 5}]})):
        store = KeyStore(parse_keys(text))
        key = store.authenticate(f"Bearer {KEY}")
        assert key.name == "a" and key.max_tokens == 5


@pytest.mark.parametrize("header", [None, "", "Bearer", "Basic abc", f"Bearer {KEY}x", "Bearer wrong"])
def test_missing_or_wrong_key_is_401(header):
    store = KeyStore(parse_keys(json.dumps({"keys": [{"name": "a", "sha256": hash_key(KEY)}]})))
    with pytest.raises(ApiError) as info:
        store.authenticate(header)
    assert info.value.status == 401 and info.value.type == "authentication_error"


@pytest.mark.parametrize(("text", "names"), [
    ("keys: [{name: a}]", "keys[0].sha256"),
    ("keys: [{name: a, sha256: abc}]", "keys[0].sha256"),
    (f"keys: [{{name: 'a b', sha256: {hash_key(KEY)}}}]", "keys[0].name"),
    (f"keys: [{{name: a, sha256: {hash_key(KEY)}, key: x}}]", "unknown field"),
    (f"keys: [{{name: a, sha256: {hash_key(KEY)}, max_tokens: 0}}]", "keys[0].max_tokens"),
    (f"keys: [{{name: a, sha256: {hash_key(KEY)}}}, {{name: a, sha256: {hash_key(KEY + 'x')}}}]", "twice"),
    ("[]", "'keys' list"),
    ("keys: [", "neither JSON nor YAML"),
    (f"keys: [{{name: a, sha256: {hash_key(KEY)}, models: []}}]", "keys[0].models"),
    (f"keys: [{{name: a, sha256: {hash_key(KEY)}, models: tiny}}]", "keys[0].models"),
])
def test_bad_keys_files_name_the_entry(text, names):
    with pytest.raises(KeysError, match=names.replace("[", r"\[").replace("]", r"\]")):
        parse_keys(text)


def test_hash_key_cli_reads_stdin(monkeypatch, capsys):
    import io

    from llmhost.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(KEY + "\n"))
    assert main(["gateway", "hash-key"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == hash_key(KEY) and KEY not in out
    monkeypatch.setattr("sys.stdin", io.StringIO("short\n"))
    assert main(["gateway", "hash-key"]) == 2


# --- Triton wire format ---------------------------------------------------------

def test_build_request_carries_inputs_and_asks_for_the_final_flag():
    req = _map(_chat(max_tokens=3, stream=True))
    msg = build_request(req, "rid")
    names = [t.name for t in msg.inputs]
    assert names[:2] == ["messages", "sampling_parameters"] and "text_input" not in names
    assert msg.parameters["triton_enable_empty_final_response"].bool_param
    assert msg.parameters["sparse_outputs"].bool_param  # finish_reason/num_input_tokens only where they say something
    raw = dict(zip(names, msg.raw_input_contents, strict=True))
    assert json.loads(raw["sampling_parameters"][4:]) == {"max_tokens": 3}
    assert raw["stream"] == b"\x01" and raw["return_num_output_tokens"] == b"\x01"


def test_parse_response_reads_outputs():
    import struct

    from tritonclient.grpc import service_pb2

    resp = service_pb2.ModelInferResponse()
    for name, dtype, raw in (("text_output", "BYTES", struct.pack("<I", 2) + b"ab" + struct.pack("<I", 1) + b"c"),
                             ("finish_reason", "BYTES", struct.pack("<I", 6) + b"length" + struct.pack("<I", 0)),
                             ("num_input_tokens", "UINT32", struct.pack("<I", 4)),
                             ("num_output_tokens", "UINT32", struct.pack("<2I", 5, 6))):
        out = resp.outputs.add()
        out.name, out.datatype = name, dtype
        resp.raw_output_contents.append(raw)
    resp.parameters["triton_final_response"].bool_param = True
    assert parse_response(resp) == Piece(["ab", "c"], ["length", ""], 4, [5, 6], True)


# --- SSE chunks ------------------------------------------------------------------

def _events(data: bytes) -> list[Any]:
    out = []
    for block in data.decode().split("\n\n"):
        if block:
            assert block.startswith("data: ")
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def _pieces(*pieces: Piece) -> AsyncIterator[Piece]:
    for p in pieces:
        yield p


def _collect(req: BackendRequest, pieces: list[Piece]) -> list[Any]:
    async def run() -> bytes:
        return b"".join([c async for c in stream_chunks(req, pieces[0], _pieces(*pieces[1:]), "id1")])

    return _events(asyncio.run(run()))


def test_chat_chunks_role_content_finish_usage_done():
    req = _map(_chat(stream=True, stream_options={"include_usage": True}))
    # Output tokens per response (1 + 1); "None": the backend's reason for a running completion.
    events = _collect(req, [Piece(["He"], ["None"], 3, [1], False), Piece(["llo"], ["length"], 3, [1], True)])
    assert events[-1] == "[DONE]"
    first, a, b, last = events[:-1]
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert a["choices"][0]["delta"] == {"content": "He"} and a["usage"] is None
    assert b["choices"][0]["delta"] == {"content": "llo"} and b["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                                       "total_tokens": 5}


def test_completion_chunks_without_usage_and_with_n2():
    req = _map(json.dumps({"model": "m", "prompt": "p", "stream": True, "n": 2}).encode(), chat=False)
    events = _collect(req, [Piece(["a", ""], [], 1, [1, 0], False), Piece(["b", "c"], ["stop", "length"], 1,
                                                                          [1, 1], True)])
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    assert events[0]["choices"] == [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in events[1]["choices"]] == [
        (0, "b", "stop"), (1, "c", "length")]
    assert events[0]["object"] == "text_completion"


@pytest.mark.parametrize("chat", [True, False])
def test_a_choice_finished_before_the_others_gets_its_finish_reason_once(chat):
    """With n=2 the backend may finish one completion a response before the other; its
    reason then comes again in the later responses (finish_reason [length, None], then
    [length, length]). Each choice gets one chunk with a finish_reason, as from vLLM."""
    body: dict[str, Any] = {"model": "m", "stream": True, "n": 2, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "p"}]} if chat else {"prompt": "p"})
    req = _map(json.dumps(body).encode(), chat=chat)
    events = _collect(req, [Piece(["a", "b"], [], 2, [1, 1], False),
                            Piece(["c", "d"], ["length", "None"], None, [1, 1], False),
                            Piece(["", "e"], ["length", "length"], 2, [0, 1], True)])
    reasons = [(c["index"], c["finish_reason"]) for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert reasons == [(0, "length"), (1, "length")], events
    assert events[-2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}


@pytest.mark.parametrize("chat", [True, False])
def test_chunks_are_compact_json_even_with_a_model_name_that_looks_like_json(chat):
    # Each chunk's envelope is encoded once per request: its bytes must still be
    # exactly json.dumps of the whole chunk, whatever the strings hold.
    body: dict[str, Any] = {"model": 'm","choices":[]', "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "p"})
    req = _map(json.dumps(body).encode(), chat=chat)

    async def run() -> list[bytes]:
        pieces = [Piece(['a"\u00e9\n'], ["None"], 2, [1], False), Piece(["b"], ["length"], 2, [1], True)]
        return [c async for c in stream_chunks(req, pieces[0], _pieces(*pieces[1:]), "id1")]

    chunks = asyncio.run(run())
    assert chunks[-1] == b"data: [DONE]\n\n" and len(chunks) == (5 if chat else 4)
    for data in chunks[:-1]:
        event = json.loads(data[len(b"data: "):])
        assert data == b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
        assert event["model"] == 'm","choices":[]' and "usage" in event


def test_a_completions_new_tokens_get_a_chunk_before_their_text_decodes():
    # The first token is half of a UTF-8 character: no text yet, one token more.
    req = _map(json.dumps({"model": "m", "prompt": "p", "stream": True}).encode(), chat=False)
    events = _collect(req, [Piece([""], [], 1, [1], False), Piece(["\u00e9"], [], 1, [1], False),
                            Piece([""], [], 1, [0], False), Piece([""], ["stop"], 1, [0], True)])
    assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events[:-1]] == [
        ("", None), ("\u00e9", None), ("", "stop")]
    # Chat sends content only: an empty delta for an undecoded token is left out.
    chat = _collect(_map(_chat(stream=True)), [Piece([""], [], 1, [1], False), Piece(["x"], ["stop"], 1, [1], True)])
    assert [e["choices"][0]["delta"] for e in chat[:-1]] == [{"role": "assistant", "content": ""}, {"content": "x"}]


def test_an_error_mid_stream_is_an_error_event():
    async def failing() -> AsyncIterator[Piece]:
        yield Piece(["x"], [], 1, [1], False)
        raise unavailable("the inference server is not reachable; retry shortly")

    req = _map(_chat(stream=True))

    async def run() -> bytes:
        return b"".join([c async for c in stream_chunks(req, None, failing(), "id")])

    events = _events(asyncio.run(run()))
    assert events[-2]["error"]["code"] == "upstream_unavailable" and events[-1] == "[DONE]"


# --- the app against a fake upstream ------------------------------------------------

class FakeUpstream:
    def __init__(self) -> None:
        self.seen: list[BackendRequest] = []

    async def model_ready(self, model: str) -> bool:
        return True

    async def generate(self, req: BackendRequest) -> AsyncIterator[Piece]:
        self.seen.append(req)
        if req.sampling.get("temperature") == 1.5:
            raise classify("sampling parameter 'x' is bad")
        yield Piece(["hello"], ["stop"], 2, [1], True)


def _app(fake: FakeUpstream, max_body: int = 1024) -> httpx.AsyncClient:
    keys = KeyStore(parse_keys(json.dumps({"keys": [{"name": "a", "sha256": hash_key(KEY)}]})))
    app = create_app(GatewayConfig(upstreams=["x:1"], models=["m"], max_body_bytes=max_body), keys, fake)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                             headers={"Authorization": f"Bearer {KEY}"})


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_app_answers_models_chat_and_errors():
    fake = FakeUpstream()

    async def run() -> None:
        async with _app(fake) as c:
            r = await c.get("/v1/models")
            assert r.json() == {"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                            "owned_by": "llmhost"}]}
            r = await c.get("/v1/models/m")
            assert r.json() == {"id": "m", "object": "model", "created": 0, "owned_by": "llmhost"}
            r = await c.get("/v1/models/other")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await c.post("/v1/chat/completions", content=_chat())
            body = r.json()
            assert r.status_code == 200 and body["choices"][0]["message"]["content"] == "hello"
            assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
            r = await c.post("/v1/chat/completions", content=_chat(temperature=1.5))
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            r = await c.post("/v1/chat/completions", content=_chat(model="other"))
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await c.post("/v1/completions", content=b"x" * 2000)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = await c.post("/v1/completions", content=_chat(), headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            r = await c.get("/v2/models/m/config")
            assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
            r = await c.get("/v1/chat/completions")
            assert r.status_code == 405 and "error" in r.json()
            r = await c.post("/v1/chat/completions", content=_chat(stream=True))
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert "content-length" not in r.headers
            assert r.text.endswith("data: [DONE]\n\n")

    _run(run())
    assert len(fake.seen) == 3  # 401, 404 and 413 never reach the upstream


def test_app_checks_the_body_size_before_reading_it_all():
    fake = FakeUpstream()

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(100):
            yield b"x" * 100

    async def run() -> None:
        async with _app(fake, max_body=500) as c:
            r = await c.post("/v1/completions", content=chunks())
            assert r.status_code == 413

    _run(run())
    assert fake.seen == []


class HangingUpstream(FakeUpstream):
    """Sends one piece (or none), then waits forever; records being cancelled."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.cancelled = asyncio.Event()
        self.waiting = asyncio.Event()

    async def generate(self, req: BackendRequest) -> AsyncIterator[Piece]:
        try:
            if self.first:
                yield Piece(["x"], [], 1, [1], False)
            self.waiting.set()
            await asyncio.Event().wait()
            yield Piece([], [], 1, [1], True)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.cancelled.set()


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_the_upstream_request(stream):
    fake = HangingUpstream(first=stream)
    keys = KeyStore(parse_keys(json.dumps({"keys": [{"name": "a", "sha256": hash_key(KEY)}]})))
    app = create_app(GatewayConfig(upstreams=["x:1"], models=["m"]), keys, fake)  # type: ignore[arg-type]
    body = _chat(stream=stream)

    async def run() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"",
                 "query_string": b"", "root_path": "", "server": ("gw", 80), "client": ("c", 1),
                 "headers": [(b"authorization", f"Bearer {KEY}".encode()),
                             (b"content-length", str(len(body)).encode())]}
        task = asyncio.ensure_future(app(scope, receive, send))
        await asyncio.wait_for(fake.waiting.wait(), 10)  # in flight, waiting on the upstream
        for _ in range(100):  # let a streamed chunk reach the client
            await asyncio.sleep(0)
        assert not fake.cancelled.is_set() and not task.done()
        gone.set()
        await asyncio.wait_for(task, 10)
        await asyncio.wait_for(fake.cancelled.wait(), 10)
        return sent

    sent = _run(run())
    assert fake.cancelled.is_set()
    pool = app.state.gateway.pool
    assert [(u["target"], u["up"], u["outstanding"]) for u in pool.view()] == [("x:1", True, 0)]  # slot free again
    if stream:
        assert sent[0]["status"] == 200 and b'"content":"x"' in b"".join(m.get("body", b"") for m in sent)


def test_an_unreachable_upstream_is_503():
    from llmhost.gateway.upstreams.client import Upstream
    from tests.harness.net import free_port

    up = Upstream(f"127.0.0.1:{free_port()}", timeout_s=2)

    async def run() -> tuple[ApiError, ApiError]:
        with pytest.raises(ApiError) as ready:
            await up.model_ready("m")
        req = _map(_chat())
        with pytest.raises(ApiError) as gen:
            async for _ in up.generate(req):
                pass
        await up.close()
        return ready.value, gen.value

    ready, gen = _run(run())
    assert ready.status == 503 and gen.status == 503 and gen.type == "service_unavailable_error"


@pytest.mark.parametrize(("text", "expected"), [
    (None, "cannot read the keys file"),
    ("keys: []\n", "holds no keys"),
    ("keys: [{name: a, sha256: nothex}]\n", "keys[0].sha256"),
])
def test_gateway_cli_refuses_a_bad_keys_file(tmp_path, capsys, text, expected):
    from llmhost.cli import main

    path = tmp_path / "keys.yml"
    if text is not None:
        path.write_text(text)
    assert main(["gateway", "--keys-file", str(path), "--model", "m"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


@pytest.mark.parametrize("bad", [["--upstream", "nohost"], ["--listen", "127.0.0.1:0"], ["--max-body-bytes", "0"]])
def test_gateway_cli_refuses_bad_options_by_name(tmp_path, capsys, bad):
    from llmhost.cli import main

    with pytest.raises(SystemExit) as info:
        main(["gateway", "--keys-file", str(tmp_path / "k"), "--model", "m", *bad])
    assert info.value.code == 2
    assert bad[0] in capsys.readouterr().err


# The backend's logprobs output for one completion: per token, the sampled token first.
_LOGPROBS_AB = json.dumps([{"5": {"logprob": -0.5, "rank": 2, "decoded_token": "a"},
                            "7": {"logprob": -0.25, "rank": 1, "decoded_token": "b"}},
                           {"9": {"logprob": float("-inf"), "rank": 1, "decoded_token": "\u00e9"}}])


def test_chat_logprobs_are_openais_shape_in_vllms_order():
    req = _map(_chat(logprobs=True, top_logprobs=1))
    acc = Accumulator(1)
    acc.add(Piece(["a\u00e9"], ["length"], 2, [2], True, logprobs=[_LOGPROBS_AB]))
    content = completion_body(req, acc, "id", 0)["choices"][0]["logprobs"]["content"]
    assert content == [
        {"token": "a", "logprob": -0.5, "bytes": [97],
         "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}]},
        {"token": "\u00e9", "logprob": -9999.0, "bytes": [195, 169],
         "top_logprobs": [{"token": "\u00e9", "logprob": -9999.0, "bytes": [195, 169]}]}]
    assert completion_body(_map(_chat()), acc, "id", 0)["choices"][0]["logprobs"] is None


def test_completion_logprobs_have_top_plus_one_and_text_offsets_across_chunks():
    req = _map(json.dumps({"model": "m", "prompt": "p", "logprobs": 1, "stream": True}).encode(), chat=False)
    events = _collect(req, [Piece(["a"], [], 1, [1], False, logprobs=[json.dumps(json.loads(_LOGPROBS_AB)[:1])]),
                            Piece(["\u00e9"], ["length"], 1, [1], True,
                                  logprobs=[json.dumps(json.loads(_LOGPROBS_AB)[1:])])])
    first, second = (e["choices"][0]["logprobs"] for e in events[:-1])
    assert first == {"text_offset": [0], "token_logprobs": [-0.5], "tokens": ["a"],
                     "top_logprobs": [{"a": -0.5, "b": -0.25}]}
    assert second == {"text_offset": [1], "token_logprobs": [-9999.0], "tokens": ["\u00e9"],
                      "top_logprobs": [{"\u00e9": -9999.0}]}


def test_a_chat_stream_with_logprobs_sends_tokens_whose_text_is_not_yet_whole():
    req = _map(_chat(logprobs=True, stream=True))
    events = _collect(req, [Piece([""], [], 1, [1], False, logprobs=[json.dumps(json.loads(_LOGPROBS_AB)[1:])]),
                            Piece(["x"], ["stop"], 1, [1], True, logprobs=["[]"])])
    tokens = [e["choices"][0] for e in events[1:-1]]
    assert tokens[0]["delta"] == {} and tokens[0]["logprobs"]["content"][0]["token"] == "\u00e9"


def test_echo_puts_the_prompt_before_each_completion_streamed_and_not():
    req = _map(json.dumps({"model": "m", "prompt": "Say:", "echo": True, "n": 2}).encode(), chat=False)
    acc = Accumulator(2)
    acc.add(Piece([" a", " b"], ["length", "length"], 2, [1, 1], True))
    assert [c["text"] for c in completion_body(req, acc, "id", 0)["choices"]] == ["Say: a", "Say: b"]
    streamed = _map(json.dumps({"model": "m", "prompt": "Say:", "echo": True, "stream": True}).encode(), chat=False)
    events = _collect(streamed, [Piece([" a"], [], 2, [1], False), Piece([" b"], ["length"], 2, [1], True)])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Say: a b"


def _completion(**kw: Any) -> bytes:
    return json.dumps({"model": "m", **kw}).encode()


def test_a_prompt_of_token_ids_reaches_the_backend_on_both_paths():
    for prompt in ([5, 0, 7], [[5, 0, 7]]):
        req = _map(_completion(prompt=prompt), chat=False)
        assert req.prompt_token_ids == [5, 0, 7] and req.text_input is None
    line = json.loads(socket_request(req, "r"))
    assert line["inputs"]["prompt_token_ids"] == [5, 0, 7] and "text_input" not in line["inputs"]
    msg = build_request(req, "r")
    ids = next(i for i, t in enumerate(msg.inputs) if t.name == "prompt_token_ids")
    assert msg.inputs[ids].datatype == "INT64" and list(msg.inputs[ids].shape) == [3]
    assert msg.raw_input_contents[ids] == struct.pack("<3q", 5, 0, 7)


@pytest.mark.parametrize(("prompt", "extra", "param"), [
    ([], {}, "prompt"), ([[]], {}, "prompt"), ([1, -2], {}, "prompt[1]"), ([1 << 63], {}, "prompt[0]"),
    ([1, "a"], {}, "prompt"), ([[1], [2]], {"echo": True}, "echo"), ([1, 2], {"echo": True}, "echo"),
    ([1.5], {}, "prompt"),
])
def test_bad_token_id_prompts_are_refused_by_name(prompt, extra, param):
    with pytest.raises(ApiError) as info:
        _map(_completion(prompt=prompt, **extra), chat=False)
    assert info.value.status == 400 and (info.value.param or "").startswith(param), (info.value.param, param)
