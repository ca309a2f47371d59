"""What the gateway learns about one request, and the middleware that closes it.

Handlers fill a ``RequestRecord`` (``record_of(scope)``): the key's name, the model,
the upstream, tokens, time to first token. When the response has been sent (a
stream: at its end; a client that left: status 499) the middleware runs the
record's cleanups (a key's lease: its concurrency slot and token charge), then
hands the record to every observer (metrics, access log).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send


@dataclass
class RequestRecord:
    start: float = field(default_factory=time.monotonic)
    model: str | None = None
    key: str = ""
    upstream: str | None = None
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    limited: str | None = None  # the key limit that refused it: rpm, tpm, max_concurrent
    # A stream's output tokens per upstream response (each one is one event to the
    # client), of the completion that got the most in it.
    event_tokens: list[int] = field(default_factory=list)
    status: int = 499
    duration_s: float = 0.0
    cleanups: list[Callable[[RequestRecord], None]] = field(default_factory=list)

    @property
    def used_tokens(self) -> int:
        return (self.prompt_tokens or 0) + self.output_tokens


def record_of(scope: Scope) -> RequestRecord:
    state = scope.setdefault("state", {})
    rec = state.get("llmhost")
    if not isinstance(rec, RequestRecord):
        rec = state["llmhost"] = RequestRecord()
    return rec


Observer = Callable[[RequestRecord, Scope], None]


class RequestMiddleware:
    """Records each HTTP response's status, then closes its record once."""

    def __init__(self, app: ASGIApp, observers: list[Observer]) -> None:
        self.app = app
        self.observers = observers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rec = record_of(scope)

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                rec.status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            if rec.status == 499:  # failed before a response began: the 500 the app's handler sends
                rec.status = 500
            raise
        finally:
            close_record(rec, scope, self.observers)


def close_record(rec: RequestRecord, scope: Scope, observers: list[Observer]) -> None:
    """REC's request has ended: its duration, its cleanups run, then every observer."""
    rec.duration_s = time.monotonic() - rec.start
    for cleanup in rec.cleanups:
        cleanup(rec)
    for observe in observers:
        observe(rec, scope)
