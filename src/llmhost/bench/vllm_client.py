"""`llmhost bench --client vllm`: vLLM's own benchmark client (`vllm bench serve`) against
an OpenAI-compatible endpoint (llmhost's gateway, `vllm serve`, any other), run in
this process, one concurrency level at a time, so that a comparison uses the client
the vLLM community uses.

vLLM's client has no request function for Triton's generate API; for ``kind`` ``http``
this module adds one (``TRITON_BACKEND``) that streams ``/v2/models/<m>/generate_stream``
(Triton's own port, or the gateway's) and counts each SSE event with output as vLLM's
OpenAI function counts a chunk: the rest (prompts, pacing, metrics) is vLLM's.

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


TRITON_BACKEND = "llmhost-triton-generate"


def client_argv(base_url: str, model: str, tokenizer: str, concurrency: int, requests: int, input_len: int,
                output_len: int, seed: int = 0, ignore_eos: bool = True, kind: str = "openai",
                shared_prefixes: int = 0, prefix_len: int = 0) -> list[str]:
    """`vllm bench serve`'s arguments for one level against BASE_URL (``/v1`` is taken off):
    OpenAI's /v1/completions, or for KIND ``http`` Triton's generate_stream. Random
    prompts of INPUT_LEN tokens or, with SHARED_PREFIXES, vLLM's prefix_repetition
    dataset: that many prefixes of PREFIX_LEN tokens, each prompt one of them and a
    suffix of INPUT_LEN tokens."""
    backend, endpoint = ("openai", "/v1/completions") if kind == "openai" else (
        TRITON_BACKEND, f"/v2/models/{model}/generate_stream")
    if shared_prefixes:
        dataset = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len),
                   "--prefix-repetition-suffix-len", str(input_len), "--prefix-repetition-num-prefixes",
                   str(shared_prefixes), "--prefix-repetition-output-len", str(output_len)]
    else:
        dataset = ["--dataset-name", "random", "--random-input-len", str(input_len),
                   "--random-output-len", str(output_len)]
    argv = ["--backend", backend, "--base-url", base_url.rstrip("/").removesuffix("/v1"),
            "--endpoint", endpoint, "--model", model, "--served-model-name", model,
            "--tokenizer", tokenizer, *dataset, "--max-concurrency", str(concurrency),
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


def _event_tokens(data: dict[str, Any]) -> int:
    """Output tokens in one generate_stream event (``num_output_tokens``, a number or a list)."""
    raw = data.get("num_output_tokens", 0)
    return int(sum(raw)) if isinstance(raw, list) else int(raw or 0)


async def triton_generate_stream(request_func_input: Any, session: Any, pbar: Any = None) -> Any:
    """vLLM's client's request function for Triton's ``generate_stream`` (SSE, one event
    per engine step as llmhost sends them): the first event with output tokens gives TTFT,
    each later one an inter-token latency, as vLLM's OpenAI function does per chunk.
    ``$OPENAI_API_KEY`` goes as the bearer token (the gateway's native door needs one)."""
    import json
    import sys
    import time
    import traceback

    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

    payload: dict[str, Any] = {"text_input": request_func_input.prompt, "stream": True,
                               "max_tokens": request_func_input.output_len, "return_num_output_tokens": True}
    if request_func_input.ignore_eos:
        payload["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {key}"} if (key := os.environ.get("OPENAI_API_KEY")) else {}
    output = RequestFuncOutput()
    output.prompt_len = request_func_input.prompt_len
    start = last = time.perf_counter()
    output.start_time = start
    text, tokens, first = "", 0, True
    try:
        async with session.post(url=request_func_input.api_url, json=payload, headers=headers) as response:
            if response.status != 200:
                output.error, output.success = f"HTTP {response.status}: {await response.text()}", False
            else:
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = json.loads(line[5:])
                    if "error" in data:
                        raise RuntimeError(str(data["error"]))
                    n = _event_tokens(data)
                    if n <= 0:
                        continue
                    now = time.perf_counter()
                    if first:
                        output.ttft, first = now - start, False
                    else:
                        output.itl.append(now - last)
                    last = now
                    tokens += n
                    text += str(data.get("text_output", ""))
                output.success = not first
                if first:
                    output.error = "no event with output tokens"
                output.generated_text, output.output_tokens, output.latency = text, tokens, last - start
    except Exception:  # noqa: BLE001 - recorded as a failed request, as vLLM's own functions do
        output.success = False
        output.error = "".join(traceback.format_exception(*sys.exc_info()))
    if pbar:
        pbar.update(1)
    return output


def register_triton_backend() -> None:
    """Make TRITON_BACKEND one of vLLM's client's backends (before its arguments are built)."""
    from vllm.benchmarks.lib import endpoint_request_func

    endpoint_request_func.ASYNC_REQUEST_FUNCS.setdefault(TRITON_BACKEND, triton_generate_stream)


def run_level(argv: list[str], api_key: str | None = None) -> dict[str, Any]:
    """One `vllm bench serve` run in this process; its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main

    register_triton_backend()

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
