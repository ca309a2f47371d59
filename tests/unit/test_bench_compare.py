"""The ratios and goals of `make bench-compare` (llmhost.bench.compare)."""

from __future__ import annotations

import math

from llmhost.bench.compare import GOALS, Goal, check, compare, round_order
from llmhost.bench.loadgen import LevelResult


def _level(c: int, tps: float, ttft: float, errors: int = 0) -> LevelResult:
    return LevelResult(concurrency=c, requests=10, errors=errors, duration_s=1.0, requests_per_s=1.0,
                       output_tokens_per_s=tps, ttft_s={"p50": ttft})


def test_each_path_runs_first_in_turn():
    names = ["triton", "gateway", "vllm"]
    orders = [round_order(names, r) for r in range(3)]
    assert [o[0] for o in orders] == names
    assert all(sorted(o) == sorted(names) for o in orders)
    assert round_order(names, 3) == names


def test_ratios_are_medians_of_rounds_paired_in_order():
    runs = {
        "gateway": [[_level(1, 90, 0.11)], [_level(1, 50, 0.30)], [_level(1, 100, 0.10)]],
        "triton": [[_level(1, 100, 0.10)], [_level(1, 100, 0.10)], [_level(1, 100, 0.10)]],
    }
    [row] = compare(runs, "gateway", "triton")
    assert row["tps_ratios"] == [0.9, 0.5, 1.0]
    assert row["tps_ratio"] == 0.9  # the median round, not the ratio of medians (90/100 too here)
    assert math.isclose(row["ttft_ratio"], 1.1)
    assert row["gateway_tokens_per_s"] == 90 and row["triton_tokens_per_s"] == 100


def test_goal_misses_name_the_level_and_the_bound():
    goal = Goal("gateway", "triton", 0.95, 1.10)
    rows = [{"concurrency": 1, "tps_ratio": 0.96, "ttft_ratio": 1.2, "errors": 0},
            {"concurrency": 16, "tps_ratio": 0.94, "ttft_ratio": 1.0, "errors": 2}]
    assert check(goal, rows) == ["c=1: TTFT p50 1.20x of triton > 1.10",
                                 "c=16: throughput 0.94x of triton < 0.95", "c=16: 2 failed request(s)"]


def test_vllm_goal_only_counts_its_levels_and_nan_is_a_miss():
    [_, vs_vllm] = GOALS
    rows = [{"concurrency": 1, "tps_ratio": 0.1, "ttft_ratio": 9.0, "errors": 0},
            {"concurrency": 16, "tps_ratio": 0.91, "ttft_ratio": 9.0, "errors": 0},
            {"concurrency": 64, "tps_ratio": math.nan, "ttft_ratio": 1.0, "errors": 0}]
    assert check(vs_vllm, rows) == ["c=64: throughput nanx of vllm < 0.90"]


def test_the_benchmarks_gateway_takes_its_key_and_arguments(tmp_path):
    from llmhost.bench.compare import gateway_args, write_bench_key
    from llmhost.gateway.cli import build_parser, settings
    from llmhost.gateway.keys import KeyStore, load_keys

    keys_file = tmp_path / "keys.yml"
    write_bench_key(keys_file, "bench-0123456789abcdef")
    store = KeyStore(load_keys(keys_file))
    assert store.authenticate("Bearer bench-0123456789abcdef").name == "bench"
    # The arguments as the gateway's own parser reads them.
    config = settings(build_parser().parse_args(
        gateway_args("127.0.0.1:18801", "127.0.0.1:18820", "127.0.0.1:18821", keys_file, "tiny", 128)))
    assert config.upstreams == ["127.0.0.1:18801"] and config.models == ["tiny"]
    assert config.keys_file == keys_file and config.max_concurrent_upstream == 128
    assert config.listen == ("127.0.0.1", 18820) and config.log_level == "warning"


def test_the_client_goes_where_vllms_bound_workers_leave_room():
    from llmhost.bench.compare import client_cpus

    # llmhost serve with pin_frontend_cpus: tritonserver and the stub moved to CPU 1,
    # EngineCore to CPU 0: only the worker's binding counts.
    served = [("llmhost", {0, 1}), ("tritonserver", {1}), ("triton_python_backend_stub", {1}),
              ("VLLM::EngineCore", {0}), ("VLLM::Worker", {0})]
    assert client_cpus({0, 1}, served) == {1}
    # vLLM's own server: nothing moved but the worker.
    assert client_cpus({0, 1, 2, 3}, [("python", {0, 1, 2, 3}), ("VLLM::Worker", {0, 1, 2})]) == {3}
    # Workers unbound (nobind) or on every CPU: the client runs anywhere.
    assert client_cpus({0, 1}, [("VLLM::Worker", {0, 1})]) == set()
    assert client_cpus({0, 1}, [("VLLM::EngineCore", {0})]) == set()
