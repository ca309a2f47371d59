"""Triton's KServe v2 gRPC API for existing Triton clients (``tritonclient.grpc``),
on a port of its own (``--grpc-listen``), behind the gateway's keys and limits and
over the same upstream pool and engine sockets as Triton's HTTP generate API
(``native``; the request and its responses: ``triton_generate``): one streamed response per engine step.

- Every call carries the API key as ``authorization: Bearer KEY`` metadata, else
  UNAUTHENTICATED; a model outside the key's scope (or not served) is NOT_FOUND.
- ``ModelInfer`` and ``ModelStreamInfer``: the inputs of our backend (``text_input``,
  ``messages`` and ``sampling_parameters`` BYTES of one element, ``image`` BYTES, the
  BOOL inputs ``stream``, ``exclude_input_in_output``, ``return_*``), in
  ``raw_input_contents`` or ``contents``, and request parameters (``max_tokens``,
  ``temperature``...) are read as the HTTP door reads a generate body. Outputs come
  back as Triton's Python backend sends them (``text_output`` BYTES,
  ``num_output_tokens`` UINT32, ...) in ``raw_output_contents``; only those named in
  the request's ``outputs`` where it names any. ``ModelInfer`` answers once, with
  every response joined; ``ModelStreamInfer`` sends each response as it comes, with
  ``triton_final_response`` false, and, when the request's
  ``triton_enable_empty_final_response`` parameter is true, an empty last response
  with ``triton_final_response`` true, as tritonserver does for a decoupled model.
  Requests on one stream run side by side; a request's error is its stream
  response's ``error_message`` (the stream goes on).
- ``ServerLive``, ``ServerReady``, ``ModelReady``, ``ModelMetadata`` (the
  upstream's) and ``ModelConfig`` (built from the metadata: Triton's own is an admin
  API); every other method is UNIMPLEMENTED.

Each request is one request record (metrics and access log, with the path
``grpc:<method>`` and the HTTP status its outcome has on the HTTP doors).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

import grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from llmhost.gateway.access import Access
from llmhost.gateway.config import GatewayConfig, join_host_port
from llmhost.gateway.doors.triton_generate import (
    BOOL_INPUTS,
    COUNT_OUTPUTS,
    LIST_INPUTS,
    STRING_INPUTS,
    Counter,
    NativeRequest,
    counted,
    whole,
)
from llmhost.gateway.errors import ApiError, invalid
from llmhost.gateway.keys import ApiKey
from llmhost.gateway.record import Observer, RequestRecord, close_record

EMPTY_FINAL = "triton_enable_empty_final_response"
FINAL = "triton_final_response"
# The datatypes of our backend's outputs (llmhost.backend.model's OUTPUTS); any other
# output by its Python type.
OUTPUT_DATATYPES = {"text_output": "BYTES", "finish_reason": "BYTES", "cumulative_logprob": "FP32",
                    "logprobs": "BYTES", "num_input_tokens": "UINT32", "num_output_tokens": "UINT32",
                    "embedding": "FP32", "prompt_logprobs": "BYTES", "message": "BYTES"}
_PACK = {"FP32": "f", "FP64": "d", "UINT32": "I", "INT64": "q"}
# The gRPC status of each HTTP status the gateway's errors carry.
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
          408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.INVALID_ARGUMENT,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
          503: grpc.StatusCode.UNAVAILABLE}
_END = object()  # a stream's last queue item
_SERVICE = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]

Outputs = dict[str, list[Any]]


def grpc_code(status: int) -> grpc.StatusCode:
    return _CODES.get(status, grpc.StatusCode.INTERNAL)


def _bytes_elements(raw: bytes, name: str) -> list[bytes]:
    """Triton's serialized BYTES tensor: each element's 4-byte little-endian length, then the element."""
    out, at = [], 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise invalid(f"input '{name}': its raw contents end inside an element's length", name)
        (n,) = struct.unpack_from("<I", raw, at)
        if at + 4 + n > len(raw):
            raise invalid(f"input '{name}': an element's length ({n}) runs past its raw contents", name)
        out.append(raw[at + 4:at + 4 + n])
        at += 4 + n
    return out


def _elements(tensor: Any, raw: bytes | None) -> list[Any]:
    """The elements of one input tensor, from its raw contents (RAW) or its ``contents``."""
    name, datatype = tensor.name, tensor.datatype
    if datatype == "BYTES":
        items = _bytes_elements(raw, name) if raw is not None else list(tensor.contents.bytes_contents)
        try:
            values: list[Any] = [item.decode("utf-8") for item in items]
        except UnicodeDecodeError:
            raise invalid(f"input '{name}' must be UTF-8 text", name) from None
    else:  # BOOL
        values = [b != 0 for b in raw] if raw is not None else list(tensor.contents.bool_contents)
    count = 1
    for dim in tensor.shape:
        count *= dim
    if len(values) != count:
        raise invalid(f"input '{name}' has {len(values)} element(s) but its shape {list(tensor.shape)} says "
                      f"{count}", name)
    return values


def _input(tensor: Any, raw: bytes | None) -> Any:
    """One input as the HTTP door's generate body holds it."""
    name = tensor.name
    wanted = "BOOL" if name in BOOL_INPUTS else "BYTES"
    if tensor.datatype != wanted:
        raise invalid(f"input '{name}' must have datatype {wanted}, got {tensor.datatype or 'none'!r}", name)
    values = _elements(tensor, raw)
    if name in LIST_INPUTS:
        return values
    if len(values) != 1:
        raise invalid(f"input '{name}' must have exactly one element, got {len(values)}", name)
    return values[0]


def decode_request(msg: Any) -> tuple[dict[str, Any], bool, set[str]]:
    """A ModelInferRequest as a generate body (``native.NativeRequest`` checks the
    rest), whether it asks for the empty final response, and the outputs it names."""
    known = (*STRING_INPUTS, *LIST_INPUTS, *BOOL_INPUTS)
    raw = list(msg.raw_input_contents)
    if raw and len(raw) != len(msg.inputs):
        raise invalid(f"raw_input_contents has {len(raw)} entries for {len(msg.inputs)} inputs: give one per "
                      "input, or use contents", "raw_input_contents")
    body: dict[str, Any] = {}
    for i, tensor in enumerate(msg.inputs):
        name = tensor.name
        if name not in known:
            raise invalid(f"input '{name}' is not an input of this model; its inputs: {', '.join(known)}", name)
        if name in body:
            raise invalid(f"input '{name}' is given twice", name)
        body[name] = _input(tensor, raw[i] if raw else None)
    params: dict[str, Any] = {}
    empty_final = False
    for name, param in msg.parameters.items():
        which = param.WhichOneof("parameter_choice")
        if which is None:
            raise invalid(f"parameter '{name}' has no value", name)
        value = getattr(param, which)
        if name == EMPTY_FINAL:
            if which != "bool_param":
                raise invalid(f"parameter '{EMPTY_FINAL}' must be a bool_param", name)
            empty_final = value
        else:
            params[name] = value
    body["parameters"] = params
    if msg.id:
        body["id"] = msg.id
    return body, empty_final, {out.name for out in msg.outputs}


def _pack(datatype: str, values: list[Any]) -> bytes:
    if datatype == "BYTES":
        parts = [v.encode("utf-8", "surrogatepass") if isinstance(v, str) else bytes(v) for v in values]
        return b"".join(struct.pack("<I", len(p)) + p for p in parts)
    if datatype == "BOOL":
        return bytes(1 if v else 0 for v in values)
    return struct.pack(f"<{len(values)}{_PACK[datatype]}", *values)


def _datatype(name: str, values: list[Any]) -> str:
    if name in OUTPUT_DATATYPES:
        return OUTPUT_DATATYPES[name]
    first = values[0] if values else ""
    if isinstance(first, bool):
        return "BOOL"
    if isinstance(first, int):
        return "INT64"
    return "FP64" if isinstance(first, float) else "BYTES"


def encode_response(model: str, version: str, request_id: str, outputs: Outputs) -> Any:
    """A ModelInferResponse of OUTPUTS (name -> flat list), each a tensor of shape [n]."""
    resp = service_pb2.ModelInferResponse(model_name=model, model_version=version or "1", id=request_id)
    for name, values in outputs.items():
        datatype = _datatype(name, values)
        tensor = resp.outputs.add()
        tensor.name = name
        tensor.datatype = datatype
        tensor.shape.append(len(values))
        resp.raw_output_contents.append(_pack(datatype, values))
    return resp


def model_config(meta: dict[str, Any]) -> Any:
    """What clients read of a model's configuration, from its metadata: its name, our
    backend, no batching, decoupled (several responses per request), its inputs and
    outputs; not tritonserver's own, which holds the host's paths and engine arguments."""
    config = model_config_pb2.ModelConfig(name=meta["name"], backend="vllm", max_batch_size=0)
    config.model_transaction_policy.decoupled = True
    for tensors, items in ((config.input, meta["inputs"]), (config.output, meta["outputs"])):
        for t in items:
            datatype = "STRING" if t["datatype"] == "BYTES" else t["datatype"]
            tensors.add(name=t["name"], data_type=model_config_pb2.DataType.Value(f"TYPE_{datatype}"),
                        dims=t["shape"])
    return config


class _Call:
    """One request of a gRPC call: its record (closed once) and the scope its observers see."""

    def __init__(self, method: str, context: Any, observers: list[Observer]) -> None:
        self.rec = RequestRecord()
        self.scope = {"type": "grpc", "method": "POST", "path": f"grpc:{method}", "client": _peer(context)}
        self.observers = observers

    def close(self, status: int) -> None:
        self.rec.status = status
        close_record(self.rec, self.scope, self.observers)


def _peer(context: Any) -> tuple[str, int] | None:
    """The client's (address, port) from gRPC's peer text (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    kind, _, rest = str(context.peer()).partition(":")
    host, _, port = rest.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _authorization(context: Any) -> str | None:
    return next((str(v) for k, v in context.invocation_metadata() or () if k == "authorization"), None)


class _Request:
    """One inference request, checked and admitted: what it asks of the backend and
    how its answer is shown."""

    def __init__(self, native: NativeRequest, empty_final: bool, named: set[str]) -> None:
        self.native = native
        self.empty_final = empty_final
        self.named = named

    def shown(self, outputs: Outputs) -> Outputs:
        """The outputs the client gets: those it named, where it named any; the token
        counts (always asked of the backend) only where it asked for them."""
        if self.named:
            return {k: v for k, v in outputs.items() if k in self.named}
        return {k: v for k, v in outputs.items()
                if k not in COUNT_OUTPUTS or COUNT_OUTPUTS[k] in self.native.asked_counts}

    def response(self, version: str, outputs: Outputs) -> Any:
        return encode_response(self.native.model, version, self.native.request_id, self.shown(outputs))


class GrpcDoor(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The service; its methods keep the names of Triton's service definition."""

    def __init__(self, gateway: Access, observers: list[Observer]) -> None:
        self.gw = gateway
        self.observers = observers

    def _key(self, context: Any, rec: RequestRecord) -> ApiKey:
        return self.gw.auth_header(_authorization(context), rec)

    def _served(self, model: str, key: ApiKey, rec: RequestRecord) -> str:
        rec.model = model
        if model not in self.gw.config.models or not key.may_use(model):
            raise ApiError(404, f"Request for unknown model: '{model}' is not served here", "not_found_error",
                           "model", "model_not_found")
        return model

    async def _answer(self, method: str, context: Any, answer: Callable[[RequestRecord], Any]) -> Any:
        """ANSWER(record) for a call without a stream, its ApiError as the call's status."""
        call = _Call(method, context, self.observers)
        status = 499
        try:
            result = await answer(call.rec)
            status = 200
            return result
        except ApiError as exc:
            status = exc.status
            await context.abort(grpc_code(exc.status), exc.message)
        except Exception as exc:  # noqa: BLE001 - a bug of ours: INTERNAL, said in the log
            status = 500
            await context.abort(grpc.StatusCode.INTERNAL, _internal(method, exc))
        finally:
            call.close(status)

    async def ServerLive(self, request: Any, context: Any) -> Any:
        async def answer(rec: RequestRecord) -> Any:
            self._key(context, rec)
            return service_pb2.ServerLiveResponse(live=True)

        return await self._answer("ServerLive", context, answer)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        async def answer(rec: RequestRecord) -> Any:
            key = self._key(context, rec)
            mine = {m for m in self.gw.config.models if key.may_use(m)}
            return service_pb2.ServerReadyResponse(ready=set(await self.gw.pool.ready_models()) >= mine)

        return await self._answer("ServerReady", context, answer)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        async def answer(rec: RequestRecord) -> Any:
            model = self._served(request.name, self._key(context, rec), rec)
            return service_pb2.ModelReadyResponse(ready=await self.gw.pool.model_ready(model))

        return await self._answer("ModelReady", context, answer)

    async def _metadata(self, name: str, context: Any, rec: RequestRecord) -> dict[str, Any]:
        """The upstream's metadata of the model NAME (native.py's shape), once the key may see it."""
        model = self._served(name, self._key(context, rec), rec)
        return dict(await self.gw.pool.call(model, lambda client: client.model_metadata(model)))

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        async def answer(rec: RequestRecord) -> Any:
            meta = await self._metadata(request.name, context, rec)

            def tensors(items: list[dict[str, Any]]) -> list[Any]:
                return [service_pb2.ModelMetadataResponse.TensorMetadata(
                    name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in items]

            return service_pb2.ModelMetadataResponse(name=meta["name"], versions=meta["versions"],
                                                     platform=meta["platform"], inputs=tensors(meta["inputs"]),
                                                     outputs=tensors(meta["outputs"]))

        return await self._answer("ModelMetadata", context, answer)

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        async def answer(rec: RequestRecord) -> Any:
            return service_pb2.ModelConfigResponse(config=model_config(await self._metadata(request.name, context,
                                                                                            rec)))

        return await self._answer("ModelConfig", context, answer)

    async def _open(self, msg: Any, key: ApiKey, rec: RequestRecord, stream: bool
                    ) -> tuple[_Request, AsyncIterator[tuple[str, Outputs]]]:
        """MSG checked (model, inputs, parameters) and admitted under KEY's limits, and
        its responses from the pool, counted in REC."""
        model = self._served(msg.model_name, key, rec)
        body, empty_final, named = decode_request(msg)
        native = NativeRequest(model, body, key, stream)
        await self.gw.admit_record(rec, key, native.estimate())
        line, upstream_msg = native.line(), native.message()

        def note(target: str) -> None:
            rec.upstream = target

        responses = counted(self.gw.pool.stream(model, lambda c: c.native_stream(model, line, upstream_msg), note),
                            Counter(rec))
        return _Request(native, empty_final, named), responses

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        async def answer(rec: RequestRecord) -> Any:
            req, responses = await self._open(request, self._key(context, rec), rec, stream=False)
            async with contextlib.aclosing(responses):
                return req.response(*await whole(responses))

        return await self._answer("ModelInfer", context, answer)

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        try:
            key = self._key(context, RequestRecord())
        except ApiError as exc:
            _Call("ModelStreamInfer", context, self.observers).close(exc.status)
            await context.abort(grpc_code(exc.status), exc.message)
        # The responses of every request on the stream, as they come; _END once the
        # client's side is done and every request has ended.
        queue: asyncio.Queue[Any] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        def ended(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            if not tasks:
                queue.put_nowait(_END)

        def begin(work: Coroutine[Any, Any, None]) -> None:
            task = asyncio.ensure_future(work)
            tasks.add(task)
            task.add_done_callback(ended)

        async def read() -> None:
            async for msg in request_iterator:
                begin(self._stream_one(msg, key, context, queue.put_nowait))

        begin(read())
        try:
            while (item := await queue.get()) is not _END:
                yield item
        finally:
            left = list(tasks)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    async def _stream_one(self, msg: Any, key: ApiKey, context: Any, send: Callable[[Any], None]) -> None:
        """One request of a stream: its responses, or its error, onto SEND."""
        call = _Call("ModelStreamInfer", context, self.observers)
        call.rec.key = key.name
        status = 499
        try:
            req, responses = await self._open(msg, key, call.rec, stream=True)
            last_version = ""
            async with contextlib.aclosing(responses):
                async for version, outputs in responses:
                    if call.rec.ttft_s is None:
                        call.rec.ttft_s = time.monotonic() - call.rec.start
                    resp = req.response(version, outputs)
                    resp.parameters[FINAL].bool_param = False
                    send(service_pb2.ModelStreamInferResponse(infer_response=resp))
                    last_version = version
            status = 200
            if req.empty_final:
                final = req.response(last_version, {})
                final.parameters[FINAL].bool_param = True
                send(service_pb2.ModelStreamInferResponse(infer_response=final))
        except ApiError as exc:
            status = exc.status
            send(service_pb2.ModelStreamInferResponse(error_message=exc.message))
        except Exception as exc:  # noqa: BLE001 - a bug of ours ends this request alone, said in the log
            status = 500
            send(service_pb2.ModelStreamInferResponse(error_message=_internal("ModelStreamInfer", exc)))
        finally:
            call.close(status)


def _internal(method: str, exc: Exception) -> str:
    """A failure of the gateway's own, said in its log; the message the client gets."""
    print(f"llmhost gateway: gRPC {method}: internal error: {type(exc).__name__}: {str(exc)[:200]}",
          file=sys.stderr, flush=True)
    return f"internal error: {type(exc).__name__}; the gateway log has the details"


def _unimplemented(name: str) -> Callable[..., Any]:
    async def method(self: GrpcDoor, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not served by the llmhost gateway")

    method.__name__ = name
    return method


for _method in _SERVICE.methods:
    if _method.name not in GrpcDoor.__dict__:
        setattr(GrpcDoor, _method.name, _unimplemented(_method.name))


class CertificateFiles:
    """The gateway's certificate and key for gRPC's TLS, loaded again for the next
    connections once the files have changed (a renewal; the HTTP door loads them on
    SIGHUP), as soon as they hold a matching pair; until then the pair in use stays."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert = cert
        self.key = key
        self.seen = self._stamp()

    def _stamp(self) -> tuple[tuple[int, int], ...] | None:
        try:
            return tuple((s.st_mtime_ns, s.st_size) for s in (self.cert.stat(), self.key.stat()))
        except OSError:
            return None

    def configuration(self) -> Any:
        return grpc.ssl_server_certificate_configuration([(self.key.read_bytes(), self.cert.read_bytes())])

    def fetch(self) -> Any:
        """gRPC asks before each handshake: a new configuration, or None for the one in use."""
        stamp = self._stamp()
        if stamp is None or stamp == self.seen:
            return None
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
            configuration = self.configuration()
        except (OSError, ssl.SSLError, ValueError):
            return None  # half written, or not a pair: asked again at the next connection
        self.seen = stamp
        return configuration


def server_credentials(config: GatewayConfig) -> grpc.ServerCredentials | None:
    """TLS with the gateway's certificate and key, where it has them."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    files = CertificateFiles(config.tls_cert, config.tls_key)
    return grpc.dynamic_ssl_server_credentials(files.configuration(), files.fetch)


def server_options(config: GatewayConfig) -> Iterable[tuple[str, Any]]:
    # A request message may be as large as an HTTP request body.
    return [("grpc.max_receive_message_length", config.max_body_bytes), ("grpc.so_reuseport", 1)]


async def start(gateway: Access, observers: list[Observer], config: GatewayConfig) -> grpc.aio.Server:
    """The gRPC door on config.grpc_listen, started (every worker process binds the
    same port: SO_REUSEPORT shares its connections among them)."""
    assert config.grpc_listen is not None
    server = grpc.aio.server(options=list(server_options(config)))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(GrpcDoor(gateway, observers), server)
    address = join_host_port(config.grpc_listen)
    credentials = server_credentials(config)
    if credentials is None:
        server.add_insecure_port(address)
    else:
        server.add_secure_port(address, credentials)
    await server.start()
    return server
