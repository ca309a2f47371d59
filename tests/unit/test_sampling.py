"""Sampling parameters: coercion to vLLM's field types, structured output, and the
table held against the installed vLLM's SamplingParams."""

from __future__ import annotations

import pytest

from llmhost.backend.config import BackendSettings
from llmhost.backend.sampling import FIELDS, SamplingError, validate_sampling

S = BackendSettings()


@pytest.mark.parametrize(
    ("key", "given", "expected"),
    [
        ("temperature", "0.7", 0.7),
        ("temperature", 1, 1.0),
        ("top_k", "40", 40),
        ("top_k", 40.0, 40),
        ("seed", "123", 123),
        ("seed", None, None),
        ("ignore_eos", "true", True),
        ("ignore_eos", False, False),
        ("stop", "###", ["###"]),
        ("stop", '["a", "b"]', ["a", "b"]),
        ("stop_token_ids", "[1, 2]", [1, 2]),
        ("logit_bias", {"12": "-100"}, {12: -100.0}),
        ("bad_words", ["x"], ["x"]),
    ],
)
def test_coercion(key, given, expected):
    assert validate_sampling({key: given}, S)[key] == expected


def test_structured_output_forms():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert validate_sampling({"json_schema": schema}, S)["structured_outputs"] == {"json": schema}
    assert validate_sampling({"guided_json": '{"type": "string"}'}, S)["structured_outputs"] == {
        "json": {"type": "string"}}
    assert validate_sampling({"regex": "[0-9]+"}, S)["structured_outputs"] == {"regex": "[0-9]+"}
    assert validate_sampling({"choice": '["yes", "no"]'}, S)["structured_outputs"] == {"choice": ["yes", "no"]}
    nested = validate_sampling({"structured_outputs": {"grammar": "root ::= \"a\""}}, S)
    assert nested["structured_outputs"] == {"grammar": 'root ::= "a"'}


def test_structured_output_errors():
    with pytest.raises(SamplingError, match="unknown structured_outputs key 'xml'"):
        validate_sampling({"structured_outputs": {"xml": "x"}}, S)
    with pytest.raises(SamplingError, match="must be a JSON schema object"):
        validate_sampling({"json_schema": "not a schema"}, S)


def test_min_tokens_bound():
    with pytest.raises(SamplingError, match="must not exceed max_tokens"):
        validate_sampling({"min_tokens": 10, "max_tokens": 5}, S)


def test_table_matches_installed_vllm():
    """Every key we accept is a real SamplingParams field of the pinned vLLM,
    and the kwargs we build construct a SamplingParams."""
    import vllm

    fields = set(vllm.SamplingParams.__struct_fields__)
    assert set(FIELDS) <= fields, sorted(set(FIELDS) - fields)
    from vllm.sampling_params import StructuredOutputsParams

    kwargs = validate_sampling({"temperature": "0.5", "stop": "x", "max_tokens": 4, "seed": 1, "n": 2}, S)
    sp = vllm.SamplingParams(**kwargs)
    assert sp.max_tokens == 4 and sp.n == 2 and sp.stop == ["x"]
    for spec in ({"json": {"type": "object"}}, {"regex": "a"}, {"choice": ["a"]}, {"grammar": "g"}):
        StructuredOutputsParams(**spec)


def test_logprobs_is_top_k_per_token_and_not_negative():
    assert validate_sampling({"logprobs": "2"}, BackendSettings())["logprobs"] == 2
    assert validate_sampling({"logprobs": 0}, BackendSettings())["logprobs"] == 0
    assert "logprobs" not in validate_sampling({}, BackendSettings())
    with pytest.raises(SamplingError, match="'logprobs' must be >= 0"):
        validate_sampling({"logprobs": -1}, BackendSettings())
    with pytest.raises(SamplingError, match="'logprobs' must be an integer"):
        validate_sampling({"logprobs": "many"}, BackendSettings())
