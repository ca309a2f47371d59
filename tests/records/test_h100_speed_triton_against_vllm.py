"""The GPU speed run recorded on the real H100 (lab/gpu_speed.py, vLLM 0.20.2,
2026-11-24): the Triton path (`llmhost serve --device gpu`, one response per engine step)
against vLLM's own OpenAI server, same model and engine arguments, 3 alternating rounds,
plus the grouped mode (default stream window). The facts docs/performance-history.md states are
checked here from the raw per-round numbers, so the record and the claims made from it
cannot drift apart. The script's pure helpers are checked in tests/unit/test_gpu_speed_watch.py."""

from __future__ import annotations

import json
import statistics

import pytest

from lab.gpucheck import speed as gpu_speed
from tests.harness.paths import ROOT

RUN = ROOT / "tests" / "fixtures" / "gpu" / "h100-580.159.04-real" / "device-run-2026-11-24-speed2"
LEVELS = [1, 16, 64, 256]
SIDES = ("triton", "vllm", "grouped")



def _result() -> dict:
    return json.loads((RUN / "result.json").read_text())


def _sweeps(side: str) -> list[dict]:
    return _result()["runs"][side]


def test_recorded_on_the_h100_with_vllm_0_20_2_and_the_qwen3_shaped_model():
    res = _result()
    assert res["gpu"] == "NVIDIA H100 80GB HBM3, 580.159.04" and res["vllm"] == "0.20.2"
    assert "NVIDIA H100 80GB HBM3" in (RUN / "nvidia-smi.txt").read_text()
    assert res["model"]["architectures"] == ["Qwen3ForCausalLM"]
    assert (res["model"]["hidden_size"], res["model"]["num_hidden_layers"], res["model"]["vocab_size"]) == (1024, 28,
                                                                                                          4096)
    assert 800e6 < res["model"]["bytes"] < 1e9  # 445M bf16 parameters
    assert res["cpus"] == 16 and res["servers"] == "together"
    assert "exception" not in res and res["skipped"] == []


def test_the_workload_64_words_in_128_tokens_out_at_1_to_256():
    w = _result()["workload"]
    assert w["concurrency"] == LEVELS and w["prompt_words"] == 64 and w["output_tokens"] == 128
    assert w["ignore_eos"] is True and w["duration_s"] >= 10 and w["client_processes"] == 8
    for side in SIDES:
        for sweep in _sweeps(side):
            meta = sweep["meta"]
            assert meta["processes"] == 8 and meta["workload"]["duration_s"] == w["duration_s"]
            assert (meta["workload"]["prompt_words"], meta["workload"]["output_tokens"]) == (64, 128)
            assert meta["workload"]["ignore_eos"] is True
            assert meta["kind"] == ("openai" if side == "vllm" else "http")


@pytest.mark.parametrize("side", SIDES)
def test_three_rounds_every_level_no_errors(side):
    sweeps = _sweeps(side)
    assert [s["round"] for s in sweeps] == [0, 1, 2]
    for sweep in sweeps:
        assert [lv["concurrency"] for lv in sweep["levels"]] == LEVELS
        for lv in sweep["levels"]:
            assert lv["errors"] == 0 and lv["first_error"] == "" and lv["requests"] > 0
            assert lv["duration_s"] >= 12.0 and lv["output_tokens_per_s"] > 0
            # Every request of ignore_eos ran to 128 tokens: tokens/s over requests/s.
            assert lv["output_tokens_per_s"] / lv["requests_per_s"] == pytest.approx(128, rel=1e-6)
            assert lv["client_processes"] == min(8, lv["concurrency"])


def test_rounds_alternate_which_side_goes_first():
    res = _result()
    assert res["order"] == [["triton", "vllm", "grouped"], ["vllm", "triton", "grouped"],
                            ["triton", "vllm", "grouped"]]
    assert [gpu_speed.order(r) for r in range(3)] == [o[:2] for o in res["order"]]


def test_engine_arguments_are_the_same_on_every_side():
    res = _result()
    args = res["engine_args"]
    assert args["triton"] == args["vllm"] == args["grouped"] == {
        "served_model_name": "llm", "max_model_len": 4096, "gpu_memory_utilization": 0.25}
    # What each engine logged it runs with: one config, vLLM 0.20.2, on all three.
    configs = res["engine_config"]
    assert set(configs) == set(SIDES) and res["engine_config_equal"] is True
    assert {c["version"] for c in configs.values()} == {"v0.20.2"}
    assert len({c["config"] for c in configs.values()}) == 1
    assert "max_seq_len=4096" in configs["triton"]["config"] and "enforce_eager=False" in configs["triton"]["config"]
    # vLLM's server was given exactly those arguments (its own log's account) ...
    vllm_log = (RUN / "vllm-server.log").read_text()
    assert ("non-default args: {'host': '127.0.0.1', 'port': 18620, 'model': '/tmp/lh-qwen3', 'max_model_len': 4096, "
            "'served_model_name': ['llm'], 'gpu_memory_utilization': 0.25}") in vllm_log
    # ... and both paths got vLLM's server scheduler defaults on the H100 (commit 642d6f0).
    for side in SIDES:
        log = (RUN / gpu_speed.LOGS[side]).read_text()
        assert "Chunked prefill is enabled with max_num_batched_tokens=8192." in log
    assert "stream interval 0 ms" in (RUN / "serve-triton.log").read_text()
    assert "stream interval 50 ms" in (RUN / "serve-grouped.log").read_text()


def _recomputed(path: str, base: str = "vllm") -> list[dict]:
    """Medians of the per-round ratios, straight from the sweeps (not the script's code)."""
    rows = []
    for i, c in enumerate(LEVELS):
        a = [s["levels"][i] for s in _sweeps(path)]
        b = [s["levels"][i] for s in _sweeps(base)]
        tps = [x["output_tokens_per_s"] / y["output_tokens_per_s"] for x, y in zip(a, b, strict=True)]
        ttft = [x["ttft_s"]["p50"] / y["ttft_s"]["p50"] for x, y in zip(a, b, strict=True)]
        rows.append({"concurrency": c, "tps_ratios": tps, "tps_ratio": statistics.median(tps),
                     "ttft_ratio": statistics.median(ttft),
                     "path_tps": statistics.median(x["output_tokens_per_s"] for x in a),
                     "base_tps": statistics.median(y["output_tokens_per_s"] for y in b)})
    return rows


@pytest.mark.parametrize("path", ["triton", "grouped"])
def test_reported_medians_are_the_raw_per_round_ratios(path):
    reported = _result()["summary"][f"{path}/vllm"]["rows"]
    again = gpu_speed.ratios(_result()["runs"], path, "vllm")  # today's code over the recorded sweeps
    for rep, mine, today in zip(reported, _recomputed(path), again, strict=True):
        assert rep["concurrency"] == mine["concurrency"] == today["concurrency"]
        assert rep["tps_ratios"] == pytest.approx(mine["tps_ratios"])
        assert rep["tps_ratio"] == pytest.approx(mine["tps_ratio"]) == today["tps_ratio"]
        assert rep["ttft_ratio"] == pytest.approx(mine["ttft_ratio"]) == today["ttft_ratio"]
        assert rep[f"{path}_tokens_per_s"] == pytest.approx(mine["path_tps"])
        assert rep["vllm_tokens_per_s"] == pytest.approx(mine["base_tps"])
        assert rep["errors"] == 0


def test_the_goal_verdict_as_docs_performance_states_it():
    """0.97x throughput and at most 1.10x TTFT p50 of vLLM's server at every level, per-step
    streaming: met at c=1 and c=64, missed at c=16 (both) and c=256 (throughput)."""
    res = _result()
    rows = {r["concurrency"]: r for r in _recomputed("triton")}
    assert [round(rows[c]["tps_ratio"], 2) for c in LEVELS] == [1.00, 0.78, 0.97, 0.65]
    assert [round(rows[c]["ttft_ratio"], 2) for c in LEVELS] == [0.98, 1.19, 0.82, 0.85]
    missed = gpu_speed.misses(res["summary"]["triton/vllm"]["rows"])
    assert missed == res["summary"]["triton/vllm"]["misses"] == [
        "c=16: throughput 0.78x of vllm < 0.97", "c=16: TTFT p50 1.19x of vllm > 1.10",
        "c=256: throughput 0.65x of vllm < 0.97"]
    assert res["goal_met"] is False
    grouped = {r["concurrency"]: r for r in _recomputed("grouped")}
    assert [round(grouped[c]["tps_ratio"], 2) for c in LEVELS] == [0.95, 0.74, 0.89, 1.33]
    assert [round(grouped[c]["ttft_ratio"], 2) for c in LEVELS] == [1.11, 1.07, 0.53, 0.64]


def test_the_client_was_not_the_limit():
    for side in SIDES:
        for sweep in _sweeps(side):
            for lv in sweep["levels"]:
                # The busiest of the 8 client processes used under a fifth of one core.
                assert lv["client_cpu_max_s"] < 0.2 * lv["duration_s"]
                # And the whole machine (16 cores) was never near busy.
                assert lv["samples"]["cpu_cores_busy"] < 6


def test_idle_servers_stayed_idle_and_the_gpu_was_not_saturated():
    for side in SIDES:
        for sweep in _sweeps(side):
            for other, used in sweep["server_cpu_s"].items():
                if other != side:
                    assert sum(used.values()) < 2.0, (side, other, used)
            # The measured server's engine process: near one core for the whole sweep.
            assert sweep["server_cpu_s"][side]["VLLM::EngineCore"] > 0.75 * sweep["seconds"]
            for lv in sweep["levels"]:
                assert 15 < lv["samples"]["gpu_util_pct"] < 75
    csv = (RUN / "gpu-samples.csv").read_text().splitlines()
    assert csv[0] == "time,utilization_gpu_pct,memory_used_mib,power_w" and len(csv) > 1000
