"""Reading a recorded `lab/gpu_speed.py` run (its result.json) in the unit tests
that check what docs/performance-history.md states of it: per-level figures of each side and
the per-round ratios between two sides."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def load(run: Path) -> dict[str, Any]:
    return json.loads((run / "result.json").read_text())


def levels(res: dict[str, Any], side: str, c: int) -> list[dict[str, Any]]:
    """Concurrency C's level of SIDE, one per round."""
    at = res["workload"]["concurrency"].index(c)
    return [sweep["levels"][at] for sweep in res["runs"][side]]


def _value(level: dict[str, Any], key: str) -> float:
    return level["output_tokens_per_s"] if key == "tps" else level["ttft_s"]["p50"]


def ratios(res: dict[str, Any], path: str, base: str, c: int, key: str = "tps") -> list[float]:
    """PATH over BASE per round at concurrency C: tokens/s (key 'tps') or TTFT p50 ('ttft')."""
    pairs = zip(levels(res, path, c), levels(res, base, c), strict=True)
    return [round(_value(a, key) / _value(b, key), 2) for a, b in pairs]


def median_ratio(res: dict[str, Any], path: str, base: str, c: int, key: str = "tps") -> float:
    """The median of the unrounded per-round ratios, rounded as the docs give it."""
    pairs = zip(levels(res, path, c), levels(res, base, c), strict=True)
    return round(statistics.median(_value(a, key) / _value(b, key) for a, b in pairs), 2)


def clean_levels(res: dict[str, Any], sides: tuple[str, ...], rounds: int) -> list[dict[str, Any]]:
    """Every level of SIDES, after checking that each side ran ROUNDS rounds in order and
    that each level ran error-free for at least the workload's duration, every request
    making the workload's output tokens (ignore_eos)."""
    w = res["workload"]
    out = []
    for side in sides:
        assert [s["round"] for s in res["runs"][side]] == list(range(rounds)), side
        for c in w["concurrency"]:
            for lv in levels(res, side, c):
                assert lv["errors"] == 0 and lv["requests"] > 0 and lv["duration_s"] >= w["duration_s"], (side, c)
                assert abs(lv["output_tokens_per_s"] / lv["requests_per_s"] / w["output_tokens"] - 1) < 1e-6
                out.append(lv)
    return out
