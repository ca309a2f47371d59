"""The additional outputs of a response, as NVIDIA's vllm_backend names and shapes them.

Pure Python (no Triton, no vLLM import). Each is sent only when its ``return_*``
input asked for it, on every response of the request, one element per completion
(``n``) except ``num_input_tokens``:

- ``finish_reason`` (STRING): vLLM's reason for a completion that finished, and
  ``"None"`` for one still running (vllm_backend sends ``str(None)``);
- ``cumulative_logprob`` (FP32): the sum of the log probabilities of the
  completion's tokens so far;
- ``logprobs`` (STRING): JSON, per token generated since the previous response, an
  object of token id -> ``{"logprob", "rank", "decoded_token"}`` (the sampled token
  and the top ``logprobs``); ``null`` when the ``logprobs`` sampling parameter was
  not given;
- ``num_input_tokens`` (UINT32, one element): the prompt's tokens;
- ``num_output_tokens`` (UINT32): the completion's tokens in this response.

With the sampling parameter ``prompt_logprobs`` (k), the request's first response
carries ``prompt_logprobs`` (STRING, one element): JSON, per prompt token, an object of
token id -> ``{"logprob", "rank", "decoded_token"}``, the prompt's own token first, then
the top k; the first token's log probability is null (nothing comes before it).

A chat that vLLM's tool or reasoning parser reads (a request with ``tools``, or a
model with a reasoning parser: llmhost.backend.replies) carries ``message`` (STRING),
per completion a JSON list: when streaming, the completion's deltas since the previous
response as vLLM's server streams them (``content``, ``reasoning``, ``tool_calls``);
otherwise, in the final response, one item: its whole message (``content``,
``reasoning``, ``tool_calls``). Its ``finish_reason`` is vLLM's server's
(``tool_calls`` where tools were called).

An embedding model (vLLM's pooling runner) answers with one final response whose
``embedding`` (FP32) holds the prompt's embedding, whatever was asked.

A request that sets the request parameter ``sparse_outputs`` (an llmhost extension; the
gateway sets it) gets ``finish_reason`` only from the response in which a completion
first finished (with ``n`` > 1 the others may finish in later ones), and
``num_input_tokens`` only in its first and its final response: the same information
in fewer tensors, as each one costs the stub and tritonserver per response.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

UNFINISHED = "None"
# The request parameter asking for sparse outputs (above).
SPARSE_OUTPUTS = "sparse_outputs"
# One position's log probabilities: token id (a string, as JSON keys are) -> its entry.
Position = dict[str, dict[str, Any]]


def position(top: Mapping[int, Any] | None) -> Position:
    """One position of vLLM's logprobs ({token id: Logprob}) as plain data."""
    return {str(token_id): {"logprob": float(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in (top or {}).items()}


def positions(seq: Iterable[Mapping[int, Any] | None] | None) -> list[Position]:
    """vLLM's logprobs of some generated tokens (a list or its FlatLogprobs) as plain data."""
    return [position(top) for top in seq or ()]


def finish_reasons(reasons: list[str]) -> list[str]:
    """The finish_reason output: ``"None"`` for a completion still running."""
    return [r or UNFINISHED for r in reasons]


def logprobs_json(per_completion: list[list[Position] | None]) -> list[str]:
    """The logprobs output: one JSON text per completion (``null`` when not asked of vLLM)."""
    return [json.dumps(p) for p in per_completion]


def response_outputs(chunk: Any, flags: frozenset[str], counted: bool) -> dict[str, list[Any]]:
    """The outputs of one response (a ``Chunk``) by name, as plain lists: ``text_output``
    and the additional outputs whose ``return_*`` input is in FLAGS. With
    SPARSE_OUTPUTS in FLAGS, ``finish_reason`` and ``num_input_tokens`` only where
    they say something (COUNTED: an earlier response already carried the prompt's
    tokens). ``cumulative_logprob`` holds None where vLLM gave none. Both the Triton
    response and the engine socket's line are built from this."""
    dense = SPARSE_OUTPUTS not in flags
    out: dict[str, list[Any]] = {"text_output": chunk.texts}
    if "return_finish_reason" in flags and (dense or chunk.final or any(chunk.finish_reasons)):
        out["finish_reason"] = finish_reasons(chunk.finish_reasons)
    if "return_cumulative_logprob" in flags:
        out["cumulative_logprob"] = chunk.cumulative_logprobs
    if "return_logprobs" in flags:
        out["logprobs"] = logprobs_json(chunk.logprobs)
    if "return_num_input_tokens" in flags and (dense or chunk.final or not counted):
        out["num_input_tokens"] = [chunk.num_input_tokens]
    if "return_num_output_tokens" in flags:
        out["num_output_tokens"] = chunk.num_output_tokens
    if chunk.embedding is not None:  # an embedding model's answer, always sent
        out["embedding"] = chunk.embedding
    if chunk.prompt_logprobs is not None:  # asked with the prompt_logprobs sampling parameter
        out["prompt_logprobs"] = [json.dumps(chunk.prompt_logprobs)]
    if chunk.messages is not None:  # a chat parsed by the model's tool or reasoning parser
        out["message"] = [json.dumps(m) for m in chunk.messages]
    return out
