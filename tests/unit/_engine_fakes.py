"""Stand-ins for the engine side's unit tests (EngineRunner._generate): an engine that
yields given outputs and records the prompts it got, a sink that records what the
runner sends, and a runner around them with fixed prompt ids."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from llmhost.backend.config import parse_model_config
from llmhost.backend.engine import Active, Chunk, EngineRunner
from llmhost.backend.metrics import ServingMetrics
from llmhost.backend.request import GenerateJob

PROMPT_IDS = [7, 8, 9]


class Sink:
    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        self.errors: list[str] = []
        self.reasons: list[str] = []
        self.active = None

    def send(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)

    def fail(self, message: str, reason: str = "engine_error") -> None:
        self.errors.append(message)
        self.reasons.append(reason)

    def cancelled(self) -> None:
        self.errors.append("cancelled")


class Engine:
    def __init__(self, outputs: list[SimpleNamespace]) -> None:
        self.outputs = outputs
        self.prompts: list[Any] = []

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        self.prompts.append(prompt)
        for out in self.outputs:
            yield out


def generate(engine: Engine, job: GenerateJob, n: int = 1, model: str = "/m", **runner_attrs: Any) -> Sink:
    """Run one job through an EngineRunner on ENGINE (prompt ids PROMPT_IDS, N completions);
    RUNNER_ATTRS set the runner's other state (e.g. _multimodal)."""
    runner = EngineRunner(parse_model_config({"model": model}), ServingMetrics(), lambda m: None)
    runner._engine = engine
    for name, value in runner_attrs.items():
        setattr(runner, name, value)

    async def ids(job: GenerateJob) -> list[int]:
        return list(PROMPT_IDS)

    runner._prompt_ids = ids  # type: ignore[method-assign]
    runner._sampling_params = lambda j, *a: SimpleNamespace(n=n)  # type: ignore[method-assign]
    sink = Sink()
    asyncio.run(runner._generate(Active("r1"), job, sink))
    return sink
