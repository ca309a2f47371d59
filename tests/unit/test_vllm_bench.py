"""llmhost.bench.vllm_client's own parts: the arguments vLLM's parser takes, and tokens per
streamed event from vLLM's per-request results."""

from __future__ import annotations

import pytest

from llmhost.bench.vllm_client import (
    TRITON_BACKEND,
    _event_tokens,
    client_argv,
    register_triton_backend,
    summarize,
    tokens_per_event,
    triton_generate_stream,
)


def test_vllms_own_parser_takes_the_arguments():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(client_argv("http://gw:18080/v1/", "tiny", "/models/tiny", 16, 64, 256, 128))
    assert args.base_url == "http://gw:18080" and args.endpoint == "/v1/completions"
    assert (args.max_concurrency, args.num_prompts, args.random_input_len, args.random_output_len) == (16, 64, 256, 128)
    assert args.ignore_eos and args.save_detailed and args.served_model_name == "tiny"
    assert not parser.parse_args(client_argv("http://x", "m", "/t", 1, 1, 8, 8, ignore_eos=False)).ignore_eos


def test_triton_generate_stream_is_a_backend_of_vllms_client():
    from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    register_triton_backend()
    assert ASYNC_REQUEST_FUNCS[TRITON_BACKEND] is triton_generate_stream
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(client_argv("http://gw:18080", "tiny", "/models/tiny", 4, 8, 16, 8, kind="http"))
    assert args.backend == TRITON_BACKEND and args.endpoint == "/v2/models/tiny/generate_stream"


@pytest.mark.parametrize(("event", "tokens"), [
    ({"text_output": "a", "num_output_tokens": 1}, 1), ({"num_output_tokens": [2, 1]}, 3),
    ({"text_output": ""}, 0), ({"num_output_tokens": None}, 0)])
def test_event_tokens(event, tokens):
    assert _event_tokens(event) == tokens


@pytest.mark.parametrize(("output_lens", "itls", "expected"), [
    ([4, 4], [[0.01] * 3, [0.01] * 3], 1.0),  # an event per token
    ([8], [[0.02] * 3], 2.0),  # 8 tokens in 4 events
    ([0, 6], [[], [0.01] * 2], 2.0),  # a failed request (no output) does not count
    ([], [], 0.0),
])
def test_tokens_per_event(output_lens: list[int], itls: list[list[float]], expected: float):
    assert tokens_per_event({"output_lens": output_lens, "itls": itls}) == expected


def test_summary_reads_vllms_keys():
    level = summarize(8, {"completed": 10, "failed": 1, "output_throughput": 123.4, "median_ttft_ms": 5.0,
                          "p99_ttft_ms": 9.0, "median_itl_ms": 1.5, "p99_itl_ms": 3.0, "duration": 2.0,
                          "output_lens": [2], "itls": [[0.1]]})
    assert (level.completed, level.failed, level.output_tokens_per_s) == (10, 1, 123.4)
    assert level.ttft_ms == {"median": 5.0, "p99": 9.0} and level.itl_ms == {"median": 1.5, "p99": 3.0}
    assert level.tokens_per_event == 1.0


def test_shared_prefixes_use_vllms_prefix_repetition_dataset():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(client_argv("http://gw:18080/v1", "tiny", "/models/tiny", 64, 256, 200, 128,
                                         shared_prefixes=32, prefix_len=2000))
    assert args.dataset_name == "prefix_repetition"
    assert (args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len) == (2000, 200, 32, 128)
