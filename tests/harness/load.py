"""A bounded load against a running server, with the memory of its processes
(a local process tree, or the booted host's unit: the caller says how to read it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from llmhost.bench.loadgen import LevelResult, Target, Workload, run_level


@dataclass
class LoadReport:
    result: LevelResult
    rss_start_mib: float
    rss_end_mib: float


def tree_rss_mib(pid: int) -> float:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def run_load(http_url: str, model: str, rss_mib: Callable[[], float], concurrency: int, duration_s: float,
             output_tokens: int = 64) -> LoadReport:
    """Stream requests at CONCURRENCY for DURATION_S; RSS_MIB() is read before and after."""
    target = Target("http", http_url, model)
    workload = Workload(duration_s=duration_s, prompt_words=16, prompt_words_max=96,
                        output_tokens=output_tokens // 2, output_tokens_max=output_tokens, seed=1)

    async def go() -> LevelResult:
        await target.open()
        try:
            return await run_level(target, workload, concurrency, progress=False)
        finally:
            await target.close()

    start = rss_mib()
    result = asyncio.run(go())
    return LoadReport(result, start, rss_mib())


def assert_clean_and_bounded(report: LoadReport, what: str) -> None:
    """Zero errors and bounded memory growth: the KV cache and allocator are warm
    already; allow slack for Python's arenas, never a leak that scales with requests."""
    r = report.result
    print(f"\n{what}: {r.requests} requests in {r.duration_s:.0f}s, {r.output_tokens_per_s:.0f} tok/s, "
          f"{r.errors} errors; RSS {report.rss_start_mib:.0f} -> {report.rss_end_mib:.0f} MiB")
    assert r.requests >= 32 and r.errors == 0, r.first_error
    assert report.rss_end_mib < report.rss_start_mib * 1.25 + 200, (report.rss_start_mib, report.rss_end_mib)
