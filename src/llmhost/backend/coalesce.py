"""Merge a stream's pending deltas into one response.

The I/O thread takes everything queued at once; when several engine steps of the
same stream are waiting (the server is busy), they leave as one response instead
of one round trip each. Nothing is held back to wait for more: an idle server
still sends every step at once, a busy one sends fewer, larger responses.
"""

from __future__ import annotations

from typing import Any

from llmhost.backend.engine import Chunk


def merge(a: Chunk, b: Chunk) -> Chunk:
    """``b`` follows ``a`` in the same stream."""
    return Chunk(
        texts=[x + y for x, y in zip(a.texts, b.texts, strict=True)],
        finish_reasons=[y or x for x, y in zip(a.finish_reasons, b.finish_reasons, strict=True)],
        num_input_tokens=b.num_input_tokens,
        num_output_tokens=list(b.num_output_tokens),
        final=b.final,
    )


def coalesce(items: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """Merge 'chunk' items of the same sink; keep every other item and the order."""
    out: list[tuple[str, Any, Any]] = []
    open_chunk: dict[int, int] = {}  # id(sink) -> index in out of its latest unsent chunk
    for item in items:
        kind, sink, payload = item
        if kind == "chunk":
            at = open_chunk.get(id(sink))
            if at is not None:
                out[at] = ("chunk", sink, merge(out[at][2], payload))
                if payload.final:
                    del open_chunk[id(sink)]
                continue
            out.append(item)
            if not payload.final:
                open_chunk[id(sink)] = len(out) - 1
        else:
            if kind == "error":
                # An error ends the stream: later chunks must not merge before it.
                open_chunk.pop(id(sink), None)
            out.append(item)
    return out
