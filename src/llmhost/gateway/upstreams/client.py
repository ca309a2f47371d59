"""The client of one inference server: our backend over its engine sockets where
the server is on this host (``llmhost.backend.stream_socket``: one line per engine
step), else over Triton's gRPC streaming (``ModelStreamInfer``).

A request goes to a model's engine socket when ``socket_dir`` holds one for it
(one of the model's instances, picked by the request's route: llmhost.gateway.routing.policies;
in turn for a request without one); where none is there, or the socket drops
the request before any answer, it goes over gRPC.

Uses tritonclient's generated gRPC stubs on a ``grpc.aio`` channel: the asyncio
client's ``stream_infer`` cannot ask for the empty final response
(``triton_enable_empty_final_response``) that tells when a decoupled model is done.
Each request gets its own stream. A request that ends (its final response came)
closes its stream the polite way: the client half-closes and waits for the server
to end the call. Cancelling a finished call instead leaked a reference to the model
in Triton 2.51 whenever several streams ran at once, and the model could then not
unload: tritonserver spent its whole exit timeout on the next stop and exited 1
(docs/reliability.md). Only a request still running is cancelled (a client that
went away): Triton cancels it, and our backend aborts it in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from llmhost.gateway.errors import ApiError, invalid
from llmhost.gateway.routing.inflight import InFlight, socket_load_name
from llmhost.gateway.routing.kvevents import KvEventsIndex
from llmhost.gateway.routing.policies import KV_EVENTS, ROUND_ROBIN, Chooser, Route
from llmhost.gateway.upstreams.request import BackendRequest

# How the messages begin that mean "this server cannot serve now; retry" (503), not
# "your request is wrong" (400): the backend's (llmhost.backend.watchdog, health.py,
# model.py, engine.py) and Triton's own for a model it does not serve now ("Request for
# unknown model: 'm' has no available versions" while it unloads on stop, "... is not
# found", "Server not ready"; the gateway sends only the models it serves, so this
# upstream cannot serve it now and the request is retried on another). Only the
# beginning counts: a message that echoes a client's text (an unknown parameter's
# name) begins with the backend's own words, so no client can make an upstream look
# unavailable to every other client.
_UNAVAILABLE_PREFIXES = ("the model's engine stopped (", "the model is shutting down",
                         "Model is unavailable due to unhealthy vLLM engine", "Request for unknown model: ",
                         "Server not ready")
# Triton's python backend failed to hand this one request to its stub: "Stub process
# 'm_0_0' is not healthy." when the stub's health thread did not mark it healthy within
# a second (Triton 24.10 checks that while it waits for the stub; a busy machine makes
# a thread wait that long, docs/testing.md). The stub and the model go on serving.
_NOT_STARTED_PREFIXES = ("Stub process ",)
_MAX_MESSAGE = 64 * 1024 * 1024
# How long a finished call may take to end after the client half-closed it (Triton
# ends it at once); after that it is cancelled.
_CLOSE_TIMEOUT_S = 5.0


@dataclass
class Piece:
    """One backend response: text per completion (deltas when streaming)."""

    texts: list[str]
    finish_reasons: list[str]
    num_input_tokens: int | None
    num_output_tokens: list[int]
    final: bool
    # Per completion, the backend's log probabilities of this piece's tokens as JSON
    # text (llmhost.backend.outputs); empty when the request asked for none.
    logprobs: list[str] = field(default_factory=list)
    # An embedding model's answer: the prompt's embedding (empty for generated text).
    embedding: list[float] = field(default_factory=list)
    # The prompt's log probabilities (JSON, llmhost.backend.outputs), in the first piece.
    prompt_logprobs: str | None = None
    # A chat read by the model's tool or reasoning parser: per completion, JSON of a list
    # of vLLM's deltas (streamed) or of its one whole message (llmhost.backend.outputs).
    messages: list[str] = field(default_factory=list)


# What the gateway asks of the backend besides the prompt: the same on both paths.
BACKEND_FLAGS = ("exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
                 "return_num_output_tokens")


def backend_flags(req: BackendRequest) -> tuple[str, ...]:
    """BACKEND_FLAGS, and the log probabilities where the request asks for them."""
    return (*BACKEND_FLAGS, "return_logprobs") if req.logprobs is not None else BACKEND_FLAGS


def prompt_input(req: BackendRequest) -> tuple[str, str | list[int]]:
    """The backend input that carries the request's prompt, and its value."""
    if req.prompt_token_ids is not None:
        return "prompt_token_ids", req.prompt_token_ids
    if req.text_input is not None:
        return "text_input", req.text_input
    return "messages", json.dumps(req.messages)


def socket_line(req: BackendRequest, request_id: str) -> dict[str, Any]:
    """The engine socket's request for one backend request."""
    name, value = prompt_input(req)
    inputs: dict[str, Any] = {name: value}
    inputs["sampling_parameters"] = json.dumps(req.sampling)
    inputs["stream"] = req.stream
    if req.images:
        inputs["image"] = req.images
    inputs.update(dict.fromkeys(backend_flags(req), True))
    params: dict[str, Any] = {"sparse_outputs": True, "embed": True} if req.embed else {"sparse_outputs": True}
    if req.tokens is not None:
        params[req.tokens] = True
    return {"inputs": inputs, "parameters": params, "id": request_id}


def encode_line(line: dict[str, Any]) -> bytes:
    return json.dumps(line, separators=(",", ":")).encode("utf-8", "surrogatepass") + b"\n"


def socket_request(req: BackendRequest, request_id: str) -> bytes:
    """The engine socket's request line for one backend request."""
    return encode_line(socket_line(req, request_id))


def socket_piece(outputs: dict[str, list[Any]], final: bool) -> Piece:
    """One response's outputs by name (an engine socket line's, or a decoded
    ModelInferResponse's) -> Piece."""
    inputs = outputs.get("num_input_tokens")
    return Piece(texts=outputs.get("text_output", []), finish_reasons=outputs.get("finish_reason", []),
                 num_input_tokens=inputs[0] if inputs else None,
                 num_output_tokens=outputs.get("num_output_tokens", []), final=final,
                 logprobs=outputs.get("logprobs", []), embedding=outputs.get("embedding", []),
                 prompt_logprobs=next(iter(outputs.get("prompt_logprobs", ())), None),
                 messages=outputs.get("message", []))


def _bytes_tensor(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def build_request(req: BackendRequest, request_id: str) -> Any:
    """The ModelInferRequest for one backend request (inputs as raw contents)."""
    msg = service_pb2.ModelInferRequest(model_name=req.model, id=request_id)
    msg.parameters["triton_enable_empty_final_response"].bool_param = True
    # finish_reason and num_input_tokens only in the responses where they say
    # something (llmhost.backend.outputs): fewer tensors per token for the stub.
    msg.parameters["sparse_outputs"].bool_param = True
    if req.embed:
        msg.parameters["embed"].bool_param = True
    if req.tokens is not None:
        msg.parameters[req.tokens].bool_param = True
    tensors: list[tuple[str, str, bytes, int]] = []
    name, value = prompt_input(req)
    if isinstance(value, list):
        tensors.append((name, "INT64", struct.pack(f"<{len(value)}q", *value), len(value)))
    else:
        tensors.append((name, "BYTES", _bytes_tensor([value.encode("utf-8", "surrogatepass")]), 1))
    tensors.append(("sampling_parameters", "BYTES", _bytes_tensor([json.dumps(req.sampling).encode()]), 1))
    if req.images:
        pictures = [img.encode("ascii") for img in req.images if isinstance(img, str)]
        tensors.append(("image", "BYTES", _bytes_tensor(pictures), len(pictures)))
    for name, flag in (("stream", req.stream), *((f, True) for f in backend_flags(req))):
        tensors.append((name, "BOOL", b"\x01" if flag else b"\x00", 1))
    for name, dtype, raw, size in tensors:
        t = msg.inputs.add()
        t.name, t.datatype = name, dtype
        t.shape.append(size)
        msg.raw_input_contents.append(raw)
    return msg


def _decode_bytes(raw: bytes) -> list[str]:
    out, at = [], 0
    while at + 4 <= len(raw):
        (n,) = struct.unpack_from("<I", raw, at)
        out.append(raw[at + 4:at + 4 + n].decode("utf-8", "replace"))
        at += 4 + n
    return out


# One element of each numeric datatype (little-endian, as Triton sends raw contents).
_NUMERIC = {name: struct.Struct("<" + code) for name, code in (
    ("UINT8", "B"), ("UINT16", "H"), ("UINT32", "I"), ("UINT64", "Q"), ("INT8", "b"), ("INT16", "h"),
    ("INT32", "i"), ("INT64", "q"), ("FP32", "f"), ("FP64", "d"))}


def decode_outputs(resp: Any) -> dict[str, list[Any]]:
    """A ModelInferResponse's outputs by name, each a flat list (BYTES as text)."""
    values: dict[str, list[Any]] = {}
    for out, raw in zip(resp.outputs, resp.raw_output_contents, strict=False):
        # Read each protobuf field once: every access builds a new Python object.
        datatype = out.datatype
        if datatype == "BYTES":
            values[out.name] = _decode_bytes(raw)
        elif datatype == "BOOL":
            values[out.name] = [b != 0 for b in raw]
        elif (element := _NUMERIC.get(datatype)) is not None:
            values[out.name] = [v for (v,) in element.iter_unpack(raw)]
    return values


def is_final(resp: Any) -> bool:
    final_param = resp.parameters.get("triton_final_response")
    return bool(final_param is not None and final_param.bool_param)


def parse_response(resp: Any) -> Piece:
    """A ModelInferResponse -> Piece (outputs absent from it stay empty)."""
    return socket_piece(decode_outputs(resp), is_final(resp))


class UpstreamDown(ApiError):
    """The upstream could not be reached or dropped the call (503): the pool marks
    it down and, when nothing was sent yet, retries on another upstream."""

    def __init__(self, target: str, message: str = "the inference server is not reachable; retry shortly") -> None:
        super().__init__(503, message, "service_unavailable_error", None, "upstream_unavailable")
        self.target = target


class Draining(ApiError):
    """The backend is shutting down or its engine stopped (503): the pool takes the
    upstream out until its health check passes again."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, "service_unavailable_error", None, "upstream_unavailable")


class NotStarted(ApiError):
    """The server could not hand this request to its model this time, and nothing of
    it was produced (503): the pool tries it once more (on another upstream where one
    serves the model, else on the same) and leaves the upstream in service."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, "service_unavailable_error", None, "upstream_unavailable")


def classify(message: str) -> ApiError:
    """A backend error message -> the error the client sees."""
    if message.startswith(_UNAVAILABLE_PREFIXES):
        return Draining(message)
    if message.startswith(_NOT_STARTED_PREFIXES):
        return NotStarted(message)
    if message.startswith("internal error"):
        return ApiError(500, message, "server_error", None, "internal_error")
    return invalid(message, None, "invalid_request")


class _NoAnswer(Exception):
    """The engine socket took no request (gone, or dropped it before answering)."""


# Engine socket error kinds -> the client's error.
def _socket_error(message: str, kind: str) -> ApiError:
    if kind == "unavailable":
        return Draining(message)
    if kind == "internal":
        return ApiError(500, message, "server_error", None, "internal_error")
    return invalid(message, None, "invalid_request")


class Upstream:
    """One Triton server (HOST:PORT of its gRPC endpoint) and, on this host, the
    folder of its engine sockets (SOCKET_DIR). ON_LINE(model, tokens, transit_s),
    when given, sees every engine socket line (the gateway's metrics)."""

    def __init__(self, target: str, timeout_s: float = 5.0, socket_dir: Path | None = None,
                 on_line: Callable[[str, int, float], None] | None = None, ca: bytes | None = None,
                 kv_events: KvEventsIndex | None = None) -> None:
        self.target = target
        # PEM CA certificates that verify the server: gRPC over TLS (None: plaintext).
        self.ca = ca
        self.timeout_s = timeout_s
        self.socket_dir = socket_dir
        self.on_line = on_line
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._chooser = Chooser()
        # Requests in flight per engine socket (every worker's, where the gateway shares them).
        self.in_flight = InFlight()
        # What this host's engines' caches hold (the kv_events policy; one index for every
        # upstream of the gateway), followed once a request asks.
        self.kv_events = kv_events if socket_dir is not None else None

    def _get_stub(self) -> Any:
        if self._stub is None:
            options = [("grpc.max_send_message_length", _MAX_MESSAGE),
                       ("grpc.max_receive_message_length", _MAX_MESSAGE)]
            if self.ca is not None:
                credentials = grpc.ssl_channel_credentials(root_certificates=self.ca)
                self._channel = grpc.aio.secure_channel(self.target, credentials, options=options)
            else:
                self._channel = grpc.aio.insecure_channel(self.target, options=options)
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def model_ready(self, model: str, timeout_s: float | None = None) -> bool:
        """Whether the model is ready; an unreachable server raises UpstreamDown (503)."""
        try:
            resp = await self._get_stub().ModelReady(service_pb2.ModelReadyRequest(name=model),
                                                     timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise UpstreamDown(self.target) from None
            return False
        return bool(resp.ready)

    async def model_metadata(self, model: str) -> dict[str, Any]:
        """Triton's model metadata as its HTTP API writes it."""
        try:
            m = await self._get_stub().ModelMetadata(service_pb2.ModelMetadataRequest(name=model),
                                                     timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise UpstreamDown(self.target) from None
            raise ApiError(404, f"no metadata for model '{model}': {exc.details()}", "not_found_error", "model",
                           "model_not_found") from None

        def tensors(items: Any) -> list[dict[str, Any]]:
            return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]

        return {"name": m.name, "versions": list(m.versions), "platform": m.platform,
                "inputs": tensors(m.inputs), "outputs": tensors(m.outputs)}

    async def model_config(self, model: str) -> Any:
        """Triton's ModelConfigResponse of MODEL: its config.pbtxt as loaded, whose
        parameters publish the model's LoRA adapters (pool.published_adapters)."""
        try:
            return await self._get_stub().ModelConfig(service_pb2.ModelConfigRequest(name=model),
                                                      timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise UpstreamDown(self.target) from None
            raise ApiError(404, f"no configuration for model '{model}': {exc.details()}", "not_found_error",
                           "model", "model_not_found") from None

    def engine_sockets(self, model: str) -> list[Path]:
        """MODEL's engine sockets on this host, by name (none where it has no folder of
        sockets). A socket's name starts with the model version its instance serves:
        ``<version>-<instance>.sock``."""
        if self.socket_dir is None or not model or model.startswith(".") or "/" in model:
            return []
        try:
            with os.scandir(self.socket_dir / model) as entries:
                return sorted(Path(e.path) for e in entries if e.name.endswith(".sock"))
        except OSError:
            return []

    def engine_socket(self, model: str, route: Route | None = None) -> Path | None:
        """One of MODEL's engine sockets, picked by ROUTE (None: in turn), or None."""
        found = self.engine_sockets(model)
        if not found:
            return None
        return self._chooser.choose(route or Route(ROUND_ROBIN), model, found, lambda p: p.name,
                                    lambda p: self.in_flight.count(socket_load_name(p)))

    async def generate(self, req: BackendRequest) -> AsyncIterator[Piece]:
        """The backend's responses for one request. Leaving the iteration early
        (an exception, a cancelled task, ``aclose``) cancels the upstream request."""
        route = req.route
        # kv_events: the request's line was made for the routing already.
        line = ({**route.line, "id": uuid.uuid4().hex} if route is not None and route.line is not None
                else socket_line(req, uuid.uuid4().hex))
        if route is not None and route.policy == KV_EVENTS and route.kind == "prefix" and self.kv_events is not None:
            found = self.engine_sockets(req.model)
            route.matches = await self.kv_events.matches({s.name: [s] for s in found}, route) \
                if len(found) > 1 else None
        path = self.engine_socket(req.model, route)
        if path is not None:
            try:
                with self.in_flight.holding(socket_load_name(path)):
                    async for outputs, final in self.socket_lines(path, req.model, encode_line(line)):
                        yield socket_piece(outputs, final)
                return
            except _NoAnswer:
                pass  # over gRPC instead
        async with contextlib.aclosing(self.infer_stream(build_request(req, uuid.uuid4().hex))) as responses:
            async for resp in responses:
                piece = parse_response(resp)
                yield piece
                if piece.final:
                    return

    async def native_stream(self, model: str, line: dict[str, Any], message: Any
                            ) -> AsyncIterator[tuple[str, dict[str, list[Any]]]]:
        """Triton's generate API: (model version, outputs) per response with outputs,
        over an engine socket (LINE: its request, ``inputs`` and ``parameters``),
        else over gRPC (MESSAGE: the same request as a ModelInferRequest)."""
        path = self.engine_socket(model)
        if path is not None:
            version = path.name.partition("-")[0]
            data = encode_line(line)
            try:
                with self.in_flight.holding(socket_load_name(path)):
                    async for outputs, _ in self.socket_lines(path, model, data):
                        yield version, outputs
                return
            except _NoAnswer:
                pass  # over gRPC instead
        async with contextlib.aclosing(self.infer_stream(message)) as responses:
            async for resp in responses:
                if outputs := decode_outputs(resp):
                    yield resp.model_version, outputs

    async def socket_lines(self, path: Path, model: str, request: bytes
                           ) -> AsyncIterator[tuple[dict[str, list[Any]], bool]]:
        """One request (its line) on an engine socket: (outputs, final) per response,
        up to the final one. Raises _NoAnswer when the socket took no request;
        leaving early hangs up, which cancels the request in the engine."""
        try:
            reader, writer = await asyncio.open_unix_connection(str(path), limit=_MAX_MESSAGE)
        except OSError:
            raise _NoAnswer from None
        answered = False
        on_line = self.on_line
        try:
            writer.write(request)
            while True:
                try:
                    line = await reader.readuntil(b"\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    if answered:
                        raise UpstreamDown(self.target, "the inference server closed the stream early; "
                                           "retry shortly") from None
                    raise _NoAnswer from None
                answered = True
                msg = json.loads(line)
                if "error" in msg:
                    raise _socket_error(msg["error"], msg.get("kind", ""))
                outputs, final = msg["outputs"], bool(msg["final"])
                if on_line is not None:
                    on_line(model, sum(outputs.get("num_output_tokens", ())), time.time() - msg["t"])
                yield outputs, final
                if final:
                    return
        finally:
            writer.close()

    async def infer_stream(self, request: Any) -> AsyncIterator[Any]:
        """The ModelInferResponses of one ModelInferRequest (asking for the empty
        final response), up to the final one; a backend error raises its ApiError."""
        done = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield request
            await done.wait()  # keep the stream open until the last response

        call = self._get_stub().ModelStreamInfer(requests())
        finished = False
        try:
            async for resp in call:
                if resp.error_message:
                    finished = True  # an error response is the request's last
                    raise classify(resp.error_message)
                if is_final(resp.infer_response):
                    finished = True
                yield resp.infer_response
                if finished:
                    return
            raise UpstreamDown(self.target, "the inference server closed the stream early; retry shortly")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                raise
            raise UpstreamDown(self.target) from None
        finally:
            done.set()  # half-close: no more requests on this stream
            if finished:
                await _close_finished(call)
            else:
                call.cancel()


async def _close_finished(call: Any) -> None:
    """Wait for the server to end a call whose request is done (the client has
    half-closed it); cancel it if that takes longer than _CLOSE_TIMEOUT_S or the
    waiting task is cancelled."""
    try:
        await asyncio.wait_for(call.code(), _CLOSE_TIMEOUT_S)
    except asyncio.CancelledError:
        call.cancel()
        raise
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        call.cancel()
