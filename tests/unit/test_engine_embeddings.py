"""An embedding model (vLLM's pooling runner) on the engine side: one final response
with the prompt's embedding and its token count, whatever was asked; the `embed`
request parameter on a model that generates text is the client's error; the outputs
carry `embedding` (FP32) on both the Triton response and the engine socket's line."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from llmhost.backend.config import BackendSettings, parse_model_config
from llmhost.backend.engine import Active, Chunk, EngineRunner
from llmhost.backend.errors import RequestError
from llmhost.backend.metrics import ServingMetrics
from llmhost.backend.model import OUTPUTS
from llmhost.backend.outputs import response_outputs
from llmhost.backend.request import GenerateJob, parse_request
from tests.unit._engine_fakes import PROMPT_IDS, Sink


class Pooler:
    """vLLM's AsyncLLM.encode, as a pooling model answers: one finished output."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []

    async def encode(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        self.calls.append((prompt, params))
        data = SimpleNamespace(tolist=lambda: [0.25, -0.5, 1.0])
        yield SimpleNamespace(finished=True, prompt_token_ids=prompt["prompt_token_ids"],
                              outputs=SimpleNamespace(data=data))

    async def generate(self, *args: Any) -> AsyncIterator[Any]:
        raise AssertionError("an embedding model never generates")
        yield  # pragma: no cover


def _run(job: GenerateJob, pooling: bool, engine: Any) -> Sink:
    runner = EngineRunner(parse_model_config({"model": "/m"}), ServingMetrics(), lambda m: None)
    runner._engine = engine
    runner._pooling = pooling

    async def ids(job: GenerateJob) -> list[int]:
        return list(PROMPT_IDS)

    runner._prompt_ids = ids  # type: ignore[method-assign]
    sink = Sink()
    asyncio.run(runner._generate(Active("r1"), job, sink))
    return sink


def _job(embed: bool = False, stream: bool = False) -> GenerateJob:
    return GenerateJob(prompt="hi", messages=None, stream=stream, exclude_input=True, sampling={"max_tokens": 8},
                       embed=embed)


@pytest.mark.parametrize(("embed", "stream"), [(True, False), (False, False), (False, True)])
def test_an_embedding_model_answers_every_request_with_one_embedding(embed, stream):
    engine = Pooler()
    sink = _run(_job(embed, stream), pooling=True, engine=engine)
    assert sink.errors == []
    assert len(sink.chunks) == 1
    chunk = sink.chunks[0]
    assert chunk.final and chunk.embedding == [0.25, -0.5, 1.0] and chunk.num_input_tokens == len(PROMPT_IDS)
    prompt, params = engine.calls[0]
    assert prompt == {"prompt_token_ids": PROMPT_IDS} and params.task == "embed"


def test_a_model_that_generates_text_refuses_an_embedding_as_the_clients_error():
    sink = _run(_job(embed=True), pooling=False, engine=Pooler())
    assert sink.reasons == ["invalid_request"], sink.errors
    assert "generates text and has no embeddings" in sink.errors[0]


def test_embed_is_a_request_parameter():
    def arr(value: str) -> Any:
        return np.array([value.encode()], dtype=np.object_)

    job = parse_request({"text_input": arr("hi")}, json.dumps({"embed": True}), BackendSettings())
    assert job.embed and "embed" not in job.sampling
    assert not parse_request({"text_input": arr("hi")}, None, BackendSettings()).embed
    with pytest.raises(RequestError, match="'embed' must be true or false"):
        parse_request({"text_input": arr("hi")}, json.dumps({"embed": "yes"}), BackendSettings())


def test_the_embedding_is_an_fp32_output_sent_whatever_was_asked():
    chunk = Chunk([""], ["stop"], 3, [0], True, embedding=[0.5, 1.5])
    assert response_outputs(chunk, frozenset(), counted=False) == {"text_output": [""], "embedding": [0.5, 1.5]}
    text = Chunk(["hi"], [""], 3, [1], False)
    assert "embedding" not in response_outputs(text, frozenset(), counted=False)
    assert {"name": "embedding", "data_type": "TYPE_FP32", "dims": [-1]} in OUTPUTS
