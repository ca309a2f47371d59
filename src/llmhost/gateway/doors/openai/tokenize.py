"""``POST /tokenize`` and ``POST /detokenize`` as vLLM's OpenAI server answers them:
``{"model", "prompt" | "messages", "return_token_strs"?, ...}`` -> ``{"count",
"max_model_len", "tokens", "token_strs"}``, and ``{"model", "tokens"}`` -> ``{"prompt"}``.

The model's own backend tokenizes (llmhost.backend.tokens): the gateway may run where
the model's files are not, and the backend's tokenizer is the one that tokenizes the
model's prompts (chat template and all), so the counts are those a generation request
gets. The request goes to an upstream like any other (engine socket or gRPC), and the
engine never sees it. Each is a request of the key (authenticated, scoped to the
key's models, counted against its requests per minute and concurrency; no tokens).
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmhost.gateway.access import Access
from llmhost.gateway.doors.openai.mapping import parse_detokenize, parse_tokenize
from llmhost.gateway.errors import ApiError
from llmhost.gateway.httpio import ClientGone, error_response, json_response, read_body, until_disconnect
from llmhost.gateway.keys import ApiKey
from llmhost.gateway.record import record_of
from llmhost.gateway.upstreams.client import Piece
from llmhost.gateway.upstreams.request import BackendRequest


class TokenizeApi:
    def __init__(self, access: Access) -> None:
        self.access = access

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"])]

    async def tokenize(self, request: Request) -> Response:
        try:
            key, raw = await self._body(request)
            req, token_strs = parse_tokenize(raw)
            answer = json.loads(await self._answer(request, key, req))
            return json_response({"count": len(answer["tokens"]), "max_model_len": answer["max_model_len"],
                                  "tokens": answer["tokens"],
                                  "token_strs": answer["token_strs"] if token_strs else None})
        except ApiError as exc:
            return error_response(exc)
        except ClientGone:
            return Response(None, 499)

    async def detokenize(self, request: Request) -> Response:
        try:
            key, raw = await self._body(request)
            return json_response({"prompt": await self._answer(request, key, parse_detokenize(raw))})
        except ApiError as exc:
            return error_response(exc)
        except ClientGone:
            return Response(None, 499)

    async def _body(self, request: Request) -> tuple[ApiKey, bytes]:
        """The request's API key (401 without one) and its body."""
        key, config = self.access.auth(request), self.access.config
        return key, await read_body(request, config.max_body_bytes, config.body_timeout_s)

    async def _answer(self, request: Request, key: ApiKey, req: BackendRequest) -> str:
        """The backend tokenizer's text_output for REQ, on an upstream serving its model
        (404 for a model the key may not use, as on chat)."""
        rec = record_of(request.scope)
        rec.model = req.model  # the name asked, until it is known to be served
        # A LoRA adapter tokenizes as its base model: the adapter has no tokenizer of its own.
        req.model, _ = await self.access.served_as(key, req.model)
        rec.model = req.model
        await self.access.admit(request, key, 0)
        pool, note = self.access.pool, self.access.note_upstream(request)

        async def last() -> Piece | None:
            out: Piece | None = None
            async for piece in pool.stream(req.model, lambda client: client.generate(req), note):
                out = piece if piece.texts or out is None else out
            return out

        piece = await until_disconnect(request, last())
        if piece is None or not piece.texts:
            raise ApiError(502, f"model '{req.model}' answered without its tokenizer's answer", "server_error",
                           None, "upstream_error")
        return str(piece.texts[0])
