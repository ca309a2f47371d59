"""Bounds on the gateway's client connections, so that idle or slow clients cannot hold it.

uvicorn closes a kept-alive connection that stays idle after a response
(``timeout_keep_alive``), but a connection that sends nothing, or sends its request
head a byte at a time, it keeps for ever. The protocol classes here add:

- a deadline for each request head: it must arrive whole within ``header_timeout_s``
  of the connection's start (or of the previous response's end), else the connection
  is closed;
- a bound on connections at once (``max_connections``): one more is closed as soon as
  it is accepted, before anything is read from it.

Both wrap uvicorn's own HTTP/1.1 protocols: httptools' where it is installed (as on
every host the roles set up), h11's otherwise. The body has its own deadline in the
application (``llmhost.gateway.httpio.read_body``: 408).
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

from llmhost.gateway.config import GatewayConfig


class _HeadDeadline:
    """Mixed into a uvicorn HTTP protocol class (which provides ``loop``, ``transport``
    and ``connections``)."""

    header_timeout_s: float = 10.0
    max_connections: int = 4096
    _head_timer: asyncio.TimerHandle | None = None

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    connections: set[Any]
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        if len(self.connections) > self.max_connections:
            transport.close()
            return
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._arm_head_deadline()  # the next request's head

    def _arm_head_deadline(self) -> None:
        self._head_arrived()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_too_late)

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_late(self) -> None:
        self._head_timer = None
        # A pipelined request may have begun meanwhile: that one is under way.
        waiting = self.cycle is None or self.cycle.response_complete
        if waiting and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(config: GatewayConfig) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with CONFIG's head deadline and connection bound."""
    settings = {"header_timeout_s": config.header_timeout_s, "max_connections": config.max_connections}
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: h11
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class GuardedH11(_HeadDeadline, H11Protocol):  # type: ignore[misc]
            def handle_events(self) -> None:
                super().handle_events()
                if self.conn.their_state is not h11.IDLE:  # a request's head came whole
                    self._head_arrived()

        return type("GuardedH11Protocol", (GuardedH11,), settings)

    class GuardedHttpTools(_HeadDeadline, HttpToolsProtocol):  # type: ignore[misc]
        def on_headers_complete(self) -> None:
            self._head_arrived()
            super().on_headers_complete()

    return type("GuardedHttpToolsProtocol", (GuardedHttpTools,), settings)


def raise_open_files_limit(want: int) -> int:
    """The soft limit of open files raised towards WANT (within the hard limit): every
    connection is a file. The limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft
