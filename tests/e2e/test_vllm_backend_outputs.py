"""What a streaming client of NVIDIA's vllm_backend relies on, against our backend
(tiny model, CPU): one response per engine step unless a window is asked for (by
the model's setting or by the request), the additional outputs with their names,
types and per-response meaning (streamed and not, n > 1), and its rule that a
stream never carries the prompt.

Step counts depend on load, so the checks of a stream's shape follow
``tests.e2e._client.shaped`` (a few tries); a backend that grouped by default, or never
grouped, fails every try. Every response's counts adding up to the tokens asked for is
checked on every stream. The merging rule itself is unit-tested in
tests/unit/test_coalesce.py."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import requests

from tests.e2e._client import generate, grpc_stream, more_than, sampling, shaped, stream
from tests.e2e._servers import MODEL_STREAM_INTERVAL_MS
from tests.harness.server import Server

PROMPT = "def fibonacci(n):"
EVERY_OUTPUT = {"return_finish_reason": True, "return_cumulative_logprob": True, "return_logprobs": True,
                "return_num_input_tokens": True, "return_num_output_tokens": True}


@pytest.fixture(scope="module")
def grouped_server(tuned_server: Server) -> Server:
    """A server whose model groups stream deltas for up to a second (llmhost.stream_interval_ms):
    tests/e2e/conftest.py's tuned server (its LoRA and prompt limit change no stream's shape)."""
    assert MODEL_STREAM_INTERVAL_MS == 1000
    return tuned_server


def _counts(events: list[dict[str, Any]]) -> list[int]:
    return [int(e["num_output_tokens"]) for e in events]


def _per_step(events: list[dict[str, Any]], tokens: int) -> None:
    """The shape of a stream whose counts were found to add up to ``tokens`` when taken."""
    counts = _counts(events)
    assert statistics.median(counts) == 1, counts  # the typical response is one engine step: one token
    # An idle machine sends nearly one response a token; a busy one merges a backlog
    # now and then. Either is far from a window's handful of responses.
    assert len(events) > tokens // 4, counts


def _grouped(events: list[dict[str, Any]], tokens: int) -> None:
    """The shape of a stream whose counts were found to add up to ``tokens`` when taken."""
    counts = _counts(events)
    # A one-second window: the first token alone, then groups. 200 tokens of the tiny
    # model take a few seconds on CPU; fewer than 100 responses tells the modes apart.
    assert 1 < len(events) < tokens // 2, counts


def _sums_to(events: list[dict[str, Any]], tokens: int) -> None:
    assert sum(_counts(events)) == tokens, _counts(events)


STREAM_BODY = {"text_input": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0,
               "return_num_output_tokens": True}


def _take(server: Server, **extra: Any) -> Callable[[], list[dict[str, Any]]]:
    def take() -> list[dict[str, Any]]:
        events = stream(server, **STREAM_BODY, **extra)
        _sums_to(events, 200)  # whatever the load
        return events
    return take


def test_a_stream_sends_each_engine_step_by_default(server):
    events = shaped(_take(server), lambda e: _per_step(e, 200))
    assert "".join(e["text_output"] for e in events) == generate(
        server, **STREAM_BODY, exclude_input_in_output=True)["text_output"]


def _grpc_counts(server: Server) -> list[dict[str, Any]]:
    results, error = grpc_stream(server, {"text_input": PROMPT, "stream": True, "return_num_output_tokens": True,
                                          "sampling_parameters": sampling(max_tokens=200, ignore_eos=True,
                                                                          stream_interval_ms=1000)})
    assert error is None
    events = [{"num_output_tokens": r.as_numpy("num_output_tokens")[0]} for r in results]
    _sums_to(events, 200)
    return events


def test_a_request_may_group_its_stream(server):
    shaped(_take(server, stream_interval_ms=1000), lambda e: _grouped(e, 200))
    # Also as a key of sampling_parameters, over gRPC (vllm_backend clients' way).
    shaped(lambda: _grpc_counts(server), lambda e: _grouped(e, 200))


def test_a_models_window_groups_and_a_request_may_turn_it_off(grouped_server):
    shaped(_take(grouped_server), lambda e: _grouped(e, 200))
    shaped(_take(grouped_server, stream_interval_ms=0), lambda e: _per_step(e, 200))


@pytest.mark.parametrize("value", [-1, 1001, "soon", "nan"])
def test_a_bad_stream_interval_is_a_400_naming_it(server, value):
    r = generate(server, text_input=PROMPT, max_tokens=2, stream_interval_ms=value)
    assert r["_status"] == 400, r
    assert "'stream_interval_ms' must be a number of milliseconds from 0 to 1000" in r["error"]


def _outputs(result: Any) -> dict[str, Any]:
    names = ("text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
             "num_output_tokens")
    return {n: result.as_numpy(n) for n in names}


def _check_positions(positions: list[dict[str, Any]], k: int) -> str:
    """Each position: the sampled token and the top K, as vllm_backend's JSON; returns the rank-1 text."""
    text = ""
    for pos in positions:
        # vLLM gives the top K and the sampled token: K entries when the sampled token is
        # among them, K + 1 when not.
        assert k <= len(pos) <= k + 1, pos
        ranks = sorted(entry["rank"] for entry in pos.values())
        assert ranks[0] == 1 and all(isinstance(t, str) and t.isdigit() for t in pos)
        for entry in pos.values():
            assert set(entry) == {"logprob", "rank", "decoded_token"} and entry["logprob"] <= 0
            if entry["rank"] == 1:
                text += entry["decoded_token"]
    return text


def test_every_additional_output_streamed(server):
    def take() -> list[Any]:
        results, error = grpc_stream(server, {"text_input": PROMPT, "stream": True, **EVERY_OUTPUT,
                                              "sampling_parameters": sampling(max_tokens=24, ignore_eos=True,
                                                                              temperature=0, logprobs=2)})
        assert error is None and results, error
        return results

    results = shaped(take, more_than(1))  # a running sum needs more than one response
    outs = [_outputs(r) for r in results]
    assert [o["finish_reason"].tolist() for o in outs] == [[b"None"]] * (len(outs) - 1) + [[b"length"]]
    assert all(o["cumulative_logprob"].dtype == np.float32 and o["cumulative_logprob"].shape == (1,)
               for o in outs)
    cumulative = [float(o["cumulative_logprob"][0]) for o in outs]
    assert cumulative == sorted(cumulative, reverse=True) and cumulative[-1] < 0  # a running sum of logprobs
    assert {int(o["num_input_tokens"][0]) for o in outs} == {int(outs[0]["num_input_tokens"][0])} != {0}
    total, greedy, text, sampled = 0, "", "", 0.0
    for o in outs:
        positions = json.loads(o["logprobs"][0])
        count = int(o["num_output_tokens"][0])
        assert o["num_output_tokens"].dtype == np.uint32 and len(positions) == count  # this response's tokens
        total += count
        greedy += _check_positions(positions, 2)
        text += o["text_output"][0].decode()
        sampled += sum(e["logprob"] for p in positions for e in p.values() if e["rank"] == 1)
    assert total == 24
    assert greedy == text  # greedy: the rank-1 tokens are the text
    assert math.isclose(sampled, cumulative[-1], rel_tol=1e-3, abs_tol=1e-3)


def test_every_additional_output_not_streamed(server):
    r = generate(server, text_input=PROMPT, max_tokens=24, ignore_eos=True, temperature=0, logprobs=2,
                 **EVERY_OUTPUT)
    assert r["_status"] == 200, r
    assert r["finish_reason"] == "length" and r["num_output_tokens"] == 24 and r["num_input_tokens"] > 0
    positions = json.loads(r["logprobs"])
    assert len(positions) == 24
    assert r["text_output"] == PROMPT + _check_positions(positions, 2)  # the prompt, then the greedy tokens
    sampled = sum(e["logprob"] for p in positions for e in p.values() if e["rank"] == 1)
    assert isinstance(r["cumulative_logprob"], float) and math.isclose(sampled, r["cumulative_logprob"],
                                                                       rel_tol=1e-3, abs_tol=1e-3)


def test_outputs_not_asked_for_are_absent_and_logprobs_null_without_the_parameter(server):
    results, error = grpc_stream(server, {"text_input": PROMPT, "stream": True, "return_logprobs": True,
                                          "return_cumulative_logprob": True,
                                          "sampling_parameters": sampling(max_tokens=6, ignore_eos=True)})
    assert error is None and results
    for o in (_outputs(r) for r in results):
        assert o["logprobs"].tolist() == [b"null"]  # no 'logprobs' sampling parameter: null, as vllm_backend
        # Ours sums the log probabilities even then (vllm_backend on vLLM V1 sends NaN).
        assert math.isfinite(float(o["cumulative_logprob"][0]))
        assert o["finish_reason"] is None and o["num_input_tokens"] is None and o["num_output_tokens"] is None
    plain = generate(server, text_input=PROMPT, max_tokens=4, logprobs=1)
    assert plain["_status"] == 200 and "text_output" in plain
    assert not set(plain) & {"finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                             "num_output_tokens"}


def test_n_completions_each_get_their_outputs(server):
    params = sampling(max_tokens=12, ignore_eos=True, n=2, seed=7, logprobs=1)
    results, error = grpc_stream(server, {"text_input": PROMPT, "stream": True, **EVERY_OUTPUT,
                                          "sampling_parameters": params})
    assert error is None and results
    totals, texts = [0, 0], ["", ""]
    for o in (_outputs(r) for r in results):
        for name in ("text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_output_tokens"):
            assert o[name].shape == (2,), (name, o[name])
        assert o["num_input_tokens"].shape == (1,)
        for i in range(2):
            assert len(json.loads(o["logprobs"][i])) == int(o["num_output_tokens"][i])
            totals[i] += int(o["num_output_tokens"][i])
            texts[i] += o["text_output"][i].decode()
    assert totals == [12, 12]
    assert _outputs(results[-1])["finish_reason"].tolist() == [b"length", b"length"]
    whole = generate(server, text_input=PROMPT, max_tokens=12, ignore_eos=True, n=2, seed=7, logprobs=1,
                     exclude_input_in_output=True, **EVERY_OUTPUT)
    assert whole["_status"] == 200, whole
    assert whole["num_output_tokens"] == [12, 12] and whole["finish_reason"] == ["length", "length"]
    assert [len(json.loads(p)) for p in whole["logprobs"]] == [12, 12]
    assert len(whole["cumulative_logprob"]) == 2 and len(whole["text_output"]) == 2


def test_sparse_outputs_carry_the_same_facts_in_fewer_tensors(server):
    """The request parameter sparse_outputs (the gateway sets it): finish_reason only
    once a completion finished, num_input_tokens in the first and the final response;
    the same totals and reasons as the dense stream, n=2 included."""
    asked = {"text_input": PROMPT, "stream": True, "return_finish_reason": True, "return_num_input_tokens": True,
             "return_num_output_tokens": True, "sampling_parameters": sampling(max_tokens=24, ignore_eos=True, n=2)}

    def take(params: dict[str, Any] | None) -> Callable[[], list[Any]]:
        def one() -> list[Any]:
            results, error = grpc_stream(server, asked, params=params)
            assert error is None and results, error
            return results
        return one

    # A first, a middle and a final response.
    dense = shaped(take(None), more_than(2))
    sparse = shaped(take({"sparse_outputs": True}), more_than(2))
    outs = [_outputs(r) for r in sparse]
    inputs = [o["num_input_tokens"] for o in outs]
    assert inputs[0] is not None and inputs[-1] is not None and all(i is None for i in inputs[1:-1]), inputs
    assert int(inputs[0][0]) == int(inputs[-1][0]) == int(_outputs(dense[0])["num_input_tokens"][0]) > 0
    reasons = [None if o["finish_reason"] is None else o["finish_reason"].tolist() for o in outs]
    assert reasons[-1] == [b"length", b"length"], reasons
    # None until the first completion finished (the two n=2 children may finish in
    # different responses); from then on each response carries it and a completion's
    # reason, once given, stays.
    first = next(i for i, r in enumerate(reasons) if r is not None)
    assert first > 0 and all(r is not None for r in reasons[first:]), reasons
    assert any(x != b"None" for x in reasons[first]), reasons
    for before, after in zip(reasons[first:-1], reasons[first + 1:], strict=True):
        assert all(a == b for a, b in zip(before, after, strict=True) if a != b"None"), reasons
    assert all(_outputs(r)["finish_reason"] is not None for r in dense)  # vllm_backend's way, without it
    totals = [sum(int(o["num_output_tokens"][i]) for o in outs) for i in range(2)]
    assert totals == [24, 24]
    bad = generate(server, text_input=PROMPT, max_tokens=2, sparse_outputs="yes")
    assert bad["_status"] == 400 and "'sparse_outputs' must be true or false" in bad["error"], bad


def test_a_stream_cannot_ask_for_the_prompt(server):
    r = requests.post(f"{server.http}/v2/models/{server.name}/generate_stream", timeout=60, json={
        "text_input": PROMPT, "stream": True, "exclude_input_in_output": False, "max_tokens": 4})
    assert "'exclude_input_in_output' cannot be false when streaming" in r.text
    _, error = grpc_stream(server, {"text_input": PROMPT, "stream": True, "exclude_input_in_output": False})
    assert error is not None and "cannot be false when streaming" in error
    # Left out, a stream carries the generated text only; not streamed, the prompt comes first.
    events = stream(server, text_input=PROMPT, max_tokens=4, ignore_eos=True, temperature=0)
    whole = generate(server, text_input=PROMPT, max_tokens=4, ignore_eos=True, temperature=0)
    assert whole["text_output"] == PROMPT + "".join(e["text_output"] for e in events)


@pytest.mark.parametrize(("value", "needle"), [(-1, "'logprobs' must be >= 0"),
                                               ("top", "'logprobs' must be an integer"),
                                               (21, "greater than max allowed: 20")])
def test_a_bad_logprobs_is_a_400_naming_it(server, value, needle):
    r = generate(server, text_input=PROMPT, max_tokens=2, logprobs=value, return_logprobs=True)
    assert r["_status"] == 400, r
    assert needle in r["error"]
