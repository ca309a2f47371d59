"""Every input bound: a request over it gets a RequestError naming the input and
the bound, before anything reaches vLLM (no vLLM needed here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmhost.backend import limits
from llmhost.backend.config import BackendSettings
from llmhost.backend.errors import RequestError
from llmhost.backend.request import MESSAGES_JSON_EXTRA, MESSAGES_JSON_FACTOR, RequestLimits, parse_request
from llmhost.backend.sampling import TOKEN_ID_MAX, validate_sampling

S = BackendSettings()
L = RequestLimits(max_model_len=512, max_prompt_bytes=1000, prompt_bytes_source="llmhost.max_prompt_bytes")


def arr(value: str | bytes) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)


def parse(params: dict | None = None, lim: RequestLimits | None = L, **inputs: str | bytes):
    if "messages" not in inputs:
        inputs.setdefault("text_input", "hi")
    return parse_request({k: arr(v) for k, v in inputs.items()}, json.dumps(params or {}), S, lim)


def refused(params: dict, needle: str, **inputs: str) -> str:
    with pytest.raises(RequestError) as err:
        parse(params, **(inputs or {"text_input": "hi"}))
    assert needle in str(err.value), str(err.value)
    return str(err.value)


# -- seed -----------------------------------------------------------------------
@pytest.mark.parametrize("seed", [limits.SEED_MIN, -1, 0, 2**32, limits.SEED_MAX, str(limits.SEED_MAX)])
def test_seed_in_range(seed):
    assert parse({"seed": seed}).sampling["seed"] == int(seed)


@pytest.mark.parametrize("seed", [2**63, 2**64, 2**64 - 1, -(2**63) - 1, 10**30, "18446744073709551616"])
def test_seed_out_of_range(seed):
    refused({"seed": seed}, "sampling parameter 'seed' must be an integer from -9223372036854775808 to "
                            "9223372036854775807")


def test_other_integers_bounded_too():
    refused({"top_k": 2**70}, "sampling parameter 'top_k' must be an integer from")


# -- list sizes -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "most", "item"),
    [("stop", limits.MAX_STOP, "x"), ("bad_words", limits.MAX_BAD_WORDS, "x"),
     ("stop_token_ids", limits.MAX_STOP_TOKEN_IDS, 1), ("allowed_token_ids", limits.MAX_ALLOWED_TOKEN_IDS, 1)],
)
def test_list_sizes(key, most, item):
    assert len(parse({key: [item] * most}).sampling[key]) == most
    refused({key: [item] * (most + 1)}, f"sampling parameter '{key}' has {most + 1} items; at most {most}")
    # the same as a JSON string (request parameters carry lists so)
    refused({key: json.dumps([item] * (most + 1))}, f"'{key}' has {most + 1} items")


def test_logit_bias_size():
    ok = {str(i): 1 for i in range(limits.MAX_LOGIT_BIAS)}
    assert len(parse({"logit_bias": ok}).sampling["logit_bias"]) == limits.MAX_LOGIT_BIAS
    big = {str(i): 1 for i in range(limits.MAX_LOGIT_BIAS + 1)}
    refused({"logit_bias": big}, f"'logit_bias' has {limits.MAX_LOGIT_BIAS + 1} items; at most")


@pytest.mark.parametrize(("key", "longest"),
                         [("stop", limits.MAX_STOP_CHARS), ("bad_words", limits.MAX_BAD_WORD_CHARS)])
def test_string_item_length(key, longest):
    parse({key: ["a" * longest]})
    refused({key: ["ok", "a" * (longest + 1)]}, f"'{key}'[1] is {longest + 1} characters long; at most {longest}")


def test_single_stop_string_length():
    refused({"stop": "a" * (limits.MAX_STOP_CHARS + 1)}, "'stop'[0] is")


@pytest.mark.parametrize("key", ["stop_token_ids", "allowed_token_ids"])
@pytest.mark.parametrize("bad", [-1, TOKEN_ID_MAX + 1, 2**64])
def test_token_ids_range(key, bad):
    refused({key: [1, bad]}, f"sampling parameter '{key}' must be token ids")


def test_logit_bias_token_range():
    refused({"logit_bias": {str(2**40): 1}}, "'logit_bias' must be token ids")


# -- structured output --------------------------------------------------------------
def test_structured_sizes():
    big = limits.MAX_STRUCTURED_CHARS
    parse({"regex": "a" * big})
    refused({"regex": "a" * (big + 1)}, f"structured output 'regex' is {big + 1} characters long; at most {big}")
    refused({"grammar": "a" * (big + 1)}, "structured output 'grammar' is")
    schema = {"type": "object", "description": "x" * big}
    refused({"json_schema": schema}, "structured output 'json_schema' is")
    refused({"choice": ["x"] * (limits.MAX_CHOICES + 1)}, f"structured output 'choice' has {limits.MAX_CHOICES + 1}")
    refused({"choice": ["x" * 40000, "y" * 40000]}, "structured output 'choice' is 80000 characters")


def test_regex_with_nul():
    refused({"regex": "a\x00b"}, "structured output 'regex' must not contain a NUL character")


# -- JSON depth -----------------------------------------------------------------
DEEP = "[" * 100_000 + "]" * 100_000


def test_deep_sampling_parameters():
    msg = refused({}, "input 'sampling_parameters' nests arrays/objects 100000 levels deep; at most 100",
                  text_input="hi", sampling_parameters=DEEP)
    assert "Traceback" not in msg


def test_deep_unterminated_sampling_parameters():
    refused({}, "input 'sampling_parameters' nests arrays/objects", text_input="hi", sampling_parameters="[" * 100_000)


def test_deep_messages():
    with pytest.raises(RequestError, match="input 'messages' nests arrays/objects 100000 levels deep"):
        parse(lim=None, messages=DEEP)
    refused({}, "input 'messages' nests arrays/objects 101 levels deep", messages="[" * 101 + "]" * 101)


@pytest.mark.parametrize("key", ["stop", "logit_bias", "structured_outputs", "json_schema", "bad_words"])
def test_deep_parameter_given_as_json_string(key):
    refused({key: "{\"a\":" * 50_000 + "1" + "}" * 50_000}, f"sampling parameter '{key}' nests arrays/objects")


def test_deep_schema_inside_sampling_parameters():
    schema: dict = {}
    for _ in range(150):
        schema = {"items": schema}
    text = json.dumps({"json_schema": schema})
    refused({}, "input 'sampling_parameters' nests arrays/objects 152 levels deep", text_input="hi",
            sampling_parameters=text)


def test_depth_at_the_limit_is_fine():
    schema: dict = {}
    for _ in range(limits.MAX_JSON_DEPTH - 2):  # 98 wraps of {} + the outer object: 100 levels
        schema = {"items": schema}
    job = parse({}, text_input="hi", sampling_parameters=json.dumps({"json_schema": schema}))
    assert job.sampling["structured_outputs"] == {"json": schema}
    schema = {"items": schema}
    refused({}, "101 levels deep; at most 100", text_input="hi",
            sampling_parameters=json.dumps({"json_schema": schema}))


def test_huge_integer_in_json():
    refused({}, "input 'sampling_parameters' is not acceptable JSON", text_input="hi",
            sampling_parameters='{"seed": ' + "1" * 5000 + "}")


def test_sampling_parameters_size():
    big = json.dumps({"stop": ["a"] * (limits.MAX_PARAMETERS_BYTES // 4)})
    refused({}, f"input 'sampling_parameters' is {len(big)} bytes; at most {limits.MAX_PARAMETERS_BYTES}",
            text_input="hi", sampling_parameters=big)


# -- prompt bytes ---------------------------------------------------------------
def test_text_input_bytes():
    assert parse(text_input="a" * 1000).prompt_bytes == 1000
    assert parse(text_input="é" * 500).prompt_bytes == 1000
    refused({}, "input 'text_input' is 1001 bytes; at most 1000 bytes are allowed (llmhost.max_prompt_bytes)",
            text_input="a" * 1001)
    refused({}, "input 'text_input' is 1002 bytes", text_input="é" * 501)


def test_text_input_bytes_checked_before_decoding():
    # not UTF-8, but too big: the size is what is reported
    refused({}, "input 'text_input' is 2000 bytes", text_input=b"\xff" * 2000)


def test_messages_content_bytes():
    msgs = [{"role": "user", "content": "a" * 600}, {"role": "assistant", "content": "b" * 400}]
    assert parse(messages=json.dumps(msgs)).prompt_bytes == 1000
    msgs[1]["content"] += "c"
    refused({}, "input 'messages' holds 1001 bytes of content; at most 1000 bytes", messages=json.dumps(msgs))


def test_messages_escaped_json_fitting_the_limit_is_accepted():
    # 1000 one-byte characters, each written as a 6-byte escape: 6,000+ bytes of JSON
    text = json.dumps([{"role": "user", "content": "\x01" * 1000}])
    assert len(text) > 6000
    assert parse(messages=text).prompt_bytes == 1000


def test_messages_json_bytes():
    most = 1000 * MESSAGES_JSON_FACTOR + MESSAGES_JSON_EXTRA
    text = json.dumps([{"role": "user", "content": "x"}]) + " " * most
    refused({}, f"input 'messages' is {len(text)} bytes of JSON; at most {most} bytes", messages=text)


def test_lone_surrogate_in_messages():
    refused({}, "messages[0].content is not valid Unicode", messages='[{"role": "user", "content": "a\\ud800"}]')


def test_no_limits_without_engine():
    assert parse(lim=None, text_input="a" * 5000).prompt_bytes == 5000


# -- max_tokens and the context ---------------------------------------------------
def test_explicit_max_tokens_over_the_context():
    assert parse({"max_tokens": 512}).sampling["max_tokens"] == 512
    refused({"max_tokens": 513}, "sampling parameter 'max_tokens' (513) cannot be greater than the model's "
                                 "max_model_len (512)")


def test_default_max_tokens_over_the_context_is_not_an_error():
    big_default = BackendSettings(default_max_tokens=4096)
    job = parse_request({"text_input": arr("hi")}, None, big_default, L)
    assert job.sampling["max_tokens"] == 4096  # the engine lowers it to what the prompt leaves


def test_validate_sampling_without_context():
    assert validate_sampling({"max_tokens": 10**6}, S)["max_tokens"] == 10**6
