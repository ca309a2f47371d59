"""OpenAI's Responses API, ``POST /v1/responses``, as vLLM's server serves it, over the
gateway's chat path: a Responses request becomes a chat request (``instructions`` a
system message first; ``input`` as text or items: messages, function calls and their
outputs), which goes upstream as every chat does (keys, limits, routing, the model's
tool and reasoning parsers); what comes back (text, reasoning, tool calls, usage)
becomes Responses output items, or the stream of events OpenAI's clients parse.

Objects are checked against the ``openai`` package's own types before they are sent.
Nothing is stored: ``previous_response_id`` (which needs a stored response) and the
fields of hosted features (background runs, conversations, stored prompts, hosted
tools) are refused with a 400 naming the field.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Literal

from openai.types.responses import Response as OpenAIResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from llmhost.gateway.access import Access
from llmhost.gateway.doors.openai.completion_bodies import Accumulator
from llmhost.gateway.doors.openai.images import fetch_images
from llmhost.gateway.doors.openai.mapping import _json_object, _validation_error, to_backend
from llmhost.gateway.doors.openai.request_models import ChatCompletionRequest
from llmhost.gateway.errors import ApiError, invalid, unsupported
from llmhost.gateway.httpio import ClientGone, EventStream, error_response, json_response, read_body, until_disconnect
from llmhost.gateway.record import RequestRecord, record_of
from llmhost.gateway.upstreams.client import Piece
from llmhost.gateway.upstreams.request import BackendRequest

# Fields of OpenAI's Responses API for features this server does not have: refused by
# name unless left at their null/off value.
UNSUPPORTED = ("background", "conversation", "prompt", "max_tool_calls", "top_logprobs", "context_management",
               "stream_options")
# What the refusal of previous_response_id says: it names a stored response.
NO_STORE = ("needs a stored response, and this server stores none: send the whole conversation in 'input' "
            "(the earlier output items can go back as input items)")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MessageItem(_Strict):
    """A message: the user's, the system's (or developer's), or an earlier answer's."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    # Text, or parts: input_text / output_text, and input_image with an image_url.
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(_Strict):
    """An earlier answer's call of a function tool."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    """A function tool's result, answering the call CALL_ID."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningItem(_Strict):
    """An earlier answer's reasoning: taken back as clients send it, and left out of the
    prompt (chat templates drop earlier thinking too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_TYPES: dict[str, type[InputItem]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                           "function_call_output": FunctionCallOutputItem,
                                           "reasoning": ReasoningItem}


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # Summaries are not made: the model's reasoning comes whole, as reasoning_text.
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: StrictBool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Strict):
    model: str = Field(min_length=1)
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: StrictBool | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    # Taken and not acted on: nothing is stored, nothing extra is included, every
    # request is served alike.
    store: StrictBool | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None
    # vLLM's extra sampling fields, as its server takes them on this endpoint.
    top_k: StrictInt | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    include_reasoning: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def parse_request(body: dict[str, Any]) -> ResponsesRequest:
    """A /v1/responses body (a JSON object), checked: 400 naming the field otherwise."""
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, 0):
            raise unsupported(name)
    if body.get("previous_response_id") is not None:
        raise unsupported("previous_response_id", NO_STORE)
    body = {k: v for k, v in body.items() if k not in UNSUPPORTED}
    try:
        return ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _checked(model: type[BaseModel], value: Any, where: str) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise _validation_error(exc, (where,)) from None


def _shown(value: Any) -> str:
    """A client's value, quoted back short."""
    return repr(value[:32] if isinstance(value, str) else value)[:40]


def _item(raw: dict[str, Any], i: int) -> InputItem:
    kind = raw.get("type", "message")
    model = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise unsupported(f"input[{i}].type", f"is {_shown(kind)}; served items: {', '.join(_ITEM_TYPES)}")
    item: InputItem = _checked(model, raw, f"input[{i}]")
    return item


# Content part types that carry text (input_text: the user's; output_text: an answer's).
_TEXT_PARTS = ("input_text", "output_text", "text")
# Fields an answer's output_text part carries back that do not go into a prompt.
_OUTPUT_TEXT_EXTRAS = {"annotations", "logprobs"}


def _part(part: Any, at: str) -> dict[str, Any]:
    """One content part as chat takes it (text, or image_url; chat checks the image)."""
    if not isinstance(part, dict):
        raise invalid(f"'{at}' must be an object", at)
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        extra = sorted(set(part) - {"type", "text"} - (_OUTPUT_TEXT_EXTRAS if kind == "output_text" else set()))
        if extra:
            raise unsupported(f"{at}.{extra[0]}", "is not a known field")
        if not isinstance(part.get("text"), str):
            raise invalid(f"'{at}.text' must be a string", f"{at}.text")
        return {"type": "text", "text": part["text"]}
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise unsupported(f"{at}.file_id", "needs stored files; give the picture as 'image_url'")
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise invalid(f"'{at}.image_url' must be a URL or a data: URL", f"{at}.image_url")
        detail = part.get("detail")
        return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}
    if isinstance(kind, str) and kind:
        raise unsupported(f"{at}.type", f"is {_shown(kind)}; served content parts: input_text, output_text, "
                          "input_image")
    raise invalid(f"missing required field '{at}.type'", f"{at}.type", "missing_required_parameter")


def _content(content: str | list[dict[str, Any]], at: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [_part(part, f"{at}[{j}]") for j, part in enumerate(content)]


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of REQ: instructions as the system message, then the input.
    Function calls in a row become one assistant turn with tool_calls; each function
    output a tool message answering its call."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        if not req.input:
            raise invalid("'input' is empty: give a text or a list of input items", "input")
        return [*messages, {"role": "user", "content": req.input}]
    if not req.input:
        raise invalid("'input' is empty: give a text or a list of input items", "input")
    asked: set[str] = set()
    for i, raw in enumerate(req.input):
        if not isinstance(raw, dict):
            raise invalid(f"'input[{i}]' must be an object", f"input[{i}]")
        item = _item(raw, i)
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _content(item.content, f"input[{i}].content")})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            asked.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in asked:
                raise invalid(f"'input[{i}].call_id' is {item.call_id[:64]!r}, which no earlier function_call "
                              "item in 'input' made", f"input[{i}].call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not any(m["role"] != "system" for m in messages):
        raise invalid("'input' holds no message, function call or function output", "input")
    return messages


def _tools(req: ResponsesRequest) -> dict[str, Any]:
    """Chat's tools and tool_choice fields for REQ's function tools."""
    out: dict[str, Any] = {}
    if req.tools is not None:
        tools = []
        for i, raw in enumerate(req.tools):
            kind = raw.get("type")
            if kind != "function":
                raise unsupported(f"tools[{i}].type", f"is {_shown(kind)}; only function tools are served (hosted "
                                  "tools need OpenAI's platform)")
            tool: FunctionTool = _checked(FunctionTool, raw, f"tools[{i}]")
            tools.append({"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})})
        out["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise unsupported("tool_choice.type", "names no function tool; give 'none', 'auto', 'required' or "
                              "{'type': 'function', 'name': ...}")
        named: FunctionChoice = _checked(FunctionChoice, choice, "tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": named.name}}
    elif choice is not None:
        out["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = req.parallel_tool_calls
    return out


def _response_format(fmt: TextFormat | None) -> dict[str, Any] | None:
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.name is None:
        raise invalid("missing required field 'text.format.name'", "text.format.name", "missing_required_parameter")
    schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


# Sampling fields that go to chat under the same name.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "seed", "stop", "user", "include_reasoning", "chat_template_kwargs")
# Chat's names for fields of the chat request built here, and the client's names for them.
_CLIENT_NAMES = (("max_tokens", "max_output_tokens"), ("response_format", "text.format"),
                 ("reasoning_effort", "reasoning.effort"), ("tool_choice.function.", "tool_choice."))


def _as_client_named(err: ApiError) -> ApiError:
    """ERR, a refusal of the chat built from a request, naming the field as the request
    named it (chat's tools[i].function.name is the request's tools[i].name)."""
    if not err.param:
        return err
    param = re.sub(r"^(tools\[\d+\])\.function\b", r"\1", err.param)
    for chat, ours in _CLIENT_NAMES:
        if param == chat or param.startswith(chat if chat.endswith(".") else chat + "."):
            param = ours + param[len(chat):]
            break
    if param != err.param:
        err.message = err.message.replace(f"'{err.param}'", f"'{param}'")
        err.param = param
    return err


def to_chat(req: ResponsesRequest, cap: int | None = None) -> BackendRequest:
    """REQ as the backend request of the equivalent chat (CAP: the key's max_tokens)."""
    if cap is not None and req.max_output_tokens is not None and req.max_output_tokens > cap:
        raise invalid(f"'max_output_tokens' is {req.max_output_tokens}; this API key may ask for at most {cap}",
                      "max_output_tokens", "max_tokens_above_cap")
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), "stream": bool(req.stream),
                            "max_tokens": req.max_output_tokens, **_tools(req)}
    body.update({name: getattr(req, name) for name in _SAMPLING})
    body["response_format"] = _response_format(req.text.format if req.text is not None else None)
    body["reasoning_effort"] = req.reasoning.effort if req.reasoning is not None else None
    try:
        return to_backend(ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}),
                          cap)
    except ValidationError as exc:
        err = _validation_error(exc)
        raise (_as_client_named(err) if isinstance(err, ApiError) else err) from None
    except ApiError as exc:
        raise _as_client_named(exc) from None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def checked_response(body: dict[str, Any]) -> dict[str, Any]:
    """BODY as OpenAI's Response type has it (a ValueError where it does not); its
    created_at stays whole seconds, as OpenAI's and vLLM's servers send it."""
    out: dict[str, Any] = OpenAIResponse.model_validate(body).model_dump(mode="json", exclude_unset=True)
    out["created_at"] = body["created_at"]
    return out


def _sse(event: dict[str, Any]) -> bytes:
    """One event as OpenAI's server sends it: its type as the SSE event, checked
    against the ``openai`` package's event types."""
    data = _EVENTS.dump_json(_EVENTS.validate_python(event), exclude_unset=True)
    return b"event: " + event["type"].encode() + b"\ndata: " + data + b"\n\n"


def usage_of(acc: Accumulator) -> dict[str, Any]:
    prompt, output = int(acc.num_input or 0), int(sum(acc.num_output))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


class Shape:
    """What one response says besides its output: the request's settings, echoed."""

    def __init__(self, req: ResponsesRequest, rid: str, created: int) -> None:
        self.req = req
        self.rid = rid
        self.created = created

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None
             ) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
        return checked_response({
            "id": self.rid, "object": "response", "created_at": self.created, "model": req.model,
            "status": status, "output": output, "instructions": req.instructions, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "previous_response_id": None, "reasoning": req.reasoning.model_dump() if req.reasoning else None,
            "text": {"format": fmt or {"type": "text"}}, "truncation": "disabled",
            "metadata": req.metadata or {}, "user": req.user, "usage": usage, "background": False,
        })


def _finished_status(reason: str | None) -> str:
    return "incomplete" if reason == "length" else "completed"


def output_items(text: str, parsed: dict[str, Any] | None, reason: str | None) -> list[dict[str, Any]]:
    """A whole answer's output items: its reasoning, its message (unless it only called
    tools), its function calls. PARSED: the message as the model's parsers read it."""
    status = "incomplete" if reason == "length" else "completed"
    reasoning = parsed.get("reasoning") if parsed else None
    content = (parsed.get("content") if parsed else text) or ""
    calls = (parsed.get("tool_calls") if parsed else None) or []
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append({"type": "reasoning", "id": new_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": reasoning}], "status": status})
    if content or not calls:
        items.append({"type": "message", "id": new_id("msg"), "role": "assistant", "status": status,
                      "content": [{"type": "output_text", "text": content, "annotations": [], "logprobs": []}]})
    for call in calls:
        function = call.get("function") or {}
        items.append({"type": "function_call", "id": new_id("fc"), "call_id": call.get("id") or new_id("call"),
                      "name": function.get("name", ""), "arguments": function.get("arguments") or "",
                      "status": "completed"})
    return items


class _Open:
    """The output item being streamed: its kind, id, place and what it has said."""

    def __init__(self, kind: str, index: int, call_index: int | None = None) -> None:
        self.kind = kind
        self.id = new_id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        self.index = index
        self.call_index = call_index
        self.text = ""
        self.call_id = ""
        self.name = ""


class EventWriter:
    """The events of one streamed response, numbered in order: the output items open
    as the model starts each (reasoning, message text, a function call), get their
    deltas, and close when the next begins or the answer ends."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.seq = 0
        self.done: list[dict[str, Any]] = []
        self.open: _Open | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        out = _sse({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return out

    def start(self) -> Iterator[bytes]:
        for kind in ("response.created", "response.in_progress"):
            yield self._event(kind, response=self.shape.body("in_progress", []))

    def _item(self, item: _Open, status: str) -> dict[str, Any]:
        if item.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": item.text}] if status != "in_progress" else []
            return {"type": "reasoning", "id": item.id, "summary": [], "content": content, "status": status}
        if item.kind == "message":
            content = ([{"type": "output_text", "text": item.text, "annotations": [], "logprobs": []}]
                       if status != "in_progress" else [])
            return {"type": "message", "id": item.id, "role": "assistant", "status": status, "content": content}
        return {"type": "function_call", "id": item.id, "call_id": item.call_id, "name": item.name,
                "arguments": item.text if status != "in_progress" else "", "status": status}

    def _begin(self, kind: str, call_index: int | None = None, call_id: str = "", name: str = ""
               ) -> Iterator[bytes]:
        yield from self._close("completed")
        item = self.open = _Open(kind, len(self.done), call_index)
        item.call_id, item.name = call_id or new_id("call"), name
        yield self._event("response.output_item.added", output_index=item.index,
                          item=self._item(item, "in_progress"))
        if kind == "message":
            yield self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                     "logprobs": []})
        elif kind == "reasoning":
            yield self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                              content_index=0, part={"type": "reasoning_text", "text": ""})

    def _close(self, status: str) -> Iterator[bytes]:
        item, self.open = self.open, None
        if item is None:
            return
        at = {"item_id": item.id, "output_index": item.index}
        if item.kind == "message":
            yield self._event("response.output_text.done", **at, content_index=0, text=item.text, logprobs=[])
            yield self._event("response.content_part.done", **at, content_index=0,
                              part={"type": "output_text", "text": item.text, "annotations": [], "logprobs": []})
        elif item.kind == "reasoning":
            yield self._event("response.reasoning_text.done", **at, content_index=0, text=item.text)
            yield self._event("response.content_part.done", **at, content_index=0,
                              part={"type": "reasoning_text", "text": item.text})
        else:
            yield self._event("response.function_call_arguments.done", **at, arguments=item.text)
        done = self._item(item, status if item.kind != "function_call" else "completed")
        self.done.append(done)
        yield self._event("response.output_item.done", output_index=item.index, item=done)

    def _grow(self, kind: str, event: str, delta: str) -> Iterator[bytes]:
        """DELTA of the open item of KIND (message text, reasoning), opening it first."""
        if not delta:
            return
        if self.open is None or self.open.kind != kind:
            yield from self._begin(kind)
        assert self.open is not None
        self.open.text += delta
        more = {"logprobs": []} if kind == "message" else {}
        yield self._event(event, item_id=self.open.id, output_index=self.open.index, content_index=0, delta=delta,
                          **more)

    def text(self, delta: str) -> Iterator[bytes]:
        yield from self._grow("message", "response.output_text.delta", delta)

    def reasoning(self, delta: str) -> Iterator[bytes]:
        yield from self._grow("reasoning", "response.reasoning_text.delta", delta)

    def tool_call(self, call: dict[str, Any]) -> Iterator[bytes]:
        """One streamed tool-call delta (chat's: index, and id and name with its first)."""
        index = call.get("index", 0)
        function = call.get("function") or {}
        if self.open is None or self.open.kind != "function_call" or self.open.call_index != index:
            yield from self._begin("function_call", index, call.get("id") or "", function.get("name") or "")
        assert self.open is not None
        if function.get("name") and not self.open.name:
            self.open.name = function["name"]
        delta = function.get("arguments") or ""
        if delta:
            self.open.text += delta
            yield self._event("response.function_call_arguments.delta", item_id=self.open.id,
                              output_index=self.open.index, delta=delta)

    def delta(self, said: dict[str, Any]) -> Iterator[bytes]:
        """One delta of chat's parsed stream: reasoning, content, tool calls."""
        yield from self.reasoning(said.get("reasoning") or "")
        yield from self.text(said.get("content") or "")
        for call in said.get("tool_calls") or ():
            yield from self.tool_call(call)

    def finish(self, reason: str | None, usage: dict[str, Any]) -> Iterator[bytes]:
        status = _finished_status(reason)
        if self.open is None and not self.done:
            yield from self._begin("message")  # an empty answer: still one message
        yield from self._close(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self._event(kind, response=self.shape.body(status, self.done, usage))

    def error(self, exc: ApiError) -> bytes:
        return self._event("error", code=exc.code, message=exc.message, param=exc.param)


def piece_events(writer: EventWriter, piece: Piece) -> Iterator[bytes]:
    """The events of one backend piece: its parsed deltas where the model's parsers
    read its output, else its text."""
    if piece.messages:
        raw = piece.messages[0]
        for said in json.loads(raw) if raw else []:
            yield from writer.delta(said)
    elif piece.texts:
        yield from writer.text(piece.texts[0])


async def stream_events(shape: Shape, first: Piece | None, rest: AsyncIterator[Piece]) -> AsyncIterator[bytes]:
    """The SSE bytes of a streamed response; an upstream error after the first event
    is an ``error`` event, the stream's last."""
    writer = EventWriter(shape)
    acc = Accumulator(1)
    for out in writer.start():
        yield out
    try:
        piece = first
        while piece is not None:
            acc.add(piece)
            for out in piece_events(writer, piece):
                yield out
            piece = await anext(rest, None)
    except ApiError as exc:
        yield writer.error(exc)
        return
    finally:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()
    for out in writer.finish(acc.reasons[0], usage_of(acc)):
        yield out


def whole_response(shape: Shape, acc: Accumulator) -> dict[str, Any]:
    reason = acc.reasons[0]
    return shape.body(_finished_status(reason), output_items(acc.texts[0], acc.messages[0], reason), usage_of(acc))


Pieces = Callable[[BackendRequest, Request, RequestRecord], AsyncIterator[Piece]]


class ResponsesApi:
    """``POST /v1/responses``: authenticated, limited, routed and counted as chat is.
    PIECES: a backend request's pieces, counted into the request's record; ESTIMATE:
    its tokens-per-minute charge up front."""

    def __init__(self, access: Access, pieces: Pieces, estimate: Callable[[BackendRequest], int]) -> None:
        self.access = access
        self.pieces = pieces
        self.estimate = estimate

    async def create(self, request: Request) -> Response:
        rec = record_of(request.scope)
        config = self.access.config
        try:
            key = self.access.auth(request)
            body = _json_object(await read_body(request, config.max_body_bytes, config.body_timeout_s))
            if isinstance(body.get("model"), str):
                rec.model = body["model"]
            parsed = parse_request(body)
            req = to_chat(parsed, key.max_tokens)
            await self.access.to_served_model(key, req)
            rec.model = req.model
            await self.access.admit(request, key, self.estimate(req))
            if req.images:
                req.images = list(await until_disconnect(request, fetch_images(req.images,
                                                                               config.allow_remote_images)))
            pieces = self.pieces(req, request, rec)
            shape = Shape(parsed, new_id("resp"), int(time.time()))
            if req.stream:
                # The first piece before the status line: a request the backend refuses
                # gets its HTTP status, not a 200 with an error event.
                first = await until_disconnect(request, anext(pieces, None))
                rec.ttft_s = time.monotonic() - rec.start
                return EventStream(stream_events(shape, first, pieces))
            acc = await until_disconnect(request, _whole(pieces))
            return json_response(whole_response(shape, acc))
        except ApiError as exc:
            return error_response(exc)
        except ClientGone:
            return Response(None, 499)


async def _whole(pieces: AsyncIterator[Piece]) -> Accumulator:
    acc = Accumulator(1)
    async for piece in pieces:
        acc.add(piece)
    return acc
