"""vLLM's extra request fields on the gateway: each field of vLLM's own chat and
completions requests (the installed vLLM's protocol) is served or refused by name with
a reason; the served sampling fields reach the backend's table and vLLM's
SamplingParams; bad values are 400s naming the field; continuous usage in streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmhost.backend import limits
from llmhost.backend.config import BackendSettings
from llmhost.backend.sampling import FIELDS, STRUCTURED_ALIASES, validate_sampling
from llmhost.gateway.doors.openai import request_models as openai_models
from llmhost.gateway.doors.openai.completion_bodies import stream_chunks
from llmhost.gateway.doors.openai.mapping import PASSED, parse_body, to_backend
from llmhost.gateway.doors.openai.request_models import (
    REFUSED,
    UNSUPPORTED_COMMON,
    ChatCompletionRequest,
    CompletionRequest,
)
from llmhost.gateway.errors import ApiError
from llmhost.gateway.upstreams.client import Piece
from llmhost.gateway.upstreams.request import BackendRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def _map(chat: bool = True, **fields: Any) -> BackendRequest:
    body: dict[str, Any] = {"model": "m", **({"messages": MESSAGES} if chat else {"prompt": "p"}), **fields}
    return to_backend(parse_body(json.dumps(body).encode(), chat))


def _refused(chat: bool = True, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        _map(chat, **fields)
    assert info.value.status == 400, info.value.body()
    assert "Traceback" not in info.value.message
    return info.value


# --- the table against the installed vLLM -----------------------------------------

def _vllm_requests() -> list[tuple[type[Any], type[Any]]]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletion

    return [(VllmChat, ChatCompletionRequest), (VllmCompletion, CompletionRequest)]


@pytest.mark.parametrize("pair", [0, 1], ids=["chat", "completions"])
def test_every_field_of_vllms_requests_is_served_or_refused_with_a_reason(pair):
    vllm_model, ours = _vllm_requests()[pair]
    unplaced = sorted(name for name in vllm_model.model_fields
                      if name not in ours.model_fields and name not in REFUSED and name not in UNSUPPORTED_COMMON
                      and name != "echo")  # chat's echo: refused by mapping, served on completions
    assert not unplaced, f"vLLM's {vllm_model.__name__} fields neither served nor refused: {unplaced}"


def test_served_sampling_fields_are_in_the_backends_table_and_build_sampling_params():
    import vllm

    for name in PASSED:
        assert name in FIELDS or name in STRUCTURED_ALIASES or name == "structured_outputs", name
    req = _map(logit_bias={"5": 100, "7": -2.5}, bad_words=["foo", "bar baz"], allowed_token_ids=[5, 7, 9],
               spaces_between_special_tokens=False, max_tokens=3)
    # The backend's request is JSON (token ids as strings, as OpenAI's logit_bias keys).
    kwargs = validate_sampling(json.loads(json.dumps(req.sampling)), BackendSettings())
    params = vllm.SamplingParams(**kwargs)
    assert params.logit_bias == {5: 100.0, 7: -2.5}
    assert params.bad_words == ["foo", "bar baz"] and params.allowed_token_ids == [5, 7, 9]
    assert params.spaces_between_special_tokens is False


def test_the_gateways_bounds_are_the_backends():
    assert openai_models.MAX_LOGIT_BIAS == limits.MAX_LOGIT_BIAS
    assert openai_models.MAX_BAD_WORDS == limits.MAX_BAD_WORDS
    assert openai_models.MAX_BAD_WORD_CHARS == limits.MAX_BAD_WORD_CHARS
    assert openai_models.MAX_ALLOWED_TOKEN_IDS == limits.MAX_ALLOWED_TOKEN_IDS


# --- served: each reaches the backend, on chat and completions -------------------------

@pytest.mark.parametrize("chat", [True, False])
def test_new_sampling_fields_reach_the_backend(chat):
    req = _map(chat, logit_bias={"12": 100, "3": -100}, bad_words=["x"], allowed_token_ids=[1, 2],
               spaces_between_special_tokens=False)
    assert req.sampling == {"logit_bias": {"12": 100.0, "3": -100.0}, "bad_words": ["x"],
                            "allowed_token_ids": [1, 2], "spaces_between_special_tokens": False}


@pytest.mark.parametrize("chat", [True, False])
def test_continuous_usage_needs_include_usage_as_in_vllm(chat):
    on = _map(chat, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert on.include_usage and on.continuous_usage
    alone = _map(chat, stream=True, stream_options={"continuous_usage_stats": True})
    assert not alone.include_usage and not alone.continuous_usage


# --- refused: each bad-input class is a 400 naming the field ----------------------------

@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"logit_bias": {"a": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {str(2**31): 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"1": 100.5}}, "logit_bias", "from -100 to 100"),
    ({"logit_bias": {"1": -101}}, "logit_bias", "from -100 to 100"),
    ({"logit_bias": {"1": "5"}}, "logit_bias.1", "valid number"),
    ({"logit_bias": {"1": True}}, "logit_bias.1", "valid number"),
    ({"logit_bias": [1, 2]}, "logit_bias", "dictionary"),
    ({"logit_bias": {str(i): 1 for i in range(limits.MAX_LOGIT_BIAS + 1)}}, "logit_bias", "at most"),
    ({"bad_words": "word"}, "bad_words", "list"),
    ({"bad_words": [""]}, "bad_words", "1 to"),
    ({"bad_words": ["a" * (limits.MAX_BAD_WORD_CHARS + 1)]}, "bad_words", "1 to"),
    ({"bad_words": [3]}, "bad_words[0]", "string"),
    ({"bad_words": ["x"] * (limits.MAX_BAD_WORDS + 1)}, "bad_words", "at most"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "at least 1"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids[0]", "greater than or equal to 0"),
    ({"allowed_token_ids": [1, 2**31]}, "allowed_token_ids[1]", "less than or equal"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids[0]", "integer"),
    ({"allowed_token_ids": "1"}, "allowed_token_ids", "list"),
    ({"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens", "boolean"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options.continuous_usage_stats",
     "boolean"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "stream_options", "stream"),
])
@pytest.mark.parametrize("chat", [True, False])
def test_bad_values_are_400s_naming_the_field(chat, fields, param, words):
    err = _refused(chat, **fields)
    assert err.param == param and param.split("[")[0].split(".")[0] in err.message and words in err.message, (
        err.body())


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_vllms_unserved_fields_are_refused_by_name_with_why(name):
    err = _refused(True, **{name: 1})
    assert err.param == name and err.code == "unsupported_parameter" and REFUSED[name] in err.message


# --- continuous usage: every chunk carries the usage so far --------------------------------

async def _rest(*pieces: Piece) -> AsyncIterator[Piece]:
    for piece in pieces:
        yield piece


def _events(req: BackendRequest, pieces: list[Piece]) -> list[Any]:
    async def run() -> list[bytes]:
        return [c async for c in stream_chunks(req, pieces[0], _rest(*pieces[1:]), "id1")]

    out = []
    for data in asyncio.run(run()):
        text = data.decode().removeprefix("data: ").strip()
        out.append(text if text == "[DONE]" else json.loads(text))
    return out


@pytest.mark.parametrize("chat", [True, False])
def test_continuous_usage_on_every_chunk(chat):
    req = _map(chat, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    events = _events(req, [Piece(["He"], ["None"], 3, [1], False), Piece(["llo"], ["None"], None, [2], False),
                           Piece(["!"], ["length"], None, [1], True)])
    assert events[-1] == "[DONE]"
    usages = [e["usage"] for e in events[:-1]]
    completion = [0, 1, 3, 4, 4] if chat else [1, 3, 4, 4]  # chat's role chunk first
    assert usages == [{"prompt_tokens": 3, "completion_tokens": c, "total_tokens": 3 + c} for c in completion]
    assert events[-2]["choices"] == []


def test_without_continuous_usage_only_the_last_chunk_counts():
    req = _map(True, stream=True, stream_options={"include_usage": True})
    events = _events(req, [Piece(["He"], ["None"], 3, [1], False), Piece(["llo"], ["length"], None, [1], True)])
    assert [e["usage"] for e in events[:-2]] == [None, None, None]
    assert events[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_docs_have_a_row_for_every_field_of_vllms_requests():
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    table = text[text.index("| field | on | status |"):text.index("**Embeddings.**")]
    documented = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    for vllm_model, _ in _vllm_requests():
        missing = sorted(set(vllm_model.model_fields) - documented)
        assert not missing, f"docs/api.md's request fields table lacks {missing}"


# --- fuzzed bodies: mapped, or a 4xx naming a field; never another error -----------------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False,
                     allow_infinity=False), st.text(max_size=8), st.sampled_from(["12", "-1", "1e3", "4095"]))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.one_of(st.text(max_size=5), st.sampled_from(["1", "99", "x"])), inner,
                                         max_size=3), max_leaves=8)
_FIELDS = ["logit_bias", "bad_words", "allowed_token_ids", "spaces_between_special_tokens", "stream",
           "stream_options", "truncate_prompt_tokens", "priority", "request_id", "max_tokens"]


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(fields=st.dictionaries(st.sampled_from(_FIELDS), _values, max_size=4), chat=st.booleans(),
       usage=st.fixed_dictionaries({}, optional={"include_usage": _values, "continuous_usage_stats": _values}))
def test_fuzzed_bodies_are_mapped_or_a_4xx_naming_a_field(fields, chat, usage):
    if "stream_options" in fields and isinstance(fields["stream_options"], dict):
        fields["stream_options"] = {**fields["stream_options"], **usage}
    try:
        req = _map(chat, **fields)
    except ApiError as err:
        assert 400 <= err.status < 500 and err.param, err.body()
        assert "Traceback" not in err.message and 'File "' not in err.message, err.body()
        return
    for name in ("logit_bias", "bad_words", "allowed_token_ids"):
        if fields.get(name) is not None:
            # Whatever the gateway passes, the backend's table takes.
            validate_sampling(json.loads(json.dumps({name: req.sampling[name]})), BackendSettings())
