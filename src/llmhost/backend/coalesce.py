"""Merge a stream's pending deltas into one response.

The I/O thread takes everything queued at once; when several engine steps of the
same stream are waiting (the server is busy), they leave as one response instead
of one round trip each (vLLM's own output queue merges a lagging consumer's
deltas the same way). ``StreamWindow`` also holds the deltas of a started stream
that has a window (``stream_interval_ms``, the model's or the request's) for up to
that long, so that they merge on an idle server too; with no window (the default)
nothing is held back. A merged response keeps the per-response meaning of every
output: token counts and log probabilities of all its steps, the latest finish
reason and cumulative log probability.
"""

from __future__ import annotations

import time
from typing import Any

from llmhost.backend.engine import Chunk
from llmhost.backend.outputs import Position


def _joined(x: list[Position] | None, y: list[Position] | None) -> list[Position] | None:
    return None if x is None and y is None else [*(x or []), *(y or [])]


def merge(a: Chunk, b: Chunk) -> Chunk:
    """``b`` follows ``a`` in the same stream."""
    return Chunk(
        texts=[x + y for x, y in zip(a.texts, b.texts, strict=True)],
        finish_reasons=[y or x for x, y in zip(a.finish_reasons, b.finish_reasons, strict=True)],
        num_input_tokens=b.num_input_tokens,
        num_output_tokens=[x + y for x, y in zip(a.num_output_tokens, b.num_output_tokens, strict=True)],
        final=b.final,
        cumulative_logprobs=[x if y is None else y
                             for x, y in zip(a.cumulative_logprobs, b.cumulative_logprobs, strict=True)],
        logprobs=[_joined(x, y) for x, y in zip(a.logprobs, b.logprobs, strict=True)],
        messages=(None if a.messages is None or b.messages is None
                  else [x + y for x, y in zip(a.messages, b.messages, strict=True)]),
    )


def window_of(sink: Any, default_s: float) -> float:
    """A stream's window in seconds: its own (``sink.window_s``) if it has one."""
    own = getattr(sink, "window_s", None)
    return default_s if own is None else float(own)


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
    """Hold a started stream's deltas for up to its window so they leave as one response.

    Each response is a synchronous round trip to tritonserver, and every one of
    them costs CPU and context switches in the stub, in tritonserver and in the
    client. A stream's first response and its final one leave at once (time to
    first token and end-to-end latency do not change); with a window, the deltas
    in between are held and merged until the window that began with the first of
    them has passed (``flush_due``), so no delta waits longer than that. A stream's
    window is its sink's ``window_s`` if set, else ``window_s`` here; 0 holds
    nothing. Only the sending thread uses an instance.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # id(sink) -> (sink, merged chunk, when it is due), in arrival order
        self.held: dict[int, tuple[Any, Chunk, float]] = {}
        self.started: dict[int, Any] = {}  # sinks whose first response left; kept alive while open
        self.grouped = 0  # started streams with a window

    @property
    def ticking(self) -> bool:
        """Whether the sending thread must tick: a stream with a window is open."""
        return self.grouped > 0

    def next_due(self) -> float | None:
        """When the earliest held delta must leave (time.monotonic()), if any is held."""
        return min((due for _, _, due in self.held.values()), default=None)

    def _start(self, key: int, sink: Any) -> None:
        if key not in self.started:
            self.started[key] = sink
            if window_of(sink, self.window_s) > 0:
                self.grouped += 1

    def _end(self, key: int) -> None:
        sink = self.started.pop(key, None)
        if sink is not None and window_of(sink, self.window_s) > 0:
            self.grouped -= 1

    def admit(self, items: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
        """Items to send now, in order; later deltas of started streams with a window are held."""
        out: list[tuple[str, Any, Any]] = []
        for item in items:
            kind, sink, payload = item
            key = id(sink)
            if kind == "chunk":
                held = self.held.pop(key, None)
                if held is not None:
                    payload = merge(held[1], payload)
                window = window_of(sink, self.window_s)
                if payload.final:
                    self._end(key)
                elif window > 0 and key in self.started:
                    due = held[2] if held is not None else time.monotonic() + window
                    self.held[key] = (sink, payload, due)
                    continue
                else:
                    self._start(key, sink)
                out.append(("chunk", sink, payload))
            elif kind == "error":
                # What was generated before the error still goes first.
                held = self.held.pop(key, None)
                if held is not None:
                    out.append(("chunk", sink, held[1]))
                self._end(key)
                out.append(item)
            else:
                out.append(item)
        return out

    def flush(self) -> list[tuple[str, Any, Any]]:
        """Everything held, at once (on shutdown)."""
        out = [("chunk", sink, chunk) for sink, chunk, _ in self.held.values()]
        self.held.clear()
        return out

    def flush_due(self, now: float) -> list[tuple[str, Any, Any]]:
        """The held deltas whose window has passed by NOW (each tick)."""
        due = [key for key, (_, _, at) in self.held.items() if at <= now]
        return [("chunk", sink, chunk) for sink, chunk, _ in (self.held.pop(key) for key in due)]

    def hold_back(self, items: list[tuple[str, Any, Any]]) -> None:
        """Chunks taken by ``flush`` but not sent yet: held again, ahead of newer ones, due at once."""
        newer = self.held
        self.held = {id(sink): (sink, payload, 0.0) for _, sink, payload in items}
        for key, (sink, payload, due) in newer.items():
            if key in self.held:
                self.held[key] = (sink, merge(self.held[key][1], payload), 0.0)
            else:
                self.held[key] = (sink, payload, due)

    def forget(self, sink: Any) -> None:
        """The stream ended outside this window (a failed send): drop its state."""
        self.held.pop(id(sink), None)
        self._end(id(sink))
