"""HTTP plumbing shared by the OpenAI and the native API: JSON and error responses,
server-sent events, a size-bounded body read, and giving up when the client leaves."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from llmhost.gateway.errors import ApiError, body_too_slow, invalid, too_large

T = TypeVar("T")

# One encoder for every event: json.dumps with separators builds a new one per call.
_encode = json.JSONEncoder(separators=(",", ":")).encode


def sse(obj: dict[str, Any]) -> bytes:
    """OBJ as one server-sent event's bytes."""
    return b"data: " + _encode(obj).encode() + b"\n\n"


def json_response(body: dict[str, Any], status: int = 200) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), status, media_type="application/json")


def error_response(exc: ApiError, triton: bool = False) -> Response:
    """OpenAI's error object, or with TRITON Triton's own ``{"error": "..."}``."""
    headers = dict(exc.headers)
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body = json.dumps({"error": exc.message}).encode() if triton else exc.json()
    return Response(body, exc.status, headers=headers, media_type="application/json")


class EventStream(Response):
    """Server-sent events from an async iterator. A client that disconnects cancels
    the iteration at once (not at the next write), which cancels the upstream call."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        # Not Response.__init__: that would send a Content-Length of 0.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def pump() -> None:
            async for data in self.chunks:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch(task: asyncio.Task[None]) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            task.cancel()

        task = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(watch(task))
        try:
            await task
        except asyncio.CancelledError:
            if not watcher.done():  # cancelled from outside (shutdown), not by the client leaving
                raise
        except OSError:
            pass  # the client left while we wrote to it
        finally:
            watcher.cancel()
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request's body: 413 past LIMIT bytes, 408 when it takes longer than TIMEOUT_S."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise invalid("the Content-Length header is not a number")
        if int(length) > limit:
            raise too_large(limit)
    parts, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise too_large(limit)
                parts.append(part)
    except TimeoutError:
        raise body_too_slow(timeout_s or 0) from None
    return b"".join(parts)


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, or ClientGone (and ``work`` cancelled) when the client leaves first."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApiError):
                await task
            watcher.cancel()
            raise ClientGone
        watcher.cancel()
    return task.result()
