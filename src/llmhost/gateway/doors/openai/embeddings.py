"""``POST /v1/embeddings`` in OpenAI's shape, as vLLM's server answers it: each input (a
text or token ids) is one request to an embedding model (vLLM's pooling runner), whose
backend answers with the prompt's embedding (llmhost.backend.outputs, ``embedding``).
``encoding_format`` ``base64`` sends each vector as little-endian float32 bytes."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from llmhost.gateway.errors import invalid
from llmhost.gateway.upstreams.request import BackendRequest

# Inputs of one request in flight upstream at once (the rest wait their turn).
CONCURRENT_INPUTS = 64


def backend_request(model: str, item: str | list[int]) -> BackendRequest:
    """The upstream request for one input."""
    text, ids = (item, None) if isinstance(item, str) else (None, item)
    return BackendRequest(model=model, text_input=text, messages=None, sampling={}, stream=False, n=1,
                          include_usage=False, chat=False, prompt_token_ids=ids, embed=True)


def not_an_embedding(model: str) -> Exception:
    return invalid(f"model '{model}' answered without an embedding: it is no embedding model", "model",
                   "not_an_embedding_model")


async def embed_all(items: list[str | list[int]],
                    embed_one: Callable[[str | list[int]], Awaitable[tuple[list[float], int]]]
                    ) -> list[tuple[list[float], int]]:
    """(embedding, prompt tokens) of every item, in order, at most CONCURRENT_INPUTS at a
    time; the first failure cancels the rest and is raised."""
    room = asyncio.Semaphore(CONCURRENT_INPUTS)

    async def one(item: str | list[int]) -> tuple[list[float], int]:
        async with room:
            return await embed_one(item)

    tasks = [asyncio.ensure_future(one(item)) for item in items]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def embedding_body(model: str, results: list[tuple[list[float], int]], encoding_format: str) -> dict[str, Any]:
    tokens = sum(count for _, count in results)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(vector, encoding_format)}
                     for i, (vector, _) in enumerate(results)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
