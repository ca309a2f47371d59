"""What the engine side puts in each response (engine.EngineRunner._generate) from
vLLM's outputs, with a stand-in engine: per-response token counts and log
probabilities, finish reasons and cumulative log probabilities carried per
completion, n > 1, streamed and not."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from llmhost.backend.config import parse_model_config
from llmhost.backend.engine import EngineRunner
from llmhost.backend.metrics import ServingMetrics
from llmhost.backend.request import GenerateJob
from tests.unit._engine_fakes import Engine, Sink, generate


def lp(value: float) -> SimpleNamespace:
    return SimpleNamespace(logprob=value, rank=1, decoded_token="t")


def co(index: int, text: str, tokens: list[int], cumulative: float | None, reason: str | None = None,
       logprobs: list[dict[int, Any]] | None = None) -> SimpleNamespace:
    return SimpleNamespace(index=index, text=text, token_ids=tokens, cumulative_logprob=cumulative,
                           finish_reason=reason, logprobs=logprobs)


def run(outputs: list[SimpleNamespace], job: GenerateJob, n: int) -> Sink:
    sink = generate(Engine(outputs), job, n)
    assert not sink.errors, sink.errors
    return sink


def every(stream: bool, logprobs: int | None = 1) -> GenerateJob:
    sampling: dict[str, Any] = {"max_tokens": 8, **({} if logprobs is None else {"logprobs": logprobs})}
    return GenerateJob(prompt="hi", messages=None, stream=stream, exclude_input=False, sampling=sampling,
                       return_cumulative_logprob=True, return_logprobs=True)


def test_a_streams_responses_carry_each_steps_own_tokens_per_completion():
    a, b = {1: lp(-0.5)}, {2: lp(-0.25)}
    outputs = [SimpleNamespace(finished=False, outputs=[co(0, "x", [1], -0.5, logprobs=[a])]),
               SimpleNamespace(finished=False, outputs=[co(1, "y", [2], -0.25, logprobs=[b])]),
               SimpleNamespace(finished=True, outputs=[co(0, "z", [1, 1], -1.5, "length", [a, a]),
                                                       co(1, "", [], -0.25, "stop", [])])]
    sink = run(outputs, every(stream=True), n=2)
    assert [c.texts for c in sink.chunks] == [["x", ""], ["", "y"], ["z", ""]]  # never the prompt in a stream
    assert [c.num_output_tokens for c in sink.chunks] == [[1, 0], [0, 1], [2, 0]]
    assert [c.finish_reasons for c in sink.chunks] == [["", ""], ["", ""], ["length", "stop"]]
    # A completion absent from a step keeps its last cumulative log probability.
    assert [c.cumulative_logprobs for c in sink.chunks] == [[-0.5, None], [-0.5, -0.25], [-1.5, -0.25]]
    pos = {"1": {"logprob": -0.5, "rank": 1, "decoded_token": "t"}}
    assert sink.chunks[2].logprobs == [[pos, pos], []]
    assert [c.final for c in sink.chunks] == [False, False, True]
    assert {c.num_input_tokens for c in sink.chunks} == {3}


def test_not_streamed_one_response_with_the_prompt_and_null_logprobs_without_the_parameter():
    outputs = [SimpleNamespace(finished=True, outputs=[co(0, "ab", [4, 5], -1.0, "length", [{4: lp(-1.0)}] * 2)])]
    (only,) = run(outputs, every(stream=False, logprobs=None), n=1).chunks
    assert only.texts == ["hiab"] and only.num_output_tokens == [2] and only.final
    assert only.logprobs == [None] and only.cumulative_logprobs == [-1.0]


def test_outputs_not_asked_for_stay_empty():
    outputs = [SimpleNamespace(finished=True, outputs=[co(0, "ab", [4, 5], None, "stop")])]
    job = GenerateJob(prompt="hi", messages=None, stream=False, exclude_input=True, sampling={"max_tokens": 8})
    (only,) = run(outputs, job, n=1).chunks
    assert only.texts == ["ab"] and only.logprobs == [] and only.cumulative_logprobs == []


def test_cumulative_logprob_asks_vllm_for_the_sampled_tokens_logprob_only():
    runner = EngineRunner(parse_model_config({"model": "/m"}), ServingMetrics(), lambda m: None)
    runner._max_model_len = 64
    job = GenerateJob(prompt="hi", messages=None, stream=True, exclude_input=True, sampling={"max_tokens": 8},
                      return_cumulative_logprob=True)
    assert runner._sampling_params(job, 3).logprobs == 0
    job.sampling["logprobs"] = 3  # the client's own k stays
    assert runner._sampling_params(job, 3).logprobs == 3
    job.return_cumulative_logprob = False
    job.sampling.pop("logprobs")
    assert runner._sampling_params(job, 3).logprobs is None


def test_the_prompts_log_probabilities_go_in_the_first_response_only():
    """The prompt_logprobs sampling parameter: vLLM's list (None first) becomes one
    position per prompt token, the first with its text and a null log probability;
    -inf becomes -9999.0, as vLLM's server sends it."""
    prompt = [None, {8: lp(-1.5), 3: lp(-0.5)}, {9: SimpleNamespace(logprob=float("-inf"), rank=9,
                                                                     decoded_token="z")}]
    outs = [SimpleNamespace(outputs=[co(0, "a", [1], None)], finished=False, prompt_token_ids=[7, 8, 9],
                            prompt_logprobs=prompt),
            SimpleNamespace(outputs=[co(0, "b", [2], None, "length")], finished=True, prompt_token_ids=[7, 8, 9],
                            prompt_logprobs=prompt)]
    job = GenerateJob(prompt="hi", messages=None, stream=True, exclude_input=True,
                      sampling={"max_tokens": 2, "prompt_logprobs": 1})
    tokenizer = SimpleNamespace(decode=lambda ids: f"<{ids[0]}>")
    sink = generate(Engine(outs), job, 1, _tokenizer=tokenizer)
    assert not sink.errors, sink.errors
    first, second = sink.chunks
    assert first.prompt_logprobs == [
        {"7": {"logprob": None, "rank": None, "decoded_token": "<7>"}},
        {"8": {"logprob": -1.5, "rank": 1, "decoded_token": "t"}, "3": {"logprob": -0.5, "rank": 1,
                                                                         "decoded_token": "t"}},
        {"9": {"logprob": -9999.0, "rank": 9, "decoded_token": "z"}}]
    assert second.prompt_logprobs is None
    plain = generate(Engine(outs), GenerateJob(prompt="hi", messages=None, stream=True, exclude_input=True,
                                               sampling={"max_tokens": 2}), 1)
    assert [c.prompt_logprobs for c in plain.chunks] == [None, None]
