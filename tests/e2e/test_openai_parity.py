"""The gateway against vLLM's own OpenAI server (`vllm serve`) on the same tiny model
and engine arguments: at temperature 0, the same tokens, log probabilities (within
1e-3) and shapes, streamed and not, through the official `openai` client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests

from tests.harness.gateway import KEY, keyed_gateway, openai_client, stop_gateway
from tests.harness.net import CLIENT_TIMEOUT_S
from tests.harness.vllm_server import VllmServer

PROMPT = "def fibonacci(n):"
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def theirs(vllm_tiny: VllmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_tiny.url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)


@pytest.fixture(scope="module")
def ours(server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with openai_client(server, tmp_path_factory.mktemp("parity-gateway")) as client:
        yield client


def _close(a: list[float | None], b: list[float | None]) -> bool:
    return len(a) == len(b) and all(x == y or (x is not None and y is not None and abs(x - y) <= TOLERANCE)
                                    for x, y in zip(a, b, strict=True))


def _same_completion_logprobs(a: Any, b: Any) -> None:
    assert a.tokens == b.tokens
    assert a.text_offset == b.text_offset
    assert _close(a.token_logprobs, b.token_logprobs), (a.token_logprobs, b.token_logprobs)
    for mine, vllms in zip(a.top_logprobs, b.top_logprobs, strict=True):
        assert mine.keys() == vllms.keys()
        assert _close([mine[k] for k in mine], [vllms[k] for k in mine]), (mine, vllms)


def _same_chat_logprobs(a: list[Any], b: list[Any]) -> None:
    assert [t.token for t in a] == [t.token for t in b]
    assert [t.bytes for t in a] == [t.bytes for t in b]
    assert _close([t.logprob for t in a], [t.logprob for t in b])
    for mine, vllms in zip(a, b, strict=True):
        assert [t.token for t in mine.top_logprobs] == [t.token for t in vllms.top_logprobs]
        assert _close([t.logprob for t in mine.top_logprobs], [t.logprob for t in vllms.top_logprobs])


def _streamed_completion_logprobs(client: openai.OpenAI, **kw: Any) -> tuple[str, dict[str, list[Any]]]:
    text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                for name in merged:
                    merged[name] += getattr(choice.logprobs, name) or []
    return text, merged


def test_completion_logprobs_match_vllm_serve_streamed_and_not(ours, theirs, server):
    kw: dict[str, Any] = {"model": server.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    mine, vllms = ours.completions.create(**kw), theirs.completions.create(**kw)
    assert mine.choices[0].text == vllms.choices[0].text
    assert len(mine.choices[0].logprobs.tokens) == 8
    _same_completion_logprobs(mine.choices[0].logprobs, vllms.choices[0].logprobs)
    assert all(len(top) <= 4 for top in mine.choices[0].logprobs.top_logprobs)
    # Streamed: the chunks' log probabilities add up to the same, offsets running on.
    (text, streamed), (vllm_text, vllm_streamed) = (_streamed_completion_logprobs(c, **kw) for c in (ours, theirs))
    assert text == vllm_text == mine.choices[0].text
    assert streamed["tokens"] == vllm_streamed["tokens"] == mine.choices[0].logprobs.tokens
    assert streamed["text_offset"] == vllm_streamed["text_offset"] == mine.choices[0].logprobs.text_offset
    assert _close(streamed["token_logprobs"], vllm_streamed["token_logprobs"])


def test_chat_logprobs_match_vllm_serve_streamed_and_not(ours, theirs, server):
    kw: dict[str, Any] = {"model": server.name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
                          "temperature": 0, "logprobs": True, "top_logprobs": 2}
    mine, vllms = ours.chat.completions.create(**kw), theirs.chat.completions.create(**kw)
    assert mine.choices[0].message.content == vllms.choices[0].message.content
    assert len(mine.choices[0].logprobs.content) == 8
    _same_chat_logprobs(mine.choices[0].logprobs.content, vllms.choices[0].logprobs.content)
    streamed = [t for chunk in ours.chat.completions.create(stream=True, **kw) for c in chunk.choices
                if c.logprobs is not None for t in c.logprobs.content or []]
    _same_chat_logprobs(streamed, vllms.choices[0].logprobs.content)
    # Without top_logprobs: the sampled tokens' log probabilities alone.
    kw.pop("top_logprobs")
    mine = ours.chat.completions.create(**kw)
    assert [t.top_logprobs for t in mine.choices[0].logprobs.content] == [[]] * 8


def test_echo_matches_vllm_serve_streamed_and_not(ours, theirs, server):
    kw: dict[str, Any] = {"model": server.name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True}
    mine, vllms = ours.completions.create(**kw), theirs.completions.create(**kw)
    assert mine.choices[0].text == vllms.choices[0].text and mine.choices[0].text.startswith(PROMPT)
    streamed = "".join(c.text for chunk in ours.completions.create(stream=True, **kw) for c in chunk.choices)
    assert streamed == mine.choices[0].text


def _same_prompt_logprobs(mine: list[Any], vllms: list[Any]) -> None:
    assert mine[0] is None and vllms[0] is None and len(mine) == len(vllms) > 1
    for a, b in zip(mine[1:], vllms[1:], strict=True):
        assert list(a) == list(b)  # the same token ids, the prompt's own first
        assert [(e["rank"], e["decoded_token"]) for e in a.values()] == [
            (e["rank"], e["decoded_token"]) for e in b.values()]
        assert _close([e["logprob"] for e in a.values()], [e["logprob"] for e in b.values()]), (a, b)


def test_prompt_logprobs_and_echo_with_logprobs_match_vllm_serve(ours, theirs, server):
    chat = {"model": server.name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
            "temperature": 0, "extra_body": {"prompt_logprobs": 1}}
    mine, vllms = (c.chat.completions.create(**chat).model_dump() for c in (ours, theirs))
    _same_prompt_logprobs(mine["prompt_logprobs"], vllms["prompt_logprobs"])
    assert mine["choices"][0]["message"]["content"] == vllms["choices"][0]["message"]["content"]

    completion = {"model": server.name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                  "extra_body": {"prompt_logprobs": 2}}
    mine, vllms = (c.completions.create(**completion).model_dump() for c in (ours, theirs))
    _same_prompt_logprobs(mine["choices"][0]["prompt_logprobs"], vllms["choices"][0]["prompt_logprobs"])

    # echo with logprobs (how evaluation harnesses score a text): the prompt's tokens first.
    echo = {"model": server.name, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    mine, vllms = ours.completions.create(**echo), theirs.completions.create(**echo)
    assert mine.choices[0].text == vllms.choices[0].text
    a, b = mine.choices[0].logprobs, vllms.choices[0].logprobs
    assert a.tokens == b.tokens and a.text_offset == b.text_offset and len(a.tokens) > 3
    assert a.token_logprobs[0] is None and b.token_logprobs[0] is None
    assert _close(a.token_logprobs, b.token_logprobs), (a.token_logprobs, b.token_logprobs)
    assert a.top_logprobs[0] is None and b.top_logprobs[0] is None
    for x, y in zip(a.top_logprobs[1:], b.top_logprobs[1:], strict=True):
        assert x.keys() == y.keys() and _close(list(x.values()), [y[k] for k in x]), (x, y)

    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        ours.completions.create(**{**completion, "stream": True})


def test_a_prompt_of_token_ids_matches_vllm_serve_on_both_paths(ours, theirs, server, tiny_model, tmp_path):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model).encode(PROMPT)
    kw: dict[str, Any] = {"model": server.name, "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    vllms = theirs.completions.create(**kw)
    # The engine socket (ours) and gRPC (a gateway without sockets) give the same.
    grpc = keyed_gateway(server, tmp_path)
    try:
        over_grpc = openai.OpenAI(base_url=grpc.url, api_key=KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S)
        for client in (ours, over_grpc):
            mine = client.completions.create(**kw)
            assert mine.choices[0].text == vllms.choices[0].text
            assert mine.usage.prompt_tokens == vllms.usage.prompt_tokens == len(ids)
            _same_completion_logprobs(mine.choices[0].logprobs, vllms.choices[0].logprobs)
        # An id outside the vocabulary is the client's error, named.
        with pytest.raises(openai.BadRequestError) as info:
            over_grpc.completions.create(**{**kw, "prompt": [1, 10 ** 9]})
        assert "prompt_token_ids" in str(info.value) and "vocabulary" in str(info.value)
    finally:
        stop_gateway(grpc.proc, grpc.log)


def test_several_prompts_match_vllm_serve_streamed_and_not(ours, theirs, server):
    prompts = [PROMPT, "import os", "class A:"]
    kw: dict[str, Any] = {"model": server.name, "prompt": prompts, "max_tokens": 5, "temperature": 0}
    mine, vllms = ours.completions.create(**kw), theirs.completions.create(**kw)
    assert [(c.index, c.text, c.finish_reason) for c in mine.choices] == [
        (c.index, c.text, c.finish_reason) for c in sorted(vllms.choices, key=lambda c: c.index)]
    assert len(mine.choices) == 3 and mine.usage == vllms.usage
    # n choices per prompt, prompt by prompt; streamed, every choice's chunks carry its index.
    kw.update(n=2, temperature=1.0, extra_body={"ignore_eos": True})
    finished: dict[int, str] = {}
    usage = None
    for chunk in ours.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            if c.finish_reason is not None:
                finished[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert finished == dict.fromkeys(range(6), "length")
    assert usage is not None and usage.completion_tokens == 6 * 5
    assert usage.prompt_tokens == mine.usage.prompt_tokens


# -- Sampling and output fields, each as vLLM's server answers it --------------------------

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
CHAT_FIELDS: dict[str, dict[str, Any]] = {
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}},
    "structured_choice": {"extra_body": {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}},
    "structured_regex": {"extra_body": {"structured_outputs": {"regex": "[a-z]{3,8}"}}},
    "structured_grammar": {"extra_body": {"structured_outputs": {"grammar": 'root ::= "up" | "down" | "left"'}}},
    "max_completion_tokens": {"max_completion_tokens": 5, "extra_body": {"ignore_eos": True}},
    "skip_special_tokens": {"extra_body": {"skip_special_tokens": False, "ignore_eos": True}},
}


@pytest.mark.parametrize("field", list(CHAT_FIELDS))
def test_chat_fields_match_vllm_serve_streamed_and_not(ours, theirs, server, field):
    kw: dict[str, Any] = {"model": server.name, "messages": [{"role": "user", "content": PROMPT}],
                          "max_tokens": 12, "temperature": 0, "logprobs": True, **CHAT_FIELDS[field]}
    mine, vllms = ours.chat.completions.create(**kw), theirs.chat.completions.create(**kw)
    said = (mine.choices[0].message.content, mine.choices[0].finish_reason, mine.usage.completion_tokens)
    assert said == (vllms.choices[0].message.content, vllms.choices[0].finish_reason,
                    vllms.usage.completion_tokens), (said, vllms)
    _same_chat_logprobs(mine.choices[0].logprobs.content, vllms.choices[0].logprobs.content)

    def streamed(client: openai.OpenAI) -> tuple[str, str | None]:
        text, reason = "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                reason = choice.finish_reason or reason
        return text, reason

    assert streamed(ours) == streamed(theirs) == (said[0] or "", said[1])


def test_stop_token_ids_and_stop_strings_match_vllm_serve(ours, theirs, server):
    kw: dict[str, Any] = {"model": server.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    free = theirs.completions.create(**kw, logprobs=0, extra_body={"return_tokens_as_token_ids": True,
                                                                   "ignore_eos": True})
    third = int(free.choices[0].logprobs.tokens[2].removeprefix("token_id:"))
    cases = [{"extra_body": {"stop_token_ids": [third]}},
             {"extra_body": {"stop_token_ids": [third], "include_stop_str_in_output": True}}]
    text = theirs.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    if len(text) > 4:  # a stop string from the answer's own text, kept in the output or not
        cases += [{"stop": [text[2:4]]}, {"stop": [text[2:4]], "extra_body": {"include_stop_str_in_output": True}}]
    for case in cases:
        mine, vllms = ours.completions.create(**kw, **case), theirs.completions.create(**kw, **case)
        assert (mine.choices[0].text, mine.choices[0].finish_reason, mine.usage.completion_tokens) == (
            vllms.choices[0].text, vllms.choices[0].finish_reason, vllms.usage.completion_tokens), (case, mine, vllms)
        assert mine.choices[0].finish_reason == "stop", (case, mine)


def test_n_streamed_and_a_seed_match_vllm_serve(ours, theirs, server):
    kw: dict[str, Any] = {"model": server.name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
                          "n": 2, "extra_body": {"ignore_eos": True}}

    def streamed(client: openai.OpenAI, **more: Any) -> dict[int, str]:
        texts: dict[int, str] = {}
        for chunk in client.chat.completions.create(stream=True, **kw, **more):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        return texts

    # Sampled with a seed: vLLM's per-request generators, the same on both servers.
    seeded = streamed(ours, temperature=1.0, seed=1234)
    assert seeded == streamed(theirs, temperature=1.0, seed=1234) and set(seeded) == {0, 1}, seeded
    assert all(seeded.values()), seeded
    # Greedy sampling takes one completion: both refuse n=2 at temperature 0.
    for client in (ours, theirs):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**kw, temperature=0)
        assert "greedy" in str(info.value), info.value
    one = {"model": server.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 1234,
           "extra_body": {"ignore_eos": True}}
    assert ours.completions.create(**one).choices[0].text == theirs.completions.create(**one).choices[0].text


def _token_ids(client: openai.OpenAI, **kw: Any) -> tuple[str, list[int]]:
    """A completion's text and its tokens' ids (vLLM's server names them 'token_id:N')."""
    extra = {**kw.pop("extra_body", {}), "return_tokens_as_token_ids": True}
    out = client.completions.create(**kw, logprobs=0, extra_body=extra)
    return out.choices[0].text, [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def test_logit_bias_bad_words_and_allowed_token_ids_match_vllm_serve(ours, theirs, server, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    kw: dict[str, Any] = {"model": server.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                          "extra_body": {"ignore_eos": True}}
    free, free_ids = _token_ids(theirs, **kw)
    # +100 on one token the free answer never picks: every token is that one.
    forced = next(t for t in tokenizer.encode(" hello world") if t not in free_ids)
    biased = {**kw, "logit_bias": {str(forced): 100}}
    text, ids = _token_ids(theirs, **biased)
    assert ids == [forced] * 8 and ours.completions.create(**biased).choices[0].text == text == tokenizer.decode(ids)
    # Only two tokens allowed: the answer holds no other.
    allowed = sorted(set(tokenizer.encode(" x = 1")))[:2]
    only = {**kw, "extra_body": {**kw["extra_body"], "allowed_token_ids": allowed}}
    text, ids = _token_ids(theirs, **only)
    assert set(ids) <= set(allowed) and ours.completions.create(**only).choices[0].text == text
    # A word of the free answer, banned: the answer changes, as vLLM's does.
    word = tokenizer.decode([free_ids[0]]).strip() or tokenizer.decode([free_ids[1]]).strip()
    banned = {**kw, "extra_body": {**kw["extra_body"], "bad_words": [word]}}
    mine = ours.completions.create(**banned).choices[0].text
    assert mine == theirs.completions.create(**banned).choices[0].text and mine != free, (word, mine, free)
    # On chat too, streamed and not.
    chat: dict[str, Any] = {"model": server.name, "messages": [{"role": "user", "content": PROMPT}],
                            "max_tokens": 6, "temperature": 0, "logit_bias": {str(forced): 100},
                            "extra_body": {"ignore_eos": True, "bad_words": [word]}}
    said = ours.chat.completions.create(**chat).choices[0].message.content
    assert said == theirs.chat.completions.create(**chat).choices[0].message.content == tokenizer.decode([forced] * 6)
    streamed = "".join(c.choices[0].delta.content or "" for c in ours.chat.completions.create(stream=True, **chat)
                       if c.choices)
    assert streamed == said


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids"])
def test_a_token_id_outside_the_vocabulary_is_a_400_naming_the_field_as_in_vllm(ours, theirs, server, field):
    outside = 10 ** 6  # the tiny model has 4,096 tokens
    extra = {"logit_bias": {str(outside): 5}} if field == "logit_bias" else {"allowed_token_ids": [1, outside]}
    kw: dict[str, Any] = {"model": server.name, "prompt": PROMPT, "max_tokens": 4, "extra_body": extra}
    for client in (ours, theirs):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**kw)
        assert field in str(info.value) and "Traceback" not in str(info.value), info.value
    # The server goes on serving.
    assert ours.completions.create(model=server.name, prompt=PROMPT, max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize("chat", [True, False])
def test_continuous_usage_stats_on_every_chunk_as_vllm_serve(ours, theirs, server, chat):
    kw: dict[str, Any] = {"model": server.name, "max_tokens": 6, "temperature": 0, "stream": True,
                          "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                          "extra_body": {"ignore_eos": True}}

    def usages(client: openai.OpenAI) -> list[tuple[int, int, int]]:
        call = client.chat.completions.create if chat else client.completions.create
        more = {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
        chunks = list(call(**kw, **more))
        assert all(c.usage is not None for c in chunks), chunks
        return [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) for c in chunks]

    mine, vllms = usages(ours), usages(theirs)
    assert mine[-1] == vllms[-1] and mine[-1][1] == 6, (mine, vllms)
    assert [u[1] for u in mine] == sorted(u[1] for u in mine) and all(u[0] == vllms[0][0] for u in mine), mine


def _post(client: openai.OpenAI, path: str, body: dict[str, Any], key: str | None = KEY) -> requests.Response:
    """POST to a server's own path beside /v1 (vLLM's /tokenize and /detokenize)."""
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(root + path, json=body, headers=headers, timeout=CLIENT_TIMEOUT_S)


def test_tokenize_and_detokenize_match_vllm_serve_and_round_trip(ours, theirs, server):
    chat = {"model": server.name, "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": PROMPT}]}
    for body in ({"model": server.name, "prompt": PROMPT, "return_token_strs": True},
                 {"model": server.name, "prompt": "héllo wörld \u2603"}, chat, {**chat, "return_token_strs": True}):
        mine, vllms = _post(ours, "/tokenize", body), _post(theirs, "/tokenize", body, key="unused")
        assert mine.status_code == vllms.status_code == 200, (mine.text, vllms.text)
        assert mine.json() == vllms.json(), (body, mine.json(), vllms.json())
        tokens = mine.json()["tokens"]
        back = _post(ours, "/detokenize", {"model": server.name, "tokens": tokens})
        assert back.json() == _post(theirs, "/detokenize", {"model": server.name, "tokens": tokens}, "unused").json()
        if "prompt" in body:
            assert back.json() == {"prompt": body["prompt"]}
    # The chat's count is the prompt_tokens of that chat's completion.
    done = ours.chat.completions.create(**chat, max_tokens=1)
    assert done.usage.prompt_tokens == _post(ours, "/tokenize", chat).json()["count"]


def test_tokenize_needs_a_key_and_a_model_of_its_scope(ours, server, tmp_path):
    from llmhost.gateway.keys import hash_key

    for path, body in (("/tokenize", {"model": server.name, "prompt": PROMPT}),
                       ("/detokenize", {"model": server.name, "tokens": [1, 2]})):
        assert _post(ours, path, body, key=None).status_code == 401
        missing = _post(ours, path, {**body, "model": "no-such-model"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        bad = _post(ours, path, {**body, "tokens": [10 ** 6]} if path == "/detokenize" else {**body, "prompt": 5})
        assert bad.status_code == 400 and "Traceback" not in bad.text, bad.text
    # A key scoped to another model: this one does not exist to it, as on chat.
    keys = tmp_path / "scoped-keys.yml"
    keys.write_text(f"keys:\n  - name: scoped\n    sha256: {hash_key(KEY)}\n    models: [other]\n")
    scoped = keyed_gateway(server, tmp_path, "--keys-file", str(keys))
    try:
        client = openai.OpenAI(base_url=scoped.url, api_key=KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S)
        assert _post(client, "/tokenize", {"model": server.name, "prompt": PROMPT}).status_code == 404
        assert _post(client, "/detokenize", {"model": server.name, "tokens": [1]}).status_code == 404
    finally:
        stop_gateway(scoped.proc, scoped.log)
