"""Merge a stream's pending deltas into one response.

The I/O thread takes everything queued at once; when several engine steps of the
same stream are waiting (the server is busy), they leave as one response instead
of one round trip each. ``StreamWindow`` also holds a started stream's deltas
until the sending thread's next tick (``stream_interval_ms``), so that they merge
on an idle server too; with no window nothing is held back.
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


class StreamWindow:
    """Hold a started stream's deltas until the next tick so they leave as one response.

    Each response is a synchronous round trip to tritonserver, and every one of
    them costs CPU and context switches in the stub, in tritonserver and in the
    client. A stream's first response and its final one leave at once (time to
    first token and end-to-end latency do not change); the deltas in between are
    held and merged until the sending thread's next tick (``flush``), which comes
    every ``window_s`` while streams are open, so no delta waits longer than that.
    ``window_s = 0`` holds nothing. Only the sending thread uses an instance.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.held: dict[int, tuple[Any, Chunk]] = {}  # id(sink) -> (sink, merged chunk), in arrival order
        self.started: dict[int, Any] = {}  # sinks whose first response left; kept alive while open

    @property
    def ticking(self) -> bool:
        """Whether the sending thread must tick: a window is set and streams are open."""
        return self.window_s > 0 and bool(self.started)

    def admit(self, items: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
        """Items to send now, in order; later deltas of started streams are held."""
        out: list[tuple[str, Any, Any]] = []
        for item in items:
            kind, sink, payload = item
            key = id(sink)
            if kind == "chunk":
                held = self.held.pop(key, None)
                if held is not None:
                    payload = merge(held[1], payload)
                if payload.final:
                    self.started.pop(key, None)
                elif self.window_s > 0 and key in self.started:
                    self.held[key] = (sink, payload)
                    continue
                else:
                    self.started[key] = sink
                out.append(("chunk", sink, payload))
            elif kind == "error":
                # What was generated before the error still goes first.
                held = self.held.pop(key, None)
                if held is not None:
                    out.append(("chunk", sink, held[1]))
                self.started.pop(key, None)
                out.append(item)
            else:
                out.append(item)
        return out

    def flush(self) -> list[tuple[str, Any, Any]]:
        """Everything held, at once (each tick, and on shutdown)."""
        out = [("chunk", sink, chunk) for sink, chunk in self.held.values()]
        self.held.clear()
        return out

    def hold_back(self, items: list[tuple[str, Any, Any]]) -> None:
        """Chunks taken by ``flush`` but not sent yet: held again, ahead of newer ones."""
        newer = self.held
        self.held = {id(sink): (sink, payload) for _, sink, payload in items}
        for key, (sink, payload) in newer.items():
            self.held[key] = (sink, merge(self.held[key][1], payload) if key in self.held else payload)

    def forget(self, sink: Any) -> None:
        """The stream ended outside this window (a failed send): drop its state."""
        self.held.pop(id(sink), None)
        self.started.pop(id(sink), None)
