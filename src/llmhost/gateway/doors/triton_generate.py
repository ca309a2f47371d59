"""Triton's generate request and its responses, as both Triton doors (``native``:
HTTP, ``grpc``: KServe v2 gRPC) take and give them: a request's inputs and request
parameters, checked, with the key's max_tokens cap (``NativeRequest``: on an engine
socket or as a ModelInferRequest); each response's token counts kept on the request
record (``Counter``, ``counted``); and one answer joined from all responses (``whole``).
"""

from __future__ import annotations

import json
import struct
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from tritonclient.grpc import service_pb2

from llmhost.gateway.errors import ApiError, invalid
from llmhost.gateway.record import RequestRecord
from llmhost.numbers import integer

if TYPE_CHECKING:
    from llmhost.gateway.keys import ApiKey

STRING_INPUTS = ("text_input", "messages", "sampling_parameters")
# Base64-encoded images: one string or a list of them (an input of shape [n]).
LIST_INPUTS = ("image",)
BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob",
               "return_logprobs", "return_num_input_tokens", "return_num_output_tokens")
# Asked of the backend always (for usage and limits), returned only when the client asked.
_COUNTS = ("return_num_input_tokens", "return_num_output_tokens")
# Each count output, by the input that asks for it.
COUNT_OUTPUTS = {"num_input_tokens": "return_num_input_tokens", "num_output_tokens": "return_num_output_tokens"}
DEFAULT_MAX_TOKENS = 512
# Triton's own request parameters (the gateway sets triton_enable_empty_final_response).
RESERVED_PREFIX = "triton_"


def _bytes(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    return struct.pack("<I", len(raw)) + raw


def _parameter(name: str, value: Any) -> Any:
    """A request parameter as Triton carries it: objects and lists as JSON text."""
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict | list):
        return json.dumps(value)
    raise invalid(f"parameter '{name}' must be a string, number, boolean, list or object", name)


def _set_parameter(msg: Any, name: str, value: Any) -> None:
    param = msg.parameters[name]
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = value


class NativeRequest:
    """A generate body, checked: inputs, request parameters, the key's max_tokens cap."""

    def __init__(self, model: str, body: Any, key: ApiKey, stream_endpoint: bool) -> None:
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        self.model = model
        self.inputs: dict[str, Any] = {}
        self.params: dict[str, Any] = {}
        self.request_id = ""
        nested = body.get("parameters")
        if nested is not None and not isinstance(nested, dict):
            raise invalid("'parameters' must be a JSON object", "parameters")
        for name, value in body.items():
            if name == "parameters":
                continue
            if name == "id":
                if not isinstance(value, str):
                    raise invalid("'id' must be a string", "id")
                self.request_id = value
            elif name in STRING_INPUTS:
                if not isinstance(value, str):
                    raise invalid(f"input '{name}' must be a string", name)
                self.inputs[name] = value
            elif name in LIST_INPUTS:
                items = [value] if isinstance(value, str) else value
                if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
                    raise invalid(f"input '{name}' must be a string or a non-empty list of strings", name)
                self.inputs[name] = items
            elif name in BOOL_INPUTS:
                if not isinstance(value, bool):
                    raise invalid(f"input '{name}' must be true or false", name)
                self.inputs[name] = value
            else:
                self.params[name] = value
        self.params.update(nested or {})
        owned = sorted(name for name in self.params if name.startswith(RESERVED_PREFIX))
        if owned:
            raise invalid(f"parameter '{owned[0]}' is Triton's own, set by the gateway; leave it out", owned[0])
        self.params = {name: _parameter(name, value) for name, value in self.params.items()}
        self.asked_counts = {n for n in _COUNTS if self.inputs.get(n) is True or self.params.get(n) is True}
        self._cap(key.max_tokens)
        self.stream = stream_endpoint

    def _sampling(self) -> dict[str, Any]:
        text = self.inputs.get("sampling_parameters")
        if not text:
            return {}
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return {}  # the backend names the problem
        return value if isinstance(value, dict) else {}

    def _asked(self, name: str) -> Any:
        return self.params[name] if name in self.params else self._sampling().get(name)

    def _number(self, name: str) -> int | None:
        """An integer parameter as the backend will read it (llmhost.numbers)."""
        asked = self._asked(name)
        if asked is None:
            return None
        value = integer(asked)
        if value is None:
            raise invalid(f"parameter '{name}' must be an integer, got {str(asked)[:40]!r}", name)
        return value

    def _cap(self, cap: int | None) -> None:
        asked = self._number("max_tokens")
        if cap is not None:
            if asked is None:
                self.params["max_tokens"] = cap
                asked = cap
            elif asked > cap:
                raise invalid(f"'max_tokens' is {asked}; this API key may ask for at most {cap}", "max_tokens",
                              "max_tokens_above_cap")
        self.max_tokens = asked

    def estimate(self) -> int:
        n = self._number("n")
        return (self.max_tokens or DEFAULT_MAX_TOKENS) * (n if n is not None and n > 0 else 1)

    def _backend_inputs(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The backend's inputs (the counts always asked for) and request parameters."""
        inputs = {**self.inputs, **dict.fromkeys(_COUNTS, True)}
        return inputs, {k: v for k, v in self.params.items() if k not in _COUNTS}

    def line(self) -> dict[str, Any]:
        """The request on an engine socket (llmhost.backend.stream_socket)."""
        inputs, params = self._backend_inputs()
        return {"inputs": inputs, "parameters": params, "id": self.request_id}

    def message(self) -> Any:
        """The request as a ModelInferRequest (Triton's gRPC API)."""
        msg = service_pb2.ModelInferRequest(model_name=self.model, id=self.request_id or uuid.uuid4().hex)
        msg.parameters["triton_enable_empty_final_response"].bool_param = True
        inputs, params = self._backend_inputs()
        for name, value in inputs.items():
            t = msg.inputs.add()
            t.name = name
            if isinstance(value, list):
                t.shape.append(len(value))
                t.datatype = "BYTES"
                msg.raw_input_contents.append(b"".join(_bytes(v) for v in value))
                continue
            t.shape.append(1)
            if isinstance(value, bool):
                t.datatype = "BOOL"
                msg.raw_input_contents.append(b"\x01" if value else b"\x00")
            else:
                t.datatype = "BYTES"
                msg.raw_input_contents.append(_bytes(value))
        for name, value in params.items():
            _set_parameter(msg, name, value)
        return msg


def _join_logprobs(a: str, b: str) -> str:
    """Two responses' logprobs of one completion (JSON lists, or null) as one."""
    x, y = json.loads(a), json.loads(b)
    return b if x is None else a if y is None else json.dumps([*x, *y])


# How whole() joins the outputs of several responses that hold one completion's parts.
_JOIN: dict[str, Callable[[Any, Any], Any]] = {
    "text_output": lambda a, b: a + b,
    "num_output_tokens": lambda a, b: a + b,
    "logprobs": _join_logprobs,
}


class Counter:
    """Keeps a request record's token counts from native responses' outputs (each
    response counts its own output tokens; each response is one event of a stream)."""

    def __init__(self, rec: RequestRecord) -> None:
        self.rec = rec

    def see(self, outputs: dict[str, list[Any]]) -> None:
        if outputs.get("num_input_tokens"):
            self.rec.prompt_tokens = int(outputs["num_input_tokens"][0])
        if outputs.get("num_output_tokens"):
            counts = [int(n) for n in outputs["num_output_tokens"]]
            self.rec.output_tokens += sum(counts)
            self.rec.event_tokens.append(max(counts))


async def counted(items: AsyncIterator[tuple[str, dict[str, list[Any]]]], counter: Counter
                  ) -> AsyncIterator[tuple[str, dict[str, list[Any]]]]:
    """(model version, outputs) for each response with outputs, counted."""
    try:
        async for version, outputs in items:
            counter.see(outputs)
            yield version, outputs
    finally:
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()


async def whole(responses: AsyncIterator[tuple[str, dict[str, list[Any]]]]) -> tuple[str, dict[str, list[Any]]]:
    """One answer from all responses, (model version, outputs): per completion, texts
    and log probabilities joined and output tokens added up; the rest the latest."""
    merged: dict[str, list[Any]] = {}
    last: Any = None
    async for version, outputs in responses:
        last = version
        for name, values in outputs.items():
            join = _JOIN.get(name)
            if join is not None and name in merged:
                old = merged[name]
                merged[name] = [join(old[i], v) if i < len(old) else v for i, v in enumerate(values)]
            else:
                merged[name] = values
    if last is None:
        raise ApiError(500, "the backend sent no response", "server_error", None, "internal_error")
    return last, merged
