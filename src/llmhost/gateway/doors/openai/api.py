"""OpenAI's ``/v1/models`` (and ``/v1/models/{id}``), ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/embeddings``, over the gateway's keys, limits and pool
(``llmhost.gateway.access``), and the route of each request (``llmhost.gateway.routing.policies``).

Order for every request: authenticate (401), check the body's size (413, before
reading more than the limit), parse and validate (400), check the model (404), the
key's limits (429), then a slot on an upstream (503 when none is healthy or the
queue is full or too slow) and the call (its errors: 400, 404, 500, 503).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from llmhost.gateway.access import Access
from llmhost.gateway.doors.openai.batch import merged, split
from llmhost.gateway.doors.openai.completion_bodies import Accumulator, completion_body, new_id, stream_chunks
from llmhost.gateway.doors.openai.embeddings import backend_request, embed_all, embedding_body, not_an_embedding
from llmhost.gateway.doors.openai.images import fetch_images
from llmhost.gateway.doors.openai.mapping import message_text, parse_body, parse_embeddings, to_backend
from llmhost.gateway.errors import ApiError, invalid, model_not_found
from llmhost.gateway.httpio import ClientGone, EventStream, error_response, json_response, read_body, until_disconnect
from llmhost.gateway.record import RequestRecord, record_of
from llmhost.gateway.routing.policies import KEYED, KV_EVENTS, SESSION_HEADER, prompt_key_text, route_key
from llmhost.gateway.routing.policies import Route as RequestRoute
from llmhost.gateway.upstreams.client import Piece, socket_line
from llmhost.gateway.upstreams.request import BackendRequest

# The backend's default max_tokens: the tokens-per-minute estimate of a request
# that names none.
DEFAULT_MAX_TOKENS = 512


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


def _model_named(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


async def _counted(pieces: AsyncIterator[Piece], rec: RequestRecord) -> AsyncIterator[Piece]:
    """PIECES, keeping REC's token counts current (the backend counts each response's
    own tokens per choice). Closing it closes PIECES (cancels the upstream call)."""
    latest: dict[int, int] = {}
    try:
        async for piece in pieces:
            if piece.embedding:
                raise invalid(f"model '{rec.model}' is an embedding model: ask POST /v1/embeddings", "model",
                              "embedding_model")
            for i, count in enumerate(piece.num_output_tokens):
                latest[i] = latest.get(i, 0) + count
            rec.output_tokens = sum(latest.values())
            rec.event_tokens.append(max(piece.num_output_tokens, default=0))
            if piece.num_input_tokens is not None:
                rec.prompt_tokens = piece.num_input_tokens
            yield piece
    finally:
        aclose = getattr(pieces, "aclose", None)
        if aclose is not None:
            await aclose()


# UTF-8 bytes per token for the up-front estimate of a text prompt (English text runs
# at about 4 with the common tokenizers; the real count settles the charge after).
BYTES_PER_TOKEN = 4


def _text_tokens(prompt: str | list[int] | None) -> int:
    """A prompt's likely tokens: its token ids, or its UTF-8 bytes / BYTES_PER_TOKEN."""
    if isinstance(prompt, list):
        return len(prompt)
    return -(-len((prompt or "").encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)


def _prompt_estimate(req: BackendRequest) -> int:
    """The prompt tokens a request will likely use, before a tokenizer has seen it."""
    if req.messages is not None:
        prompts: list[Any] = ["".join(message_text(m.get("content")) for m in req.messages)]
    else:
        prompts = req.batch or [req.prompt_token_ids if req.prompt_token_ids is not None else req.text_input]
    return sum(_text_tokens(p) for p in prompts)


def _estimate(req: BackendRequest) -> int:
    """A request's tokens-per-minute charge up front: its prompt's likely tokens, and
    max_tokens per completion. The real usage settles it when the request ends."""
    max_tokens = req.sampling.get("max_tokens")
    return _prompt_estimate(req) + (max_tokens if isinstance(max_tokens, int) else DEFAULT_MAX_TOKENS) * req.choices


def _model_card(name: str, parent: str | None) -> dict[str, Any]:
    """A model as /v1/models lists it; a LoRA adapter (as vLLM's server lists one) with
    the served name of its base model as ``parent`` (its ``root``: its own name, as the
    adapter's directory is on the model's host, not here)."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "llmhost"}
    if parent is not None:
        card.update(root=name, parent=parent)
    return card


class OpenAiApi(Access):
    """The OpenAI door: /v1/models, /v1/chat/completions and /v1/completions."""

    async def models(self, request: Request) -> Response:
        try:
            key = self.auth(request)
            data = []
            for name in await self.pool.ready_models():
                if key.may_use(name):
                    data.append(_model_card(name, None))
                data.extend(_model_card(adapter, name) for adapter in self.pool.adapters(name)
                            if key.may_use(adapter) and adapter not in self.config.models)
        except ApiError as exc:
            return error_response(exc)
        return json_response({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        try:
            key = self.auth(request)
            base, adapter = await self.served_as(key, name)
            if not await self.pool.model_ready(base) or (adapter is not None
                                                         and adapter not in self.pool.adapters(base)):
                raise model_not_found(name)
        except ApiError as exc:
            return error_response(exc)
        return json_response(_model_card(name, base if adapter is not None else None))

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        raw = b""
        rec = record_of(request.scope)
        try:
            key = self.auth(request)
            raw = await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s)
            req = to_backend(parse_body(raw, chat), key.max_tokens)
            rec.model = req.model  # the name asked, until it is known to be served
            await self.to_served_model(key, req)
            rec.model = req.model
            await self.admit(request, key, _estimate(req))
            if req.images:
                req.images = list(await until_disconnect(request, fetch_images(req.images,
                                                                               self.config.allow_remote_images)))
            pieces = _counted(self._pieces(req, request), rec)
            rid = new_id(chat)
            if req.stream:
                # The first response before the status line: a request the backend
                # refuses gets its HTTP status, not a 200 with an error event.
                first = await until_disconnect(request, _first(pieces))
                rec.ttft_s = time.monotonic() - rec.start
                return EventStream(stream_chunks(req, first, pieces, rid))
            acc = await until_disconnect(request, _gather(pieces, req.choices))
            return json_response(completion_body(req, acc, rid, int(time.time())))
        except ApiError as exc:
            if rec.model is None and raw:  # refused before the body was parsed: the metrics' model label
                rec.model = _model_named(raw)
            return error_response(exc)
        except ClientGone:
            return Response(None, 499)

    async def embeddings(self, request: Request) -> Response:
        raw = b""
        rec = record_of(request.scope)
        try:
            key = self.auth(request)
            raw = await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s)
            req, items = parse_embeddings(raw)
            rec.model = req.model
            if req.model not in self.config.models or not key.may_use(req.model):
                raise model_not_found(req.model)
            await self.admit(request, key, sum(_text_tokens(item) for item in items))
            note = self.note_upstream(request)

            async def embed_one(item: str | list[int]) -> tuple[list[float], int]:
                one = backend_request(req.model, item)
                last: Piece | None = None
                async for piece in self.pool.stream(one.model, lambda client: client.generate(one), note):
                    last = piece if piece.embedding or last is None else last
                if last is None or not last.embedding:
                    raise not_an_embedding(req.model)
                return last.embedding, last.num_input_tokens or 0

            results = await until_disconnect(request, embed_all(items, embed_one))
            rec.prompt_tokens = sum(count for _, count in results)
            return json_response(embedding_body(req.model, results, req.encoding_format or "float"))
        except ApiError as exc:
            if rec.model is None and raw:
                rec.model = _model_named(raw)
            return error_response(exc)
        except ClientGone:
            return Response(None, 499)

    def route(self, req: BackendRequest, request: Request) -> RequestRoute:
        """Where REQ goes: its model's routing policy and, for routing by cache, its key
        (the session header, the ``user`` field where that pins, else the prompt's start)."""
        settings = self.config.routing
        policy = settings.policy_of(req.model)
        if policy not in KEYED:
            return RequestRoute(policy, load_factor=settings.load_factor)
        session = request.headers.get(SESSION_HEADER) or (req.user if settings.session_user else None)
        text = prompt_key_text(req.text_input, req.messages, req.prompt_token_ids, settings.prefix_chars)
        key, kind = route_key(req.model, text, session)
        route = RequestRoute(policy, key, kind, settings.load_factor)
        if policy == KV_EVENTS:
            route.line = socket_line(req, "")
        return route

    def _pieces(self, req: BackendRequest, request: Request) -> AsyncIterator[Piece]:
        """The backend's pieces for REQ: one upstream request, or one per prompt of a batch, merged."""
        def call(one: BackendRequest) -> AsyncIterator[Piece]:
            one.route = self.route(one, request)
            return self.pool.stream(one.model, lambda client: client.generate(one), self.note_upstream(request),
                                    one.route)

        if not req.batch:
            return call(req)
        return merged([call(one) for one in split(req)], req.n)

    async def not_found(self, request: Request) -> Response:
        return error_response(ApiError(404, f"no such path: {request.method} {request.url.path}",
                                       "not_found_error", None, "unknown_url"))
