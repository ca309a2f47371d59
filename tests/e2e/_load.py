"""A bounded load against a running server, with the memory of its process tree."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import psutil

from llmhost.bench import LevelResult, Target, Workload, run_level


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


def run_load(http_url: str, model: str, pid: int, concurrency: int, duration_s: float,
             output_tokens: int = 64) -> LoadReport:
    target = Target("http", http_url, model)
    workload = Workload(duration_s=duration_s, prompt_words=16, prompt_words_max=96,
                        output_tokens=output_tokens // 2, output_tokens_max=output_tokens, seed=1)

    async def go() -> LevelResult:
        await target.open()
        try:
            return await run_level(target, workload, concurrency, progress=False)
        finally:
            await target.close()

    start = tree_rss_mib(pid)
    result = asyncio.run(go())
    return LoadReport(result, start, tree_rss_mib(pid))
