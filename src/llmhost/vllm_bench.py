"""`llmhost bench --client vllm`: vLLM's own benchmark client (`vllm bench serve`) against
an OpenAI-compatible endpoint (llmhost's gateway, `vllm serve`, any other), run in
this process, one concurrency level at a time, so that a comparison uses the client
the vLLM community uses.

vLLM's random dataset (token ids drawn from the tokenizer's vocabulary) needs the
model's tokenizer (``--tokenizer``). Each level reports output tokens/s, TTFT and ITL
(p50, p99) as vLLM computes them, failed requests, and tokens per streamed event:
the output tokens over the events that carried them (vLLM records one inter-token
latency per event after the first), 1.0 when every engine step reached the client
as its own event.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class VllmLevel:
    concurrency: int
    completed: int
    failed: int
    output_tokens_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tokens_per_event: float
    duration_s: float


def client_argv(base_url: str, model: str, tokenizer: str, concurrency: int, requests: int, input_len: int,
                output_len: int, seed: int = 0, ignore_eos: bool = True) -> list[str]:
    """`vllm bench serve`'s arguments for one level against BASE_URL (``/v1`` is taken off)."""
    argv = ["--backend", "openai", "--base-url", base_url.rstrip("/").removesuffix("/v1"),
            "--endpoint", "/v1/completions", "--model", model, "--served-model-name", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--max-concurrency", str(concurrency),
            "--num-prompts", str(requests), "--seed", str(seed), "--percentile-metrics", "ttft,itl",
            "--metric-percentiles", "50,99", "--save-detailed", "--disable-tqdm"]
    return [*argv, "--ignore-eos"] if ignore_eos else argv


def tokens_per_event(result: dict[str, Any]) -> float:
    """Output tokens per streamed event over the requests that produced output."""
    tokens = events = 0
    for out_len, itls in zip(result.get("output_lens", []), result.get("itls", []), strict=False):
        if out_len:
            tokens += out_len
            events += len(itls) + 1
    return round(tokens / events, 3) if events else 0.0


def summarize(concurrency: int, result: dict[str, Any]) -> VllmLevel:
    return VllmLevel(
        concurrency=concurrency, completed=int(result.get("completed", 0)), failed=int(result.get("failed", 0)),
        output_tokens_per_s=float(result.get("output_throughput", 0.0)),
        ttft_ms={p: float(result.get(f"{p}_ttft_ms", 0.0)) for p in ("median", "p99")},
        itl_ms={p: float(result.get(f"{p}_itl_ms", 0.0)) for p in ("median", "p99")},
        tokens_per_event=tokens_per_event(result), duration_s=float(result.get("duration", 0.0)))


@contextlib.contextmanager
def _api_key(key: str | None) -> Iterator[None]:
    """vLLM's client sends $OPENAI_API_KEY as the bearer token."""
    before = os.environ.get("OPENAI_API_KEY")
    if key is not None:
        os.environ["OPENAI_API_KEY"] = key
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OPENAI_API_KEY", None)
        else:
            os.environ["OPENAI_API_KEY"] = before


def run_level(argv: list[str], api_key: str | None = None) -> dict[str, Any]:
    """One `vllm bench serve` run in this process; its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM (0.20 on the GPU kit)
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args: argparse.Namespace = parser.parse_args(argv)
    with _api_key(api_key):
        return dict(main(args))


def table(levels: list[VllmLevel]) -> str:
    head = (f"{'conc':>5} {'done':>5} {'fail':>5} {'out tok/s':>10} {'TTFT p50':>9} {'p99':>8} "
            f"{'ITL p50':>8} {'p99':>8} {'tok/event':>9}   (ms; vLLM's client)")
    rows = [f"{r.concurrency:>5} {r.completed:>5} {r.failed:>5} {r.output_tokens_per_s:>10.1f} "
            f"{r.ttft_ms['median']:>9.1f} {r.ttft_ms['p99']:>8.1f} {r.itl_ms['median']:>8.2f} "
            f"{r.itl_ms['p99']:>8.2f} {r.tokens_per_event:>9.2f}" for r in levels]
    return "\n".join([head, *rows])
