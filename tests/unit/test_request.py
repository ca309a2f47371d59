"""Request parsing and validation: every bad input gets an error naming the problem."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmhost.backend.config import BackendSettings
from llmhost.backend.errors import RequestError
from llmhost.backend.request import MAX_CLIENT_ID_CHARS, client_id, client_label, parse_messages, parse_request

S = BackendSettings()


def arr(value: object) -> np.ndarray:
    if isinstance(value, bool):
        return np.array([value], dtype=np.bool_)
    if isinstance(value, str):
        value = value.encode()
    return np.array([value], dtype=np.object_)


def parse(params: dict | None = None, **inputs: object):
    return parse_request({k: arr(v) for k, v in inputs.items()}, json.dumps(params or {}), S)


def test_text_prompt_defaults():
    job = parse(text_input="hello")
    assert job.prompt == "hello" and job.messages is None
    assert job.stream is False
    assert job.sampling["max_tokens"] == S.default_max_tokens != 16
    assert job.exclude_input is False


def test_parameters_merge_json_input_and_request_params():
    job = parse({"max_tokens": "7", "temperature": 0}, text_input="hi",
                sampling_parameters=json.dumps({"max_tokens": 3, "top_p": "0.5", "stop": "\n"}))
    assert job.sampling["max_tokens"] == 7  # request parameters win
    assert job.sampling["top_p"] == 0.5
    assert job.sampling["stop"] == ["\n"]
    assert job.sampling["temperature"] == 0.0


def test_bool_switches_as_inputs_or_parameters():
    job = parse({"return_finish_reason": True, "exclude_input_in_output": True}, text_input="hi", stream=True)
    assert job.stream and job.return_finish_reason and job.exclude_input


def test_sparse_outputs_is_a_request_parameter_not_a_sampling_one():
    job = parse({"sparse_outputs": True, "return_finish_reason": True}, text_input="hi", stream=True)
    assert job.sparse_outputs and "sparse_outputs" not in job.sampling
    assert job.returns() == {"return_finish_reason", "sparse_outputs"}
    plain = parse({"return_finish_reason": True}, text_input="hi")
    assert not plain.sparse_outputs and plain.returns() == {"return_finish_reason"}
    with pytest.raises(RequestError, match="'sparse_outputs' must be true or false, got 'yes'"):
        parse({"sparse_outputs": "yes"}, text_input="hi")


def test_messages_parsed_and_exclude_input_forced():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    job = parse(messages=json.dumps(msgs))
    assert job.messages == msgs and job.prompt is None and job.exclude_input


@pytest.mark.parametrize(
    ("inputs", "params", "needle"),
    [
        ({}, {}, "missing input"),
        ({"text_input": "a", "messages": "[]"}, {}, "not several"),
        ({"text_input": "   "}, {}, "'text_input' is empty"),
        ({"text_input": b"\xff\xfe"}, {}, "not valid UTF-8"),
        ({"text_input": "a", "sampling_parameters": "{not json"}, {}, "'sampling_parameters' is not valid JSON"),
        ({"text_input": "a", "sampling_parameters": "[1]"}, {}, "must be a JSON object"),
        ({"text_input": "a"}, {"bogus": 1}, "unknown sampling parameter(s) ['bogus']"),
        ({"text_input": "a"}, {"temperature": "hot"}, "'temperature' must be a number"),
        ({"text_input": "a"}, {"max_tokens": 0}, "'max_tokens' must be >= 1"),
        ({"text_input": "a"}, {"max_tokens": -5}, "'max_tokens' must be >= 1"),
        ({"text_input": "a"}, {"max_tokens": 1.5}, "'max_tokens' must be an integer"),
        ({"text_input": "a"}, {"temperature": -0.1}, "'temperature' must be >= 0"),
        ({"text_input": "a"}, {"top_p": 0}, "'top_p' must be in (0, 1]"),
        ({"text_input": "a"}, {"top_p": 1.5}, "'top_p' must be in (0, 1]"),
        ({"text_input": "a"}, {"n": 99}, "'n' must be between 1 and 8"),
        ({"text_input": "a"}, {"stop": 5}, "'stop' must be a string or a list"),
        ({"text_input": "a"}, {"ignore_eos": "maybe"}, "'ignore_eos' must be true or false"),
        ({"text_input": "a"}, {"temperature": "nan"}, "finite"),
        ({"text_input": "a"}, {"stream": "yes"}, "'stream' must be true or false"),
        ({"text_input": "a"}, {"json_schema": "{}", "regex": "a+"}, "one kind of structured output"),
        ({"text_input": "a"}, {"choice": []}, "'choice' must be a non-empty list"),
        ({"messages": "{\"role\": \"user\"}"}, {}, "must be a non-empty JSON list"),
        ({"messages": "[]"}, {}, "must be a non-empty JSON list"),
        ({"messages": "[\"hi\"]"}, {}, "messages[0] must be an object"),
        ({"messages": "[{\"role\": \"king\", \"content\": \"x\"}]"}, {}, "messages[0].role must be one of"),
        ({"messages": "[{\"role\": \"user\", \"content\": 3}]"}, {}, "messages[0].content must be a string"),
        ({"messages": "[{\"role\": \"user\", \"text\": \"x\"}]"}, {}, "unknown key(s) ['text']"),
        ({"messages": "[{\"role\": \"user\", \"content\": \"\"}]"}, {}, "every message is empty"),
        ({"messages": "[{\"role\": \"user\""}, {}, "'messages' is not valid JSON"),
    ],
)
def test_bad_input_names_the_problem(inputs, params, needle):
    with pytest.raises(RequestError) as err:
        parse(params, **inputs)
    assert needle in str(err.value)


def test_wrong_shape_is_refused():
    with pytest.raises(RequestError, match="exactly one element"):
        parse_request({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, None, S)


def test_non_bool_tensor_for_bool_input():
    with pytest.raises(RequestError, match="'stream' must be a BOOL"):
        parse_request({"text_input": arr("a"), "stream": np.array([1], dtype=np.int32)}, None, S)


def test_max_n_comes_from_settings():
    job = parse_request({"text_input": arr("a")}, json.dumps({"n": 3}), BackendSettings(max_n=3))
    assert job.sampling["n"] == 3
    with pytest.raises(RequestError, match="between 1 and 2"):
        parse_request({"text_input": arr("a")}, json.dumps({"n": 3}), BackendSettings(max_n=2))


def test_too_many_messages():
    with pytest.raises(RequestError, match="at most 1024"):
        parse_messages(json.dumps([{"role": "user", "content": "x"}] * 1025))


@pytest.mark.parametrize(("raw", "expected"), [
    ("cancel-me-7", "cancel-me-7"), ("", ""), (None, ""), ("z" * 1000, "z" * MAX_CLIENT_ID_CHARS)])
def test_client_id_is_kept_for_the_log_up_to_128_characters(raw: object, expected: str):
    assert MAX_CLIENT_ID_CHARS == 128
    assert client_id(raw) == expected


def test_client_label_escapes_what_the_client_chose():
    assert client_label("cancel-me-7") == "client id 'cancel-me-7'"
    assert client_label("a\nb\x1b[2J") == "client id 'a\\nb\\x1b[2J'"
    assert client_label("") == "no client id"


def test_additional_outputs_are_asked_for_by_their_return_inputs():
    job = parse({"return_logprobs": True}, text_input="hi", return_cumulative_logprob=True,
                return_num_output_tokens=True)
    assert job.returns() == {"return_logprobs", "return_cumulative_logprob", "return_num_output_tokens"}
    assert parse(text_input="hi").returns() == frozenset()


@pytest.mark.parametrize(("given", "expected"), [(None, None), (0, 0.0), (250, 250.0), ("20", 20.0), (1000.0, 1000.0)])
def test_a_request_may_choose_its_stream_interval(given: object, expected: float | None):
    params = {} if given is None else {"stream_interval_ms": given}
    assert parse(params, text_input="hi", stream=True).stream_interval_ms == expected
    # As a key of the sampling_parameters JSON too (where vllm_backend clients put their options).
    if given is not None:
        job = parse(text_input="hi", stream=True, sampling_parameters=json.dumps({"stream_interval_ms": given}))
        assert job.stream_interval_ms == expected and "stream_interval_ms" not in job.sampling


@pytest.mark.parametrize("bad", [-1, 1000.5, "soon", True, None, [5], "nan", float("inf")])
def test_a_bad_stream_interval_is_refused_by_name(bad: object):
    with pytest.raises(RequestError, match="'stream_interval_ms' must be a number of milliseconds from 0 to 1000"):
        parse_request({"text_input": arr("hi")}, {"stream_interval_ms": bad}, S)


def test_a_stream_cannot_ask_for_the_prompt_in_its_output():
    # vllm_backend's rule: exclude_input_in_output=false is refused when streaming...
    with pytest.raises(RequestError, match="'exclude_input_in_output' cannot be false when streaming"):
        parse(text_input="hi", stream=True, exclude_input_in_output=False)
    with pytest.raises(RequestError, match="cannot be false when streaming"):
        parse({"exclude_input_in_output": False, "stream": True}, text_input="hi")
    # ... left out or true it streams the generated text only; without a stream false is the default.
    assert parse(text_input="hi", stream=True).exclude_input is False  # (a stream never prepends the prompt)
    assert parse(text_input="hi", stream=True, exclude_input_in_output=True).exclude_input
    assert parse(text_input="hi", exclude_input_in_output=False).exclude_input is False


def test_a_prompt_of_token_ids_as_triton_and_the_engine_socket_give_it():
    job = parse_request({"prompt_token_ids": np.array([5, 0, 7], dtype=np.int64)}, "{}", S)
    assert job.prompt_token_ids == [5, 0, 7] and job.prompt is None and job.messages is None and job.exclude_input
    assert all(type(i) is int for i in job.prompt_token_ids)
    from llmhost.backend.stream_socket import request_inputs

    assert parse_request(request_inputs({"prompt_token_ids": [1, 2]}), "{}", S).prompt_token_ids == [1, 2]


@pytest.mark.parametrize(("ids", "needle"), [
    ([], "non-empty list of token ids"),
    ([1, -1], r"'prompt_token_ids'\[1\] must be a token id"),
    ([1, "2"], r"'prompt_token_ids'\[1\] must be a token id"),
    ([True], r"'prompt_token_ids'\[0\] must be a token id"),
    ("12", "non-empty list of token ids"),
])
def test_bad_token_ids_are_named(ids, needle):
    from llmhost.backend.stream_socket import request_inputs

    with pytest.raises(RequestError, match=needle):
        parse_request(request_inputs({"prompt_token_ids": ids}), "{}", S)


def test_token_ids_with_text_are_refused():
    with pytest.raises(RequestError, match="give one of 'text_input', 'messages' and 'prompt_token_ids'"):
        parse_request({"prompt_token_ids": np.array([1], dtype=np.int64), "text_input": arr("hi")}, "{}", S)
