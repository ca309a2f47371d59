"""Every input bound, against the real server: a 400 whose error names the input
and the bound, no traceback or path in it, and the server answers the next request.
vLLM's own validation errors (an invalid regex) count as invalid_request, never
as engine_error (the reason the error-ratio alert pages on)."""

from __future__ import annotations

import json
import time

import pytest

from llmhost.backend import limits
from tests.e2e._client import generate, grpc_stream

GOOD = {"text_input": "hello", "max_tokens": 2}
LEAKS = ("Traceback", 'File "', "/site-packages/", "/usr/", "/opt/", "/tmp/", ".py")
DEEP = "[" * 100_000 + "]" * 100_000


def sp(**kw: object) -> str:
    return json.dumps(kw)


CASES = [
    # seed: vLLM's range (torch.long)
    ({"text_input": "x", "sampling_parameters": sp(seed=2**64)}, "'seed' must be an integer from -9223372036854775808"),
    ({"text_input": "x", "sampling_parameters": sp(seed=2**63)}, "'seed' must be an integer from"),
    ({"text_input": "x", "sampling_parameters": sp(seed=-(2**63) - 1)}, "'seed' must be an integer from"),
    # list sizes
    ({"text_input": "x", "sampling_parameters": sp(stop=["a"] * 65)}, "'stop' has 65 items; at most 64"),
    ({"text_input": "x", "stop": json.dumps(["a"] * 65)}, "'stop' has 65 items; at most 64"),
    ({"text_input": "x", "stop": "s" * 1025}, "'stop'[0] is 1025 characters long; at most 1024"),
    ({"text_input": "x", "sampling_parameters": sp(bad_words=["a"] * 257)}, "'bad_words' has 257 items; at most 256"),
    ({"text_input": "x", "sampling_parameters": sp(stop_token_ids=[1] * 1025)},
     "'stop_token_ids' has 1025 items; at most 1024"),
    ({"text_input": "x", "sampling_parameters": sp(allowed_token_ids=[1] * (limits.MAX_ALLOWED_TOKEN_IDS + 1))},
     f"'allowed_token_ids' has {limits.MAX_ALLOWED_TOKEN_IDS + 1} items"),
    ({"text_input": "x", "sampling_parameters": sp(logit_bias={str(i): 1 for i in range(1025)})},
     "'logit_bias' has 1025 items; at most 1024"),
    ({"text_input": "x", "sampling_parameters": sp(stop_token_ids=[2**40])}, "'stop_token_ids' must be token ids"),
    # structured output specs
    ({"text_input": "x", "sampling_parameters": sp(regex="a" * 65_537)},
     "structured output 'regex' is 65537 characters long; at most 65536"),
    ({"text_input": "x", "sampling_parameters": sp(choice=["c"] * 1025)}, "structured output 'choice' has 1025 items"),
    ({"text_input": "x", "sampling_parameters": sp(json_schema={"type": "string", "description": "d" * 70_000})},
     "structured output 'json_schema' is"),
    ({"text_input": "x", "sampling_parameters": sp(grammar="g" * 65_537)}, "structured output 'grammar' is 65537"),
    # JSON depth of every JSON input
    ({"text_input": "x", "sampling_parameters": DEEP},
     "input 'sampling_parameters' nests arrays/objects 100000 levels deep; at most 100"),
    ({"text_input": "x", "sampling_parameters": "{\"a\":" * 100_000},
     "input 'sampling_parameters' nests arrays/objects 100000 levels deep"),
    ({"messages": DEEP}, "input 'messages' nests arrays/objects 100000 levels deep"),
    ({"text_input": "x", "stop": DEEP}, "sampling parameter 'stop' nests arrays/objects 100000 levels deep"),
    ({"text_input": "x", "structured_outputs": "{\"json\":" * 100_000},
     "sampling parameter 'structured_outputs' nests arrays/objects"),
    ({"text_input": "x", "sampling_parameters": sp(json_schema=json.loads("{\"items\":" * 120 + "{}" + "}" * 120))},
     "input 'sampling_parameters' nests arrays/objects 122 levels deep"),
    ({"text_input": "x", "sampling_parameters": '{"seed": ' + "9" * 5000 + "}"},
     "input 'sampling_parameters' is not acceptable JSON"),
    # the prompt's size (default limit derived from max_model_len 512), checked before tokenizing
    ({"text_input": "x" * 2_000_000}, "input 'text_input' is 2000000 bytes; at most"),
    ({"messages": json.dumps([{"role": "user", "content": "x" * 1_000_000}])},
     "input 'messages' is 1000033 bytes of JSON; at most"),
    ({"messages": json.dumps([{"role": "user", "content": "x" * 200_000}])},
     "input 'messages' holds 200000 bytes of content; at most"),
    # max_tokens beyond the context: refused when given, as vLLM's own server does
    ({"text_input": "x", "max_tokens": 513},
     "'max_tokens' (513) cannot be greater than the model's max_model_len (512)"),
]


@pytest.mark.parametrize(("body", "needle"), CASES, ids=[c[1][:50] for c in CASES])
def test_bound_is_a_clear_400(server, body, needle):
    r = generate(server, **body)
    assert r["_status"] == 400, (r["_status"], str(r)[:300])
    assert needle in r["error"], r["error"][:500]
    for leak in LEAKS:
        assert leak not in r["error"], (leak, r["error"][:500])
    ok = generate(server, **GOOD)
    assert ok["_status"] == 200 and "text_output" in ok, ok


def test_prompt_limit_names_the_setting(server):
    r = generate(server, text_input="x" * 2_000_000)
    assert "(llmhost.max_prompt_bytes; by default max_model_len 512 x " in r["error"], r["error"]


def test_deep_sampling_parameters_over_grpc(server):
    _, error = grpc_stream(server, {"text_input": "x", "sampling_parameters": DEEP})
    assert error is not None and "nests arrays/objects 100000 levels deep" in error
    assert "Traceback" not in error and "RecursionError" not in error


def test_seed_at_the_bounds_is_accepted(server):
    for seed in (2**63 - 1, -(2**63)):
        r = generate(server, text_input="x", max_tokens=2, sampling_parameters=sp(seed=seed))
        assert r["_status"] == 200 and "text_output" in r, r


def test_max_tokens_up_to_the_context_is_lowered_to_what_the_prompt_leaves(server):
    prompt = "def f(x):\n    return x\n" * 20
    r = generate(server, text_input=prompt, max_tokens=512, ignore_eos=True, return_num_input_tokens=True,
                 return_num_output_tokens=True, return_finish_reason=True, exclude_input_in_output=True)
    assert r["_status"] == 200, r
    assert r["num_input_tokens"] + r["num_output_tokens"] == 512, r
    assert r["finish_reason"] == "length"


def _wait_metric(server, series: str, reason: str, at_least: float) -> float:
    deadline = time.monotonic() + 10
    value = server.metric(series, reason=reason)
    while value < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
        value = server.metric(series, reason=reason)
    return value


@pytest.mark.parametrize("regex", ["((", "[z-a]", "a{3,1}"])
def test_invalid_regex_is_a_client_error_not_an_engine_error(server, regex):
    engine_before = server.metric("vllm:request_failed_total", reason="engine_error")
    invalid_before = server.metric("vllm:request_failed_total", reason="invalid_request")
    r = generate(server, text_input="x", max_tokens=3, sampling_parameters=sp(regex=regex))
    assert r["_status"] == 400, r
    assert "regex" in r["error"], r["error"]
    for leak in LEAKS:
        assert leak not in r["error"], (leak, r["error"])
    counted = _wait_metric(server, "vllm:request_failed_total", "invalid_request", invalid_before + 1)
    assert counted >= invalid_before + 1
    time.sleep(1.5)  # one more metrics push: nothing was counted as engine_error meanwhile
    assert server.metric("vllm:request_failed_total", reason="engine_error") == engine_before
