"""Several prompts in one completions request, as vLLM's OpenAI server answers them:
each prompt is a request of its own upstream (with the request's ``n``), run at the
same time, and the answer's choices run prompt by prompt (prompt k's choice j has
index k * n + j). Their pieces merge into pieces as wide as every choice together."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from llmhost.gateway.upstreams.client import Piece
from llmhost.gateway.upstreams.request import BackendRequest


def split(req: BackendRequest) -> list[BackendRequest]:
    """One request per prompt of REQ's batch."""
    return [dataclasses.replace(req, batch=[], text_input=p if isinstance(p, str) else None,
                                prompt_token_ids=p if isinstance(p, list) else None) for p in req.batch]


def _widen(values: list[Any], k: int, n: int, width: int, fill: Any) -> list[Any]:
    """Prompt K's N values (absent: an empty list) placed among WIDTH, FILL elsewhere."""
    if not values:
        return []
    return [fill] * (k * n) + list(values[:n]) + [fill] * (n - min(len(values), n)) + [fill] * (width - (k + 1) * n)


async def merged(streams: list[AsyncIterator[Piece]], n: int) -> AsyncIterator[Piece]:
    """The pieces of every prompt's stream as they come, each widened to every choice;
    the prompt tokens counted so far over all prompts. An error of any stream ends it
    (and closes the others)."""
    width = len(streams) * n
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                await queue.put((k, piece))
            await queue.put((k, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((k, exc))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    prompt_tokens: dict[int, int] = {}
    left = len(streams)
    try:
        while left:
            k, item = await queue.get()
            if item is None:
                left -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if item.num_input_tokens is not None:
                prompt_tokens[k] = item.num_input_tokens
            yield Piece(texts=_widen(item.texts, k, n, width, ""),
                        finish_reasons=_widen(item.finish_reasons, k, n, width, ""),
                        num_input_tokens=sum(prompt_tokens.values()) if item.num_input_tokens is not None else None,
                        num_output_tokens=_widen(item.num_output_tokens, k, n, width, 0),
                        final=left == 1 and item.final, logprobs=_widen(item.logprobs, k, n, width, ""))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
