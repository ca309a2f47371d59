"""Turn one Triton request's inputs and parameters into a validated generation job.

Pure Python (no Triton, no vLLM import): every rule about what a client may send
lives here and is unit-tested. Any problem raises ``RequestError`` whose message
names the input or key at fault; the backend sends it back as the error response.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmhost.backend import jsonguard
from llmhost.backend.config import MAXIMA, BackendSettings
from llmhost.backend.errors import RequestError
from llmhost.backend.images import IMAGE, parse_images
from llmhost.backend.limits import MAX_PARAMETERS_BYTES
from llmhost.backend.lora import request_lora_name
from llmhost.backend.outputs import SPARSE_OUTPUTS
from llmhost.backend.sampling import validate_sampling

TEXT_INPUT = "text_input"
# A prompt given as token ids (INT64 [-1]) instead of text_input or messages.
PROMPT_TOKEN_IDS = "prompt_token_ids"
# More ids than any model's context: refused before anything else looks at them.
MAX_PROMPT_TOKEN_IDS = 1 << 20
MESSAGES = "messages"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT = "exclude_input_in_output"
# Additional outputs, each asked for by a BOOL input of this name (vllm_backend's).
RETURN_FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
                "return_num_output_tokens")
# A request's own stream interval (ms): a request parameter, or a key of 'sampling_parameters'.
STREAM_INTERVAL = "stream_interval_ms"
# The request parameter that asks for the prompt's embedding (the gateway's /v1/embeddings
# sets it): an embedding model (engine_args runner: pooling) answers every request with
# one, a model that generates text refuses it.
EMBED = "embed"
# The request parameters that ask for the tokenizer's answer alone, no generation (the
# gateway's /tokenize and /detokenize set them; llmhost.backend.tokens): the prompt's
# token ids ('text_input' or 'messages'), or the text of 'prompt_token_ids'.
TOKENIZE = "tokenize"
DETOKENIZE = "detokenize"
BOOL_INPUTS = (STREAM, EXCLUDE_INPUT, *RETURN_FLAGS)
MAX_MESSAGES = 1024
# A chat message's keys: OpenAI's, with an assistant's tool calls and a tool result's id.
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
# A content given as parts (OpenAI's list form): text, and the place of one picture of
# the 'image' input (in order), whose placeholder the model's chat rendering puts in.
CONTENT_PART_TYPES = ("text", "image")
# OpenAI's tool fields, taken from the request's parameters (sampling_parameters or
# request parameters) for a chat: the tools the model may call, which it must call,
# and whether it may call several at once.
TOOLS = "tools"
TOOL_CHOICE = "tool_choice"
PARALLEL_TOOL_CALLS = "parallel_tool_calls"
# A chat's template arguments and reasoning switches, as vLLM's OpenAI server takes them.
CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"
REASONING_EFFORT = "reasoning_effort"
INCLUDE_REASONING = "include_reasoning"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# OpenAI's own bound on tools in one request.
MAX_TOOLS = 128
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# JSON text of 'messages' may be this much larger than the limit on its contents:
# an escape (\u0001) takes 6 bytes for a 1-byte character, plus keys and roles.
MESSAGES_JSON_FACTOR = 6
MESSAGES_JSON_EXTRA = 64 * 1024
# The most of a client's request id that the log shows.
MAX_CLIENT_ID_CHARS = 128


@dataclass(frozen=True)
class RequestLimits:
    """Bounds that come from the running engine (unknown to unit tests: None)."""

    max_model_len: int
    max_prompt_bytes: int
    # Where max_prompt_bytes comes from, for error messages.
    prompt_bytes_source: str = "llmhost.max_prompt_bytes"

    @property
    def messages_json_bytes(self) -> int:
        return self.max_prompt_bytes * MESSAGES_JSON_FACTOR + MESSAGES_JSON_EXTRA

    def text_too_big(self, size: int) -> RequestError:
        return RequestError(f"input 'text_input' is {size} bytes; at most {self.max_prompt_bytes} bytes are "
                            f"allowed ({self.prompt_bytes_source})")

    def messages_json_too_big(self, size: int) -> RequestError:
        return RequestError(f"input 'messages' is {size} bytes of JSON; at most {self.messages_json_bytes} bytes "
                            f"are allowed ({MESSAGES_JSON_FACTOR} x {self.prompt_bytes_source}, plus 64 KiB)")

    def messages_too_big(self, size: int) -> RequestError:
        return RequestError(f"input 'messages' holds {size} bytes of content; at most {self.max_prompt_bytes} "
                            f"bytes are allowed ({self.prompt_bytes_source})")


@dataclass
class GenerateJob:
    prompt: str | None
    messages: list[dict[str, Any]] | None
    stream: bool
    exclude_input: bool
    sampling: dict[str, Any]
    return_finish_reason: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    # finish_reason and num_input_tokens only where they say something (outputs.py).
    sparse_outputs: bool = False
    # The stream's own interval in ms (None: the model's stream_interval_ms).
    stream_interval_ms: float | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    # UTF-8 bytes of the prompt, or of all messages' contents.
    prompt_bytes: int = 0
    # The client's request id (Triton's), for the log only: see client_id().
    client_id: str = ""
    # The LoRA adapter the request names (sampling parameter lora_name), checked
    # against the model's adapters by the caller (llmhost.backend.lora).
    lora_name: str | None = None
    # The 'image' input's pictures, base64-decoded (llmhost.backend.images); empty: text only.
    images: list[bytes] = field(default_factory=list)
    # The prompt as token ids (the prompt_token_ids input), used as they are.
    prompt_token_ids: list[int] | None = None
    # The request parameter EMBED: the client wants an embedding, not generated text.
    embed: bool = False
    # The request parameter TOKENIZE or DETOKENIZE (its name): the tokenizer answers, the engine
    # never sees the request.
    tokens: str | None = None
    # A chat's tools (OpenAI's function tools), tool_choice and parallel_tool_calls, as
    # parse_tools checked them; None: not given.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # A chat's chat_template_kwargs, reasoning_effort and include_reasoning (parse_chat_options).
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra arguments as vLLM's server merges them: the client's
        chat_template_kwargs, then reasoning_effort, and enable_thinking (off for effort
        "none") unless the client set it."""
        out = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            out[REASONING_EFFORT] = self.reasoning_effort
            out.setdefault("enable_thinking", self.reasoning_effort != "none")
        return out

    def returns(self) -> frozenset[str]:
        """The additional outputs asked for, as the names of their return_* inputs,
        and SPARSE_OUTPUTS if they are to be sent sparsely."""
        asked = {name for name in RETURN_FLAGS if getattr(self, name)}
        return frozenset(asked | {SPARSE_OUTPUTS} if self.sparse_outputs else asked)


def client_id(raw: object) -> str:
    """A client's request id as the log names it: at most MAX_CLIENT_ID_CHARS
    characters (the client chooses it; the log prints it with repr)."""
    return str(raw or "")[:MAX_CLIENT_ID_CHARS]


def client_label(cid: str) -> str:
    """The client's id as a log line names it, with repr: the client chose it, so no
    control character or line break reaches the log as is."""
    return f"client id {cid!r}" if cid else "no client id"


def _scalar(name: str, value: Any) -> Any:
    """The single element of a [1]-shaped input (numpy array or list)."""
    flat = value.reshape(-1).tolist() if hasattr(value, "reshape") else list(value)
    if len(flat) != 1:
        raise RequestError(f"input '{name}' must hold exactly one element, got {len(flat)}")
    return flat[0]


def _text(name: str, value: Any, max_bytes: int | None = None,
          too_big: Callable[[int], RequestError] | None = None) -> str:
    """The input's string; if it is longer than ``max_bytes``, ``too_big(size)`` is raised
    before it is decoded."""
    item = _scalar(name, value)
    if max_bytes is not None:
        size = len(item) if isinstance(item, (bytes, bytearray)) else len(str(item).encode("utf-8", "replace"))
        if size > max_bytes and too_big is not None:
            raise too_big(size)
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


def token_ids(value: Any) -> list[int]:
    """The prompt_token_ids input: a non-empty list of token ids (integers >= 0)."""
    flat = value.reshape(-1).tolist() if hasattr(value, "reshape") else value
    if not isinstance(flat, list) or not flat:
        raise RequestError(f"input '{PROMPT_TOKEN_IDS}' must be a non-empty list of token ids")
    if len(flat) > MAX_PROMPT_TOKEN_IDS:
        raise RequestError(f"input '{PROMPT_TOKEN_IDS}' holds {len(flat)} ids; at most {MAX_PROMPT_TOKEN_IDS}")
    for i, item in enumerate(flat):
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise RequestError(f"input '{PROMPT_TOKEN_IDS}'[{i}] must be a token id (an integer >= 0), got "
                               f"{str(item)[:40]!r}")
    return flat


def parse_messages(text: str) -> list[dict[str, Any]]:
    messages = jsonguard.loads(text, "input 'messages'")
    if not isinstance(messages, list) or not messages:
        raise RequestError("input 'messages' must be a non-empty JSON list of {\"role\", \"content\"} objects")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"input 'messages' holds {len(messages)} messages; at most {MAX_MESSAGES} are allowed")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content', got {type(msg).__name__}")
        extra = sorted(set(msg) - set(MESSAGE_KEYS))
        if extra:
            raise RequestError(f"messages[{i}] has unknown key(s) {extra}; allowed: {', '.join(MESSAGE_KEYS)}")
        role, content = msg.get("role"), msg.get("content")
        if role not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}")
        if "tool_calls" in msg:
            if role != "assistant":
                raise RequestError(f"messages[{i}].tool_calls belongs to an assistant message, not {role!r}")
            msg["tool_calls"] = _tool_calls(msg["tool_calls"], f"messages[{i}].tool_calls")
        if content is None and msg.get("tool_calls"):
            pass  # an assistant turn that only called tools
        elif isinstance(content, list):
            _content_parts(content, f"messages[{i}].content")
        elif not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of parts, got "
                               f"{type(content).__name__}")
        for key in ("name", "tool_call_id"):
            if key in msg and not isinstance(msg[key], str):
                raise RequestError(f"messages[{i}].{key} must be a string, got {type(msg[key]).__name__}")
        for key in ("content", "name", "tool_call_id"):
            try:
                content_text(msg.get(key)).encode("utf-8")
            except UnicodeEncodeError as exc:
                raise RequestError(f"messages[{i}].{key} is not valid Unicode: a lone surrogate at "
                                   f"position {exc.start}") from None
        out.append({k: v for k, v in msg.items()})
    if all(not content_text(m["content"]).strip() and not m.get("tool_calls") and not image_parts(m["content"])
           for m in out):
        raise RequestError("input 'messages' has no content: every message is empty")
    return out


def _content_parts(parts: list[Any], where: str) -> None:
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise RequestError(f"{at} must be an object with 'type', got {type(part).__name__}")
        kind = part.get("type")
        if kind not in CONTENT_PART_TYPES:
            raise RequestError(f"{at}.type must be one of {list(CONTENT_PART_TYPES)}, got {str(kind)[:32]!r}")
        allowed = {"type", "text"} if kind == "text" else {"type"}
        if extra := sorted(set(part) - allowed):
            raise RequestError(f"{at} has unknown key(s) {extra}; a {kind} part has {sorted(allowed)}")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise RequestError(f"{at}.text must be a string")


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    """A message content's text: the string, or its text parts joined (for sizes and checks)."""
    if isinstance(content, list):
        return "".join(part["text"] for part in content if part.get("type") == "text")
    return content or ""


def image_parts(content: str | list[dict[str, Any]] | None) -> int:
    """How many pictures a message content places (its image parts)."""
    return sum(1 for part in content if part.get("type") == "image") if isinstance(content, list) else 0


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    if not isinstance(value, list):
        raise RequestError(f"{where} must be a list of tool calls")
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or call.get("type", "function") != "function"):
            raise RequestError(f"{where}[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                               f"\"arguments\"}}}}")
        if not isinstance(function.get("arguments", ""), (str, dict)):
            raise RequestError(f"{where}[{j}].function.arguments must be a JSON string")
    return value


def parse_tools(params: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None,
                                                 bool | None]:
    """Take 'tools', 'tool_choice' and 'parallel_tool_calls' (OpenAI's) out of PARAMS,
    checked as vLLM's server checks them: tools are functions with names, a tool_choice
    is "none", "auto", "required" or {"type": "function", "function": {"name"}} naming
    one of the tools, and needs tools unless it is "none"."""
    tools, choice = params.pop(TOOLS, None), params.pop(TOOL_CHOICE, None)
    parallel = _pop_bool(params, PARALLEL_TOOL_CALLS)
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list) or not tools:
            raise RequestError("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
        if len(tools) > MAX_TOOLS:
            raise RequestError(f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS}")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if (not isinstance(function, dict) or tool.get("type", "function") != "function"
                    or not isinstance(function.get("name"), str) or not function["name"]):
                raise RequestError(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
            names.append(function["name"])
    if choice is None or choice == "none":
        return tools, choice, parallel
    if choice in ("auto", "required"):
        pass
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if tools is not None and name not in names:
            raise RequestError(f"'tool_choice.function.name' names {name[:64]!r}, which is not one of 'tools'")
    else:
        raise RequestError(f"'tool_choice' must be \"none\", \"auto\", \"required\" or a named function, "
                           f"got {str(choice)[:40]!r}")
    if tools is None:
        raise RequestError("'tool_choice' needs 'tools'")
    return tools, choice, parallel


def parse_chat_options(params: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None, bool | None]:
    """Take 'chat_template_kwargs' (a JSON object), 'reasoning_effort' (one of vLLM's
    REASONING_EFFORTS) and 'include_reasoning' (a bool) out of PARAMS, checked."""
    kwargs = params.pop(CHAT_TEMPLATE_KWARGS, None)
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError(f"'{CHAT_TEMPLATE_KWARGS}' must be a JSON object of the chat template's arguments")
    effort = params.pop(REASONING_EFFORT, None)
    if effort is not None and effort not in REASONING_EFFORTS:
        raise RequestError(f"'{REASONING_EFFORT}' must be one of {', '.join(REASONING_EFFORTS)}, "
                           f"got {str(effort)[:40]!r}")
    return kwargs, effort, _pop_bool(params, INCLUDE_REASONING)


def _parameters(sampling_json: str | None, request_params: str | dict[str, Any] | None) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    if sampling_json is not None:
        parsed = jsonguard.loads(sampling_json, "input 'sampling_parameters'") if sampling_json.strip() else {}
        if not isinstance(parsed, dict):
            raise RequestError("input 'sampling_parameters' must be a JSON object")
        merged.update(parsed)
    if request_params:
        if isinstance(request_params, str):
            params = jsonguard.loads(request_params, "the request parameters")
            if not isinstance(params, dict):
                raise RequestError("the request parameters must be a JSON object")
        else:
            params = dict(request_params)
        merged.update(params)  # request parameters win over the JSON input
    return merged


def stream_interval(value: Any) -> float:
    """A request's ``stream_interval_ms``: a number (or a numeric string, as request
    parameters may carry it) from 0 to the setting's own bound."""
    limit = MAXIMA[STREAM_INTERVAL]
    expected = f"'{STREAM_INTERVAL}' must be a number of milliseconds from 0 to {limit:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise RequestError(f"{expected}, got {value!r}"[:200])
    try:
        out = float(value.strip()) if isinstance(value, str) else float(value)
    except ValueError:
        raise RequestError(f"{expected}, got {value[:40]!r}") from None
    if not 0 <= out <= limit:  # NaN fails too
        raise RequestError(f"{expected}, got {value!r}"[:200])
    return out


def _pop_bool(params: dict[str, Any], name: str) -> bool | None:
    """Take the boolean request parameter NAME out of PARAMS (None: not given)."""
    if name not in params:
        return None
    value = params.pop(name)
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be true or false, got {value!r}")
    return value


def _parameters_too_big(size: int) -> RequestError:
    return RequestError(f"input 'sampling_parameters' is {size} bytes; at most {MAX_PARAMETERS_BYTES} are allowed")


def _message_bytes(messages: list[dict[str, Any]]) -> int:
    return sum(len(content_text(m["content"]).encode("utf-8", "surrogatepass")) for m in messages)


def parse_request(
    inputs: dict[str, Any],
    request_params: str | dict[str, Any] | None,
    settings: BackendSettings,
    limits: RequestLimits | None = None,
) -> GenerateJob:
    """Validate one request. ``inputs`` maps input names to arrays (absent = missing).
    ``limits`` (from the running engine) adds the prompt's byte limit and max_model_len."""
    has_text = inputs.get(TEXT_INPUT) is not None
    has_messages = inputs.get(MESSAGES) is not None
    has_ids = inputs.get(PROMPT_TOKEN_IDS) is not None
    if has_text + has_messages + has_ids > 1:
        raise RequestError(f"give one of 'text_input', 'messages' and '{PROMPT_TOKEN_IDS}', not several")
    if not has_text and not has_messages and not has_ids:
        raise RequestError("missing input: give 'text_input' (a prompt) or 'messages' (a JSON chat list)")

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    ids: list[int] | None = None
    if has_ids:
        ids = token_ids(inputs[PROMPT_TOKEN_IDS])
        prompt_bytes = 0
    elif has_text:
        if limits is None:
            prompt = _text(TEXT_INPUT, inputs[TEXT_INPUT])
        else:
            prompt = _text(TEXT_INPUT, inputs[TEXT_INPUT], limits.max_prompt_bytes, limits.text_too_big)
        if not prompt.strip():
            raise RequestError("input 'text_input' is empty")
        prompt_bytes = len(prompt.encode("utf-8", "surrogatepass"))
    else:
        if limits is None:
            messages = parse_messages(_text(MESSAGES, inputs[MESSAGES]))
        else:
            messages = parse_messages(_text(MESSAGES, inputs[MESSAGES], limits.messages_json_bytes,
                                            limits.messages_json_too_big))
        prompt_bytes = _message_bytes(messages)
        if limits is not None and prompt_bytes > limits.max_prompt_bytes:
            raise limits.messages_too_big(prompt_bytes)

    flags = {name: _bool(name, inputs[name]) for name in BOOL_INPUTS if inputs.get(name) is not None}
    raw_sampling = inputs.get(SAMPLING_PARAMETERS)
    sampling_json = (_text(SAMPLING_PARAMETERS, raw_sampling, MAX_PARAMETERS_BYTES, _parameters_too_big)
                     if raw_sampling is not None else None)
    params = _parameters(sampling_json, request_params)
    # Boolean switches may also come as request parameters (HTTP generate sends
    # unknown JSON keys that way); inputs win.
    for name in BOOL_INPUTS:
        if (value := _pop_bool(params, name)) is not None:
            flags.setdefault(name, value)
    sparse = _pop_bool(params, SPARSE_OUTPUTS) or False
    embed = _pop_bool(params, EMBED) or False
    asked = [name for name in (TOKENIZE, DETOKENIZE) if _pop_bool(params, name)]
    if len(asked) > 1:
        raise RequestError(f"give '{TOKENIZE}' or '{DETOKENIZE}', not both")
    tokens = asked[0] if asked else None
    if tokens == DETOKENIZE and ids is None:
        raise RequestError(f"'{DETOKENIZE}' needs the token ids in '{PROMPT_TOKEN_IDS}'")
    if tokens == TOKENIZE and ids is not None:
        raise RequestError(f"'{TOKENIZE}' needs 'text_input' or 'messages', not '{PROMPT_TOKEN_IDS}'")
    interval = stream_interval(params.pop(STREAM_INTERVAL)) if STREAM_INTERVAL in params else None
    stream = flags.get(STREAM, False)
    if stream and flags.get(EXCLUDE_INPUT) is False:
        # vllm_backend's rule: a stream never carries the prompt, so asking for it is an error.
        raise RequestError(f"input '{EXCLUDE_INPUT}' cannot be false when streaming: a stream's responses "
                           "carry only generated text; leave it out or set it true")
    lora_name = request_lora_name(params)
    tools, tool_choice, parallel = parse_tools(params)
    if (tools is not None or parallel is not None) and messages is None:
        raise RequestError("'tools' are for a chat: give 'messages', not a prompt")
    template_kwargs, effort, include_reasoning = parse_chat_options(params)
    if messages is None and (asked := next((name for name, value in (
            (CHAT_TEMPLATE_KWARGS, template_kwargs), (REASONING_EFFORT, effort),
            (INCLUDE_REASONING, include_reasoning)) if value is not None), None)):
        raise RequestError(f"'{asked}' is for a chat: give 'messages', not a prompt")
    images = parse_images(inputs[IMAGE]) if inputs.get(IMAGE) is not None else []
    placed = sum(image_parts(m["content"]) for m in messages or ())
    if placed and placed != len(images):
        raise RequestError(f"input 'messages' places {placed} picture(s) (image parts) and input '{IMAGE}' holds "
                           f"{len(images)}: give one picture per image part, in order")
    sampling = validate_sampling(params, settings, limits.max_model_len if limits is not None else None)
    return GenerateJob(
        prompt=prompt,
        messages=messages,
        stream=stream,
        # A chat or token ids have no prompt text of their own to put before the output.
        exclude_input=(flags.get(EXCLUDE_INPUT, settings.exclude_input_in_output) or messages is not None
                       or ids is not None),
        sampling=sampling,
        **{name: flags.get(name, False) for name in RETURN_FLAGS},
        sparse_outputs=sparse,
        stream_interval_ms=interval,
        prompt_bytes=prompt_bytes,
        lora_name=lora_name,
        images=images,
        prompt_token_ids=ids,
        embed=embed,
        tokens=tokens,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=template_kwargs,
        reasoning_effort=effort,
        include_reasoning=include_reasoning is not False,
    )
