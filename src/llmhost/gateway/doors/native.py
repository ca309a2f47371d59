"""Triton's own HTTP API for existing Triton clients, behind the gateway's keys and
limits and over the same gRPC upstream pool (never Triton's HTTP port):

- ``POST /v2/models/{m}/generate`` and ``/generate_stream``: Triton's generate
  extension. The body's keys that are inputs of our backend (``text_input``,
  ``messages``, ``sampling_parameters``, ``stream``, ``exclude_input_in_output``,
  ``return_finish_reason``, ``return_cumulative_logprob``, ``return_logprobs``,
  ``return_num_input_tokens``, ``return_num_output_tokens``, and ``image``: one
  base64 string or a list of them, for a multimodal model) become inputs;
  ``parameters`` (an object) and every other key become request parameters
  (objects and lists as JSON text). The answer: ``{"model_name", "model_version",
  <outputs>}`` (one-element outputs as a value), one per response as
  SSE ``data: {...}`` events for ``generate_stream``.
- ``GET /v2/health/live``, ``/v2/health/ready`` (every served model ready on some
  upstream), ``/v2/models/{m}`` (metadata), ``/v2/models/{m}/ready``: 200, or 400 when
  not ready, as Triton answers.

Request parameters named ``triton_...`` are Triton's own and the gateway sets those it
needs (``triton_enable_empty_final_response``): a body naming one is a 400.

Errors are Triton's ``{"error": "..."}`` with the gateway's statuses (401, 404, 413,
429, 503 and the backend's 400). Any other ``/v2`` path (repository, load/unload,
statistics, trace, logging, shared memory, config) is 404.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmhost.gateway.access import Access
from llmhost.gateway.doors.triton_generate import COUNT_OUTPUTS, Counter, NativeRequest, counted, whole
from llmhost.gateway.errors import ApiError, invalid
from llmhost.gateway.httpio import (
    ClientGone,
    EventStream,
    error_response,
    json_response,
    read_body,
    sse,
    until_disconnect,
)
from llmhost.gateway.record import record_of

if TYPE_CHECKING:
    from llmhost.gateway.keys import ApiKey


def _scalar(values: list[Any]) -> Any:
    return values[0] if len(values) == 1 else values


class NativeApi:
    def __init__(self, gateway: Access) -> None:
        self.gw = gateway

    def routes(self) -> list[Route]:
        return [
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/v2/models/{model}", self.metadata, methods=["GET"]),
            Route("/v2/models/{model}/ready", self.model_ready, methods=["GET"]),
            Route("/v2/models/{model}/generate", self.generate, methods=["POST"]),
            Route("/v2/models/{model}/generate_stream", self.generate_stream, methods=["POST"]),
        ]

    def _served(self, request: Request, key: ApiKey) -> str:
        """The model of the path, served here and open to KEY (else 404, as for no such model)."""
        model = str(request.path_params["model"])
        record_of(request.scope).model = model
        if model not in self.gw.config.models or not key.may_use(model):
            raise ApiError(404, f"Request for unknown model: '{model}' is not served here", "not_found_error",
                           "model", "model_not_found")
        return model

    async def live(self, request: Request) -> Response:
        try:
            self.gw.auth(request)
        except ApiError as exc:
            return error_response(exc, triton=True)
        return Response(None, 200)

    async def ready(self, request: Request) -> Response:
        try:
            key = self.gw.auth(request)
            mine = {m for m in self.gw.config.models if key.may_use(m)}
            ready = set(await self.gw.pool.ready_models()) >= mine
        except ApiError as exc:
            return error_response(exc, triton=True)
        return Response(None, 200 if ready else 400)

    async def model_ready(self, request: Request) -> Response:
        try:
            model = self._served(request, self.gw.auth(request))
            ready = await self.gw.pool.model_ready(model)
        except ApiError as exc:
            return error_response(exc, triton=True)
        return Response(None, 200 if ready else 400)

    async def metadata(self, request: Request) -> Response:
        try:
            model = self._served(request, self.gw.auth(request))
            body = await self.gw.pool.call(model, lambda client: client.model_metadata(model))
        except ApiError as exc:
            return error_response(exc, triton=True)
        return json_response(body)

    async def generate(self, request: Request) -> Response:
        return await self._generate(request, stream=False)

    async def generate_stream(self, request: Request) -> Response:
        return await self._generate(request, stream=True)

    def _body(self, req: NativeRequest, version: str, outputs: dict[str, list[Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"model_name": req.model, "model_version": version or "1"}
        for name, values in outputs.items():
            if name in COUNT_OUTPUTS and COUNT_OUTPUTS[name] not in req.asked_counts:
                continue
            out[name] = _scalar(values)
        return out

    async def _generate(self, request: Request, stream: bool) -> Response:
        rec = record_of(request.scope)
        try:
            key = self.gw.auth(request)
            model = self._served(request, key)
            raw = await read_body(request, self.gw.config.max_body_bytes, self.gw.config.body_timeout_s)
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                raise invalid("the request body is not valid JSON") from None
            req = NativeRequest(model, body, key, stream)
            await self.gw.admit(request, key, req.estimate())
            line, msg = req.line(), req.message()
            counter = Counter(rec)
            responses = counted(self.gw.pool.stream(model, lambda c: c.native_stream(model, line, msg),
                                                    self.gw.note_upstream(request)), counter)
            if stream:
                first = await until_disconnect(request, _first(responses))
                rec.ttft_s = time.monotonic() - rec.start
                return EventStream(self._events(req, first, responses))
            body_out = await until_disconnect(request, self._whole(req, responses))
            return json_response(body_out)
        except ApiError as exc:
            return error_response(exc, triton=True)
        except ClientGone:
            return Response(None, 499)

    async def _whole(self, req: NativeRequest, responses: AsyncIterator[tuple[str, dict[str, list[Any]]]]
                     ) -> dict[str, Any]:
        return self._body(req, *await whole(responses))

    async def _events(self, req: NativeRequest, first: tuple[str, dict[str, list[Any]]] | None,
                      rest: AsyncIterator[tuple[str, dict[str, list[Any]]]]) -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield sse(self._body(req, *first))
            async for resp, outputs in rest:
                yield sse(self._body(req, resp, outputs))
        except ApiError as exc:
            yield sse({"error": exc.message})
        finally:
            aclose = getattr(rest, "aclose", None)
            if aclose is not None:
                await aclose()


async def _first(responses: AsyncIterator[Any]) -> Any:
    try:
        return await anext(responses)
    except StopAsyncIteration:
        return None
