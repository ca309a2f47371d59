"""lab.gpu_routing_check's second yardstick, vLLM's own data parallel on the replicas' two
GPUs (policy ``vllm_dp``): its ratios and acceptance checks, its command line, and the
arguments it needs. The GPU run itself is lab work (docs/performance.md)."""

from __future__ import annotations

import copy

import pytest

from lab.gpu_routing_check import (
    ACCEPTANCE,
    DP_ACCEPTANCE,
    YARDSTICK,
    acceptance,
    main,
    ratios,
    ttft_spread,
    vllm_flags,
)


def _run(policy: str, rnd: int, tps: float, ttft: float, c: int = 64) -> dict:
    return {"workload": "prefix", "concurrency": c, "policy": policy, "round": rnd, "output_tokens_per_s": tps,
            "ttft_ms": {"median": ttft}, "itl_ms": {"median": 10.0}, "fleet_hit_rate": 0.5}


def test_cache_aware_is_compared_with_vllms_data_parallel_round_by_round():
    runs = [_run("cache_aware", 0, 1100.0, 90.0), _run(YARDSTICK, 0, 1000.0, 100.0),
            _run("cache_aware", 1, 900.0, 120.0), _run(YARDSTICK, 1, 1000.0, 100.0),
            _run("round_robin", 1, 800.0, 200.0)]
    rows = {r["base"]: r for r in ratios(runs)}
    assert set(rows) == {YARDSTICK, "round_robin"}
    dp = rows[YARDSTICK]
    assert dp["tps_rounds"] == [1.1, 0.9] and dp["ttft_p50_rounds"] == [0.9, 1.2] and dp["rounds"] == 2
    assert rows["round_robin"]["rounds"] == 1  # only the round where both ran


def test_the_data_parallel_checks_join_the_issues_only_where_it_ran():
    without = [_run("cache_aware", 0, 1400.0, 40.0), _run("round_robin", 0, 1000.0, 100.0)]
    assert [(g["base"], g["concurrency"]) for g in acceptance(ratios(without))] == [
        (g["base"], g["concurrency"]) for g in ACCEPTANCE]
    runs = [*without, _run(YARDSTICK, 0, 1300.0, 50.0), _run("cache_aware", 0, 1000.0, 90.0, c=256),
            _run(YARDSTICK, 0, 1100.0, 80.0, c=256)]
    checks = {(g["base"], g["concurrency"]): g for g in acceptance(ratios(runs))}
    assert len(checks) == len(ACCEPTANCE) + len(DP_ACCEPTANCE)
    assert checks[(YARDSTICK, 64)]["held"] is True  # 1.08x the tokens, 0.8x the TTFT p50
    assert checks[(YARDSTICK, 256)]["held"] is False  # fewer tokens per second than vLLM's
    slower_first_token = copy.deepcopy(runs)
    slower_first_token[2]["ttft_ms"]["median"] = 30.0
    assert {(g["base"], g["concurrency"]): g["held"]
            for g in acceptance(ratios(slower_first_token))}[(YARDSTICK, 64)] is False


def test_engine_arguments_become_vllms_flags():
    assert vllm_flags({"served_model_name": "llm", "enable_prefix_caching": True, "enforce_eager": False,
                       "kv_cache_memory_bytes": 17179869184, "gpu_memory_utilization": 0.4}) == [
        "--served-model-name", "llm", "--enable-prefix-caching", "--no-enforce-eager",
        "--kv-cache-memory-bytes", "17179869184", "--gpu-memory-utilization", "0.4"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--policies", f"round_robin,{YARDSTICK}"], "it needs --replica-per-gpu"),
    (["--policies", "round_robin,fastest"], "each one of cache_aware, round_robin, least_loaded, kv_events, vllm_dp"),
])
def test_bad_policies_are_refused_before_anything_starts(tmp_path, capsys, argv: list[str], needle: str):
    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path / "out"), *argv])
    assert exited.value.code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_runs_ttfts_are_kept_as_deciles_and_the_median_of_each_half():
    # A slow first half (a cold start) and a fast second half: the overall median hides it.
    result = {"ttfts": [1.0] * 10 + [0.1] * 10}
    spread = ttft_spread(result)
    assert spread["ttft_ms_median_by_half"] == [1000.0, 100.0]
    deciles = spread["ttft_ms_deciles"]
    assert len(deciles) == 9 and deciles[0] == 100.0 and deciles[-1] == 1000.0
    assert ttft_spread({"ttfts": [0.1] * 5}) == {} and ttft_spread({}) == {}


def test_kv_events_is_compared_with_the_bases_and_cache_aware_and_has_its_own_acceptance():
    runs = [_run("kv_events", 0, 1400.0, 40.0), _run("cache_aware", 0, 1300.0, 50.0),
            _run("round_robin", 0, 1000.0, 100.0)]
    rows = {(r["policy"], r["base"]): r for r in ratios(runs)}
    assert set(rows) == {("kv_events", "round_robin"), ("kv_events", "cache_aware"), ("cache_aware", "round_robin")}
    assert rows[("kv_events", "cache_aware")]["tps_rounds"] == [round(1400 / 1300, 4)]
    verdicts = acceptance(list(rows.values()), "kv_events")
    prefix64 = next(v for v in verdicts if v["workload"] == "prefix" and v["concurrency"] == 64)
    assert (prefix64["tps"], prefix64["ttft_p50"], prefix64["held"]) == (1.4, 0.4, True)
    assert next(v for v in acceptance(list(rows.values())) if v["concurrency"] == 64
                and v["workload"] == "prefix")["tps"] == 1.3
