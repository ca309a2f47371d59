"""The H100 speed runs of 2026-11-25 (lab/gpu_speed.py with per-thread CPU and
the servers' metrics sampled per level, vLLM 0.20.2): why the per-step Triton path trails
vLLM's own server at c=16 and c=256. The facts docs/performance-history.md ("What is left on the
H100") states are checked here from the recorded raw numbers.

* ``device-run-2026-11-25-apart``: servers started apart (one at a time, vLLM's default
  memory share 0.9), 3 rounds: the per-step Triton path, vLLM's server, and the per-step
  path with its engine loop on uvloop (LLMHOST_EVENT_LOOP=uvloop).
* ``device-run-2026-11-25-variants``: the four servers resident together (0.2 each), 4
  rounds: the same three plus the per-step path with 4 response threads
  (``--setting response_threads=4``); here the servers' metrics pages give vLLM's own
  latency histograms per level (the same stats code on both sides)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from lab.gpucheck import speed as gpu_speed
from tests.harness.paths import ROOT

REAL = ROOT / "tests" / "fixtures" / "gpu" / "h100-580.159.04-real"
APART = REAL / "device-run-2026-11-25-apart"
VARIANTS = REAL / "device-run-2026-11-25-variants"
LEVELS = [16, 256]
TRITON_SIDES = ("triton", "uvloop", "variant")



def _result(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())


def _levels(run: Path, side: str, c: int) -> list[dict]:
    i = LEVELS.index(c)
    return [sweep["levels"][i] for sweep in _result(run)["runs"][side]]


def _ratios(run: Path, path: str, base: str, c: int, key: str = "tps") -> list[float]:
    a, b = _levels(run, path, c), _levels(run, base, c)
    if key == "tps":
        return [x["output_tokens_per_s"] / y["output_tokens_per_s"] for x, y in zip(a, b, strict=True)]
    return [x["ttft_s"]["p50"] / y["ttft_s"]["p50"] for x, y in zip(a, b, strict=True)]


def _median(run: Path, path: str, base: str, c: int, key: str = "tps") -> float:
    return round(statistics.median(_ratios(run, path, base, c, key)), 2)


def _thread(level: dict, comm: str) -> float:
    """The busiest thread's CPU (cores) among those named COMM."""
    return max((g["max_thread_cores"] for g in level["threads"]["by_comm"] if g["comm"] == comm), default=0.0)


@pytest.mark.parametrize("run, sides, rounds", [(APART, ("triton", "vllm", "uvloop"), 3),
                                                (VARIANTS, ("triton", "vllm", "uvloop", "variant"), 4)])
def test_recorded_on_the_h100_every_level_complete_and_error_free(run, sides, rounds):
    res = _result(run)
    assert res["gpu"] == "NVIDIA H100 80GB HBM3, 580.159.04" and res["vllm"] == "0.20.2" and res["cpus"] == 16
    assert "NVIDIA H100 80GB HBM3" in (run / "nvidia-smi.txt").read_text()
    assert "exception" not in res and res["skipped"] == [] and res["engine_config_equal"] is True
    assert set(res["runs"]) == set(sides) and res["watch"] == {"threads": True, "thread_names": True,
                                                               "interval_s": 1.0}
    w = res["workload"]
    assert w["concurrency"] == LEVELS and w["duration_s"] == 12.0 and w["client_processes"] == 8
    assert (w["prompt_words"], w["output_tokens"], w["ignore_eos"]) == (64, 128, True)
    # Each side went first once in `len(sides)` rounds (the rotation of gpu_speed.order).
    assert res["order"] == [gpu_speed.order(r, list(sides)) for r in range(rounds)]
    for side in sides:
        assert [s["round"] for s in res["runs"][side]] == list(range(rounds))
        for c in LEVELS:
            for lv in _levels(run, side, c):
                assert lv["errors"] == 0 and lv["requests"] > 0 and lv["duration_s"] >= 12.0
                assert lv["output_tokens_per_s"] / lv["requests_per_s"] == pytest.approx(128, rel=1e-6)
                assert lv["threads"]["samples"] >= 10 and lv["scheduler"]["samples"] >= 20


def test_how_the_servers_ran():
    apart, together = _result(APART), _result(VARIANTS)
    assert apart["servers"] == "apart" and together["servers"] == "together"
    assert {a["gpu_memory_utilization"] for a in apart["engine_args"].values()} == {0.9}
    assert {a["gpu_memory_utilization"] for a in together["engine_args"].values()} == {0.2}
    # Apart: every sweep started its own server (3 rounds, 3 starts each).
    assert all(len(v) == 3 for v in apart["ready_s"].values())
    assert together["settings"]["variant"] == {"stream_interval_ms": 0, "response_threads": "4"}
    assert together["settings"]["uvloop"]["env"] == {"LLMHOST_EVENT_LOOP": "uvloop"}
    for run in (APART, VARIANTS):
        assert "engine event loop: uvloop.Loop" in (run / "serve-uvloop.log").read_text()
        assert "engine event loop" not in (run / "serve-triton.log").read_text()
    assert "4 response threads, stream interval 0 ms" in (VARIANTS / "serve-variant.log").read_text()
    assert "1 response threads, stream interval 0 ms" in (VARIANTS / "serve-triton.log").read_text()
    # Together, the idle servers used under 1 CPU second per sweep of another.
    for side, sweeps in together["runs"].items():
        for sweep in sweeps:
            assert all(sum(used.values()) < 1.0 for other, used in sweep["server_cpu_s"].items() if other != side)


def test_the_gap_is_there_with_the_servers_apart_so_not_co_residence():
    assert [round(x, 2) for x in _ratios(APART, "triton", "vllm", 16)] == [0.79, 0.84, 0.74]
    assert [round(x, 2) for x in _ratios(APART, "triton", "vllm", 256)] == [0.51, 0.86, 0.58]
    assert _median(APART, "triton", "vllm", 16) == 0.79 and _median(APART, "triton", "vllm", 256) == 0.58
    assert _median(APART, "triton", "vllm", 16, "ttft") == 0.98
    assert _median(APART, "triton", "vllm", 256, "ttft") == 1.84
    # Together: the same gap.
    assert [round(x, 2) for x in _ratios(VARIANTS, "triton", "vllm", 16)] == [0.75, 0.87, 0.81, 0.88]
    assert [round(x, 2) for x in _ratios(VARIANTS, "triton", "vllm", 256)] == [0.77, 0.74, 0.70, 0.76]
    assert _median(VARIANTS, "triton", "vllm", 16, "ttft") == 1.08
    assert _median(VARIANTS, "triton", "vllm", 256, "ttft") == 1.75
    assert _result(APART)["goal_met"] is False and _result(VARIANTS)["goal_met"] is False


def test_nothing_outside_the_engine_was_saturated():
    for run in (APART, VARIANTS):
        for side, _ in _result(run)["runs"].items():
            for c in LEVELS:
                for lv in _levels(run, side, c):
                    # The client: its busiest process under 0.12 of a core; the machine: under 4.1 of 16 busy.
                    assert lv["client_cpu_max_s"] / lv["duration_s"] < 0.12
                    assert lv["samples"]["cpu_cores_busy"] < 4.1
                    # The GPU: at most 55% utilised.
                    assert lv["samples"]["gpu_util_pct"] < 55
                    # No CPU contention: the measured server's threads waited for a CPU
                    # under 0.01 core-seconds a second, all of them together.
                    assert sum(p["runq_wait_cores"] for p in lv["threads"]["by_process"].values()) < 0.01
                    if side != "vllm":
                        # The stub's busiest thread: at most 0.62 of a core; tritonserver's 0.09.
                        stub = [g["max_thread_cores"] for g in lv["threads"]["by_comm"]
                                if g["process"] == "triton_python_backend_stub"]
                        ts = [g["max_thread_cores"] for g in lv["threads"]["by_comm"] if g["process"] == "tritonserver"]
                        assert max(stub) < 0.62 and max(ts) < 0.09


def test_the_single_threads_near_a_full_core():
    for run in (APART, VARIANTS):
        for side in _result(run)["runs"]:
            for lv in _levels(run, side, 16):
                # vLLM's EngineCore main thread, at c=16, on every side alike.
                assert 0.91 < _thread(lv, "VLLM::EngineCor") < 0.96
            if side == "vllm":
                for lv in _levels(run, side, 256):
                    # vLLM's API server main thread at c=256 (its process's comm is python3).
                    assert 0.94 < _thread(lv, "python3") < 0.97
    for lv in _levels(VARIANTS, "triton", 256):
        # The per-step path's one I/O thread at c=256: under a third of a core ...
        assert 0.28 < _thread(lv, "lh-triton-io-0") < 0.31
        io = next(g for g in lv["threads"]["by_comm"] if g["comm"] == "lh-triton-io-0")
        # ... switching about 5,000 times a second: one synchronous send per response.
        assert 4800 < io["slices_per_s"] < 5500


def test_c256_requests_spend_seconds_outside_vllms_engine_on_the_per_step_path():
    """Client E2E (mean) minus vLLM's own e2e histogram (mean, arrival at AsyncLLM to the
    last output) per level; and the requests in the engine's running batch."""
    def outside(side: str, c: int) -> list[float]:
        return [round(lv["e2e_s"]["mean"] - lv["scheduler"]["e2e_ms"] / 1000, 2) for lv in _levels(VARIANTS, side, c)]

    assert [min(outside("triton", 256)), max(outside("triton", 256))] == [1.80, 1.95]
    assert [min(outside("uvloop", 256)), max(outside("uvloop", 256))] == [1.77, 1.96]
    assert [min(outside("variant", 256)), max(outside("variant", 256))] == [0.51, 0.88]
    assert [min(outside("vllm", 256)), max(outside("vllm", 256))] == [0.11, 0.17]
    for side in ("triton", "uvloop", "variant", "vllm"):
        assert all(abs(x) <= 0.01 for x in outside(side, 16))  # at c=16 nothing waits outside
    # Time in the engine per request at c=256 is not longer on the per-step path.
    eng = {s: statistics.median(lv["scheduler"]["e2e_ms"] for lv in _levels(VARIANTS, s, 256))
           for s in ("triton", "vllm")}
    assert eng["triton"] < eng["vllm"]
    # So fewer requests are in the engine's batch: running (mean of the level's samples).
    def running(run: Path, side: str) -> list[float]:
        return [lv["scheduler"]["running_mean"] for lv in _levels(run, side, 256)]

    per_step = running(APART, "triton") + running(APART, "uvloop") + running(VARIANTS, "triton") + \
        running(VARIANTS, "uvloop")
    assert max(per_step) < 100 and min(running(APART, "vllm") + running(VARIANTS, "vllm")) > 160
    assert 99 < min(running(VARIANTS, "variant")) and max(running(VARIANTS, "variant")) < 160
    # Triton's own queue before execute() is not where the seconds go: 12-24 ms a request.
    queue = [lv["scheduler"]["triton_queue_ms"] for lv in _levels(VARIANTS, "triton", 256)]
    assert 12 < min(queue) and max(queue) < 24
    assert {lv["scheduler"]["requests_per_execute"] for s in TRITON_SIDES for c in LEVELS
            for lv in _levels(VARIANTS, s, c)} == {1.0}
    # The first token: client TTFT minus vLLM's TTFT histogram (means), ms.
    first = {s: [round(lv["ttft_s"]["mean"] * 1000 - lv["scheduler"]["ttft_ms"]) for lv in _levels(VARIANTS, s, 256)]
             for s in ("triton", "variant", "vllm")}
    assert (min(first["triton"]), max(first["triton"])) == (570, 847)
    assert (min(first["variant"]), max(first["variant"])) == (233, 527)
    assert (min(first["vllm"]), max(first["vllm"])) == (128, 152)


def test_four_response_threads_close_the_c256_gap_but_not_c16():
    assert [round(x, 2) for x in _ratios(VARIANTS, "variant", "triton", 256)] == [1.25, 1.58, 1.52, 1.31]
    assert [round(x, 2) for x in _ratios(VARIANTS, "variant", "vllm", 256)] == [0.97, 1.18, 1.06, 0.99]
    assert _median(VARIANTS, "variant", "vllm", 256) == 1.02
    assert _median(VARIANTS, "variant", "vllm", 256, "ttft") == 0.85
    assert _median(VARIANTS, "variant", "triton", 256, "ttft") == 0.49
    assert [round(x, 2) for x in _ratios(VARIANTS, "variant", "triton", 16)] == [0.95, 0.95, 0.91, 1.00]
    assert _median(VARIANTS, "variant", "vllm", 16) == 0.78
    assert _median(VARIANTS, "variant", "vllm", 16, "ttft") == 1.21
    summary = _result(VARIANTS)["summary"]
    assert summary["variant/vllm"]["misses"] == ["c=16: throughput 0.78x of vllm < 0.97",
                                                 "c=16: TTFT p50 1.21x of vllm > 1.10"]


def test_uvloop_helps_c16_a_little_and_not_c256s_first_tokens():
    assert [round(x, 2) for x in _ratios(APART, "uvloop", "triton", 16)] == [1.35, 1.06, 0.94]
    assert [round(x, 2) for x in _ratios(VARIANTS, "uvloop", "triton", 16)] == [1.04, 1.08, 1.07, 1.18]
    assert _median(VARIANTS, "uvloop", "vllm", 16) == 0.91
    assert [round(x, 2) for x in _ratios(APART, "uvloop", "triton", 256)] == [1.38, 0.86, 1.00]
    assert [round(x, 2) for x in _ratios(VARIANTS, "uvloop", "triton", 256)] == [0.98, 1.16, 1.12, 1.09]
    assert _median(APART, "uvloop", "triton", 256, "ttft") == 1.18
    assert _median(VARIANTS, "uvloop", "triton", 256, "ttft") == 2.35


def test_c16_the_engine_steps_slower_with_the_same_batch():
    """vLLM's inter-token latency histogram (mean per level) with about 13 requests running
    on every side: the engine's step interval is longer behind the Triton stub."""
    def itl(side: str) -> list[float]:
        return [lv["scheduler"]["itl_ms"] for lv in _levels(VARIANTS, side, 16)]

    def running(side: str) -> list[float]:
        return [lv["scheduler"]["running_mean"] for lv in _levels(VARIANTS, side, 16)]

    assert all(12 <= r <= 14.5 for s in ("triton", "uvloop", "variant", "vllm") for r in running(s))
    assert (min(itl("triton")), max(itl("triton"))) == (3.74, 3.95)
    assert (min(itl("uvloop")), max(itl("uvloop"))) == (3.34, 3.61)
    assert (min(itl("variant")), max(itl("variant"))) == (3.91, 4.25)
    assert (min(itl("vllm")), max(itl("vllm"))) == (2.75, 3.39)
    assert statistics.median(itl("triton")) / statistics.median(itl("vllm")) == pytest.approx(1.21, abs=0.01)
    # The GPU idles more behind the stub.
    gpu = {s: [lv["samples"]["gpu_util_pct"] for lv in _levels(VARIANTS, s, 16)] for s in ("triton", "vllm")}
    assert max(gpu["triton"]) < min(gpu["vllm"])


def test_the_engine_processes_were_started_differently():
    """What the run recorded of each EngineCore: vLLM's server spawns it (its environment says
    so) and it runs 107 threads; the stub's EngineCore has no spawn setting, 61 threads, and
    Triton's library path first."""
    res = _result(VARIANTS)
    ours = {k: v for k, v in res["runs"]["triton"][0]["processes"].items() if k.startswith("VLLM::EngineCore")}
    theirs = {k: v for k, v in res["runs"]["vllm"][0]["processes"].items() if k.startswith("VLLM::EngineCore")}
    (ours,), (theirs,) = ours.values(), theirs.values()
    assert theirs["env"]["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in ours["env"]
    assert (ours["threads"], theirs["threads"]) == (61, 107)
    assert ours["env"]["LD_LIBRARY_PATH"].startswith("/usr/lib/x86_64-linux-gnu:/tmp/site/nvidia_pytriton.libs")
    assert ours["cpus_allowed"] == theirs["cpus_allowed"] == "0-15" and ours["nice"] == theirs["nice"] == 0
    # One CPU per core: no SMT siblings to share.
    assert res["cpu_siblings"] == [str(i) for i in range(16)]
