"""POST /tokenize and /detokenize against stand-in upstreams, and the backend's
tokenizer answer: vLLM's shapes; the request reaches the backend as a tokenizer-only
request on either path (engine socket, gRPC); keys and their model scopes as on chat;
bad bodies are 400s naming the field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from llmhost.backend.config import BackendSettings
from llmhost.backend.errors import RequestError
from llmhost.backend.request import parse_request
from llmhost.backend.tokens import tokens_answer
from llmhost.gateway.upstreams.client import Piece, build_request, socket_request
from llmhost.gateway.upstreams.request import BackendRequest
from tests.unit._gateway_fakes import Fake, client, keystore, make_app


class Tokenizer(Fake):
    """A backend whose tokenizer makes one token per character (its code point)."""

    async def generate(self, req: BackendRequest) -> AsyncIterator[Piece]:
        self.seen.append(req)
        await self._before()
        if req.tokens == "detokenize":
            text = "".join(chr(t) for t in req.prompt_token_ids or [])
        else:
            prompt = req.text_input if req.text_input is not None else json.dumps(req.messages)
            ids = [ord(c) for c in prompt]
            text = json.dumps({"tokens": ids, "token_strs": list(prompt), "max_model_len": 64})
        yield Piece([text], ["stop"], 1, [0], True)


def _post(app: Any, path: str, body: Any, key: str | None = "default") -> Any:
    async def run() -> Any:
        async with (client(app) if key == "default" else client(app, key)) as c:
            return await c.post(path, content=json.dumps(body).encode())

    return asyncio.run(run())


def test_tokenize_a_prompt_and_a_chat_in_vllms_shape():
    fake = Tokenizer()
    app = make_app(fake)
    r = _post(app, "/tokenize", {"model": "m", "prompt": "ab"})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 2, "max_model_len": 64, "tokens": [97, 98], "token_strs": None}
    r = _post(app, "/tokenize", {"model": "m", "prompt": "ab", "return_token_strs": True})
    assert r.json()["token_strs"] == ["a", "b"]
    r = _post(app, "/tokenize", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                 "add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200 and r.json()["count"] == len(json.dumps([{"role": "user", "content": "hi"}]))
    prompt, _, chat = fake.seen
    assert prompt.tokens == chat.tokens == "tokenize" and not prompt.stream and prompt.text_input == "ab"
    assert chat.messages == [{"role": "user", "content": "hi"}]
    assert chat.sampling == {"chat_template_kwargs": {"enable_thinking": False}}


def test_detokenize_in_vllms_shape():
    fake = Tokenizer()
    r = _post(make_app(fake), "/detokenize", {"model": "m", "tokens": [104, 105]})
    assert r.status_code == 200 and r.json() == {"prompt": "hi"}
    assert fake.seen[0].tokens == "detokenize" and fake.seen[0].prompt_token_ids == [104, 105]


@pytest.mark.parametrize("kind", ["tokenize", "detokenize"])
def test_both_paths_carry_the_tokenizer_switch(kind):
    req = BackendRequest(model="m", text_input=None, messages=None, sampling={}, stream=False, n=1,
                         include_usage=False, chat=False, prompt_token_ids=[1, 2], tokens=kind)
    line = json.loads(socket_request(req, "id1"))
    assert line["parameters"][kind] is True and line["inputs"]["prompt_token_ids"] == [1, 2]
    assert build_request(req, "id1").parameters[kind].bool_param is True


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_keys_and_model_scopes_as_on_chat(path):
    body = {"model": "m", "prompt": "x"} if path == "/tokenize" else {"model": "m", "tokens": [1]}
    assert _post(make_app(Tokenizer()), path, body, key=None).status_code == 401
    assert _post(make_app(Tokenizer()), path, body, key="wrong-key-0123456789").status_code == 401
    scoped = make_app(Tokenizer(), keys=keystore(models=["other"]))
    r = _post(scoped, path, body)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(make_app(Tokenizer()), path, {**body, "model": "nope"})
    assert r.status_code == 404


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "x"}, "model"),
    ("/tokenize", {"model": "m"}, "prompt"),
    ("/tokenize", {"model": "m", "prompt": ""}, "prompt"),
    ("/tokenize", {"model": "m", "prompt": 5}, "prompt"),
    ("/tokenize", {"model": "m", "prompt": "x", "bogus": 1}, "bogus"),
    ("/tokenize", {"model": "m", "prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
    ("/tokenize", {"model": "m", "prompt": "x", "return_token_strs": "yes"}, "return_token_strs"),
    ("/tokenize", {"model": "m", "messages": []}, "messages"),
    ("/tokenize", {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"model": "m", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False},
     "add_generation_prompt"),
    ("/tokenize", {"model": "m", "messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"},
     "chat_template"),
    ("/tokenize", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "messages"),
    ("/detokenize", {"model": "m"}, "tokens"),
    ("/detokenize", {"model": "m", "tokens": []}, "tokens"),
    ("/detokenize", {"model": "m", "tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"model": "m", "tokens": ["1"]}, "tokens[0]"),
    ("/detokenize", {"model": "m", "tokens": [2**31]}, "tokens[0]"),
])
def test_bad_bodies_are_400s_naming_the_field(path, body, param):
    fake = Tokenizer()
    r = _post(make_app(fake), path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "Traceback" not in err["message"], err
    assert not fake.seen


def test_not_json_is_a_400():
    async def run() -> Any:
        async with client(make_app(Tokenizer())) as c:
            return await c.post("/tokenize", content=b"{not json")

    assert asyncio.run(run()).status_code == 400


# --- the backend's side -------------------------------------------------------------

def _tokenizer() -> Any:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    raw = RawTokenizer(WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")


def test_the_backend_parses_the_switches_and_refuses_the_wrong_prompt():
    s = BackendSettings()
    job = parse_request({"text_input": ["hello"]}, {"tokenize": True}, s)
    assert job.tokens == "tokenize"
    job = parse_request({"prompt_token_ids": [0, 1]}, {"detokenize": True}, s)
    assert job.tokens == "detokenize"
    assert parse_request({"text_input": ["hello"]}, {}, s).tokens is None
    with pytest.raises(RequestError, match="'detokenize' needs the token ids"):
        parse_request({"text_input": ["hello"]}, {"detokenize": True}, s)
    with pytest.raises(RequestError, match="'tokenize' needs 'text_input' or 'messages'"):
        parse_request({"prompt_token_ids": [1]}, {"tokenize": True}, s)
    with pytest.raises(RequestError, match="not both"):
        parse_request({"prompt_token_ids": [1]}, {"tokenize": True, "detokenize": True}, s)


def test_the_backends_answer_is_vllms_tokenization():
    tok = _tokenizer()
    s = BackendSettings()
    answer = json.loads(tokens_answer(parse_request({"text_input": ["hello world"]}, {"tokenize": True}, s),
                                      [0, 1], tok, 128))
    assert answer == {"tokens": [0, 1], "token_strs": ["hello", "world"], "max_model_len": 128}
    job = parse_request({"prompt_token_ids": [0, 1]}, {"detokenize": True}, s)
    assert tokens_answer(job, [0, 1], tok, 128) == tok.decode([0, 1])


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**70), st.text(max_size=8),
                     st.floats(allow_nan=False, allow_infinity=False))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "x"]), inner, max_size=3),
                       max_leaves=8)
_KEYS = ["model", "prompt", "messages", "tokens", "return_token_strs", "add_special_tokens", "add_generation_prompt",
         "chat_template_kwargs", "tools", "bogus"]


@settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/tokenize", "/detokenize"]),
       body=st.dictionaries(st.sampled_from(_KEYS), _values, max_size=4), model=st.booleans())
def test_fuzzed_bodies_get_an_answer_or_a_4xx_naming_a_field(path, body, model):
    if model:
        body["model"] = "m"
    r = _post(make_app(Tokenizer()), path, body)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["param"] and "Traceback" not in err["message"] and 'File "' not in err["message"], err
