"""Turn one Triton request's inputs and parameters into a validated generation job.

Pure Python (no Triton, no vLLM import): every rule about what a client may send
lives here and is unit-tested. Any problem raises ``RequestError`` whose message
names the input or key at fault; the backend sends it back as the error response.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from llmhost.backend.config import BackendSettings
from llmhost.backend.errors import RequestError
from llmhost.backend.sampling import validate_sampling

TEXT_INPUT = "text_input"
MESSAGES = "messages"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT = "exclude_input_in_output"
RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
BOOL_INPUTS = (STREAM, EXCLUDE_INPUT, *RETURN_FLAGS)
MAX_MESSAGES = 1024
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class GenerateJob:
    prompt: str | None
    messages: list[dict[str, str]] | None
    stream: bool
    exclude_input: bool
    sampling: dict[str, Any]
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    extras: dict[str, Any] = field(default_factory=dict)


def _scalar(name: str, value: Any) -> Any:
    """The single element of a [1]-shaped input (numpy array or list)."""
    flat = value.reshape(-1).tolist() if hasattr(value, "reshape") else list(value)
    if len(flat) != 1:
        raise RequestError(f"input '{name}' must hold exactly one element, got {len(flat)}")
    return flat[0]


def _text(name: str, value: Any) -> str:
    item = _scalar(name, value)
    if isinstance(item, str):
        return item
    if isinstance(item, (bytes, bytearray)):
        try:
            return bytes(item).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(
                f"input '{name}' is not valid UTF-8: byte 0x{item[exc.start]:02x} at position {exc.start}"
            ) from None
    raise RequestError(f"input '{name}' must be a string, got {type(item).__name__}")


def _bool(name: str, value: Any) -> bool:
    item = _scalar(name, value)
    if isinstance(item, bool) or type(item).__name__ == "bool_":
        return bool(item)
    raise RequestError(f"input '{name}' must be a BOOL, got {item!r}")


def parse_messages(text: str) -> list[dict[str, str]]:
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"input 'messages' is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(messages, list) or not messages:
        raise RequestError("input 'messages' must be a non-empty JSON list of {\"role\", \"content\"} objects")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"input 'messages' holds {len(messages)} messages; at most {MAX_MESSAGES} are allowed")
    out: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content', got {type(msg).__name__}")
        extra = sorted(set(msg) - {"role", "content", "name"})
        if extra:
            raise RequestError(f"messages[{i}] has unknown key(s) {extra}; allowed: role, content, name")
        role, content = msg.get("role"), msg.get("content")
        if role not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        out.append({k: v for k, v in msg.items()})
    if all(not m["content"].strip() for m in out):
        raise RequestError("input 'messages' has no content: every message is empty")
    return out


def _parameters(sampling_json: str | None, request_params: str | dict[str, Any] | None) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    if sampling_json is not None:
        try:
            parsed = json.loads(sampling_json) if sampling_json.strip() else {}
        except json.JSONDecodeError as exc:
            raise RequestError(
                f"input 'sampling_parameters' is not valid JSON: {exc.msg} at position {exc.pos}"
            ) from None
        if not isinstance(parsed, dict):
            raise RequestError("input 'sampling_parameters' must be a JSON object")
        merged.update(parsed)
    if request_params:
        params = json.loads(request_params) if isinstance(request_params, str) else dict(request_params)
        merged.update(params)  # request parameters win over the JSON input
    return merged


def parse_request(
    inputs: dict[str, Any],
    request_params: str | dict[str, Any] | None,
    settings: BackendSettings,
) -> GenerateJob:
    """Validate one request. ``inputs`` maps input names to arrays (absent = missing)."""
    has_text = inputs.get(TEXT_INPUT) is not None
    has_messages = inputs.get(MESSAGES) is not None
    if has_text and has_messages:
        raise RequestError("give either 'text_input' or 'messages', not both")
    if not has_text and not has_messages:
        raise RequestError("missing input: give 'text_input' (a prompt) or 'messages' (a JSON chat list)")

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    if has_text:
        prompt = _text(TEXT_INPUT, inputs[TEXT_INPUT])
        if not prompt.strip():
            raise RequestError("input 'text_input' is empty")
    else:
        messages = parse_messages(_text(MESSAGES, inputs[MESSAGES]))

    flags = {name: _bool(name, inputs[name]) for name in BOOL_INPUTS if inputs.get(name) is not None}
    raw_sampling = inputs.get(SAMPLING_PARAMETERS)
    sampling_json = _text(SAMPLING_PARAMETERS, raw_sampling) if raw_sampling is not None else None
    params = _parameters(sampling_json, request_params)
    # Boolean switches may also come as request parameters (HTTP generate sends
    # unknown JSON keys that way); inputs win.
    for name in BOOL_INPUTS:
        if name in params:
            value = params.pop(name)
            if not isinstance(value, bool):
                raise RequestError(f"'{name}' must be true or false, got {value!r}")
            flags.setdefault(name, value)
    sampling = validate_sampling(params, settings)
    return GenerateJob(
        prompt=prompt,
        messages=messages,
        stream=flags.get(STREAM, False),
        exclude_input=flags.get(EXCLUDE_INPUT, settings.exclude_input_in_output) or messages is not None,
        sampling=sampling,
        return_finish_reason=flags.get("return_finish_reason", False),
        return_num_input_tokens=flags.get("return_num_input_tokens", False),
        return_num_output_tokens=flags.get("return_num_output_tokens", False),
    )
