"""The gateway on uvloop against asyncio's loop on the 2-core machine (2026-11-26):
two runs of ``lab/bench_compare.py --paths triton,gateway``. What
docs/performance-history.md ("The gateway's event loop") states of them is checked
here from the recorded JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"
RUNS = {"uvloop": "compare-2026-11-26-0731-uvloop.json", "asyncio": "compare-2026-11-26-0738-asyncio.json"}


def load(loop: str) -> dict[str, Any]:
    return json.loads((BENCH / RUNS[loop]).read_text())


@pytest.mark.parametrize("loop", sorted(RUNS))
def test_each_run_is_three_rounds_on_two_cores_without_errors(loop: str) -> None:
    res = load(loop)
    meta = res["meta"]
    assert meta["cpus"] == 2 and meta["rounds"] == 3 and meta["paths"] == ["triton", "gateway"]
    assert meta["workload"]["duration_s"] == 12.0 and meta["client_cpus"] == [1]
    assert meta["gateway_arg_overrides"] == ([] if loop == "uvloop" else ["--event-loop=asyncio"])
    assert all(lv["errors"] == 0 for runs in res["runs"].values() for rnd in runs for lv in rnd)
    stalls = [s for path in res["stalls_s"].values() for s in path]
    assert max(stalls) <= 0.2


def test_neither_loop_is_consistently_ahead() -> None:
    cpu = {loop: [r["gateway:llmhost"] for r in load(loop)["cpu_s"]["gateway"]] for loop in RUNS}
    assert (min(cpu["uvloop"]), max(cpu["uvloop"])) == (8.89, 9.29)
    assert (min(cpu["asyncio"]), max(cpu["asyncio"])) == (9.34, 9.63)
    assert (load("uvloop")["gateway_cpu_ms_per_token"], load("asyncio")["gateway_cpu_ms_per_token"]) == (0.111, 0.114)
    rows = {loop: load(loop)["summary"]["gateway/triton"]["rows"] for loop in RUNS}
    tps = {loop: [round(r["tps_ratio"], 2) for r in rows[loop]] for loop in RUNS}
    ttft = {loop: [round(r["ttft_ratio"], 2) for r in rows[loop]] for loop in RUNS}
    assert tps == {"uvloop": [0.92, 1.12, 1.01], "asyncio": [0.85, 0.89, 0.93]}
    assert ttft == {"uvloop": [1.32, 1.18, 1.67], "asyncio": [1.35, 1.15, 1.74]}
    # The ratios favour uvloop, the absolute figures asyncio: the native path moved between runs.
    native64 = [round(r["triton_tokens_per_s"]) for loop in RUNS for r in rows[loop] if r["concurrency"] == 64]
    gateway64 = [round(r["gateway_tokens_per_s"]) for loop in RUNS for r in rows[loop] if r["concurrency"] == 64]
    assert native64 == [3784, 4503] and gateway64 == [3799, 4012]
