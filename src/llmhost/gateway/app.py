"""The ASGI app: OpenAI's ``/v1/models`` (and ``/v1/models/{id}``), ``/v1/chat/completions`` and
``/v1/completions`` in front of our backend on Triton.

Order for every request: authenticate (401), check the body's size (413, before
reading more than the limit), parse and validate (400), check the model (404),
then call the upstream (its errors: 400, 404, 500, 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.errors import ApiError, invalid, model_not_found, too_large
from llmhost.gateway.keys import ApiKey, KeyStore
from llmhost.gateway.mapping import parse_body, to_backend
from llmhost.gateway.responses import Accumulator, completion_body, new_id, stream_chunks
from llmhost.gateway.upstream import Piece, Upstream

T = TypeVar("T")


def json_response(body: dict[str, Any], status: int = 200) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), status, media_type="application/json")


def error_response(exc: ApiError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return Response(exc.json(), exc.status, headers=headers, media_type="application/json")


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


async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise invalid("the Content-Length header is not a number")
        if int(length) > limit:
            raise too_large(limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large(limit)
        parts.append(part)
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


async def _first(pieces: AsyncIterator[Piece]) -> Piece | None:
    try:
        return await anext(pieces)
    except StopAsyncIteration:
        return None


async def _gather(pieces: AsyncIterator[Piece], n: int) -> Accumulator:
    acc = Accumulator(n)
    async for piece in pieces:
        acc.add(piece)
    return acc


class Gateway:
    def __init__(self, config: GatewayConfig, keys: KeyStore, upstream: Upstream | None = None) -> None:
        self.config = config
        self.keys = keys
        self.upstream = upstream or Upstream(config.upstream, config.upstream_timeout_s)

    def _auth(self, request: Request) -> ApiKey:
        return self.keys.authenticate(request.headers.get("authorization"))

    async def models(self, request: Request) -> Response:
        try:
            self._auth(request)
            data = []
            for name in self.config.models:
                if await self.upstream.model_ready(name):
                    data.append({"id": name, "object": "model", "created": 0, "owned_by": "llmhost"})
        except ApiError as exc:
            return error_response(exc)
        return json_response({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        try:
            self._auth(request)
            if name not in self.config.models or not await self.upstream.model_ready(name):
                raise model_not_found(name)
        except ApiError as exc:
            return error_response(exc)
        return json_response({"id": name, "object": "model", "created": 0, "owned_by": "llmhost"})

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        try:
            key = self._auth(request)
            raw = await read_body(request, self.config.max_body_bytes)
            req = to_backend(parse_body(raw, chat), key.max_tokens)
            if req.model not in self.config.models:
                raise model_not_found(req.model)
            pieces = self.upstream.generate(req)
            rid = new_id(chat)
            if req.stream:
                # The first response before the status line: a request the backend
                # refuses gets its HTTP status, not a 200 with an error event.
                first = await until_disconnect(request, _first(pieces))
                return EventStream(stream_chunks(req, first, pieces, rid))
            acc = await until_disconnect(request, _gather(pieces, req.n))
            return json_response(completion_body(req, acc, rid, int(time.time())))
        except ApiError as exc:
            return error_response(exc)
        except ClientGone:
            return Response(None, 499)

    async def not_found(self, request: Request) -> Response:
        return error_response(ApiError(404, f"no such path: {request.method} {request.url.path}",
                                       "not_found_error", None, "unknown_url"))


def create_app(config: GatewayConfig, keys: KeyStore, upstream: Upstream | None = None) -> Starlette:
    gw = Gateway(config, keys, upstream)

    async def on_missing(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        if status == 405:
            return error_response(ApiError(405, f"method {request.method} is not allowed on {request.url.path}",
                                           "invalid_request_error", None, "method_not_allowed"))
        return await gw.not_found(request)

    async def on_error(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}; the gateway log has the "
                                       "details", "server_error", None, "internal_error"))

    routes = [
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gw.model, methods=["GET"]),
        Route("/v1/chat/completions", gw.chat, methods=["POST"]),
        Route("/v1/completions", gw.completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: on_missing, 405: on_missing, Exception: on_error})
    app.state.gateway = gw

    return app
