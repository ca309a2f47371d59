"""An OpenAI request -> our backend's inputs and sampling parameters."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from llmhost.gateway.doors.openai.images import MAX_IMAGES, image_part
from llmhost.gateway.doors.openai.request_models import (
    MAX_EMBEDDING_INPUTS,
    REFUSED,
    TOKENIZE_DEFAULTS,
    UNSUPPORTED_COMMON,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    NamedToolChoice,
    ResponseFormat,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from llmhost.gateway.errors import invalid, unsupported
from llmhost.gateway.upstreams.request import BackendRequest, RemoteImage

M = TypeVar("M", bound=BaseModel)

# Sampling fields passed to the backend under the same name when given.
PASSED = ("temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
          "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
          "skip_special_tokens", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "logit_bias", "bad_words", "allowed_token_ids", "spaces_between_special_tokens")
# Chat fields passed to the backend under the same name when given (vLLM's).
CHAT_PASSED = ("chat_template_kwargs", "reasoning_effort", "include_reasoning")
# vLLM's ways to ask for structured output besides response_format.
STRUCTURED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


# The most prompts one completions request may hold (each becomes a request upstream).
MAX_PROMPTS = 256

# Names pydantic puts into an error's location for the member of a union.
_UNION_TAGS = frozenset({"str", "list[str]", "list[dict[str,any]]", "list[int]", "list[list[int]]", "dict[str,any]",
                         "literal['none','auto','required']", "NamedToolChoice"})


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _validation_error(exc: ValidationError, within: tuple[str, ...] = ()) -> Exception:
    err = exc.errors(include_url=False)[0]
    loc = within + tuple(p for p in err["loc"] if p not in _UNION_TAGS)
    param = _param(loc) or None
    if err["type"] == "extra_forbidden":
        return unsupported(param or "?", REFUSED.get(param or "", "is not a known field"))
    if err["type"] == "missing":
        return invalid(f"missing required field '{param}'", param, "missing_required_parameter")
    return invalid(f"invalid value for '{param}': {err['msg']}", param, "invalid_value")


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in UNSUPPORTED_COMMON:
        if name in body and body[name] not in (None, False):
            raise unsupported(name, REFUSED[name])


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise invalid("the request body is not valid JSON", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_json")
    return body


def parse_embeddings(raw: bytes) -> tuple[EmbeddingRequest, list[str | list[int]]]:
    """A /v1/embeddings body, checked, and its inputs one by one (texts or token ids)."""
    body = _json_object(raw)
    if body.get("dimensions") is not None:
        raise unsupported("dimensions", "is not served: the model's own size is returned")
    body = {k: v for k, v in body.items() if k != "dimensions"}
    try:
        req = EmbeddingRequest.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    value = req.input
    items: list[str | list[int]]
    if isinstance(value, str):
        items = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [list(value)]  # type: ignore[arg-type]
    else:
        items = list(value)  # type: ignore[arg-type]
    if not items:
        raise invalid("'input' is empty: give a text, a list of texts or token ids", "input")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise invalid(f"'input' holds {len(items)} items; at most {MAX_EMBEDDING_INPUTS} in one request", "input")
    for i, item in enumerate(items):
        if (isinstance(item, str) and not item.strip()) or (isinstance(item, list) and not item):
            param = "input" if isinstance(value, str) else f"input[{i}]"
            raise invalid(f"'{param}' is empty", param)
    return req, items


def parse_body(raw: bytes, chat: bool) -> ChatCompletionRequest | CompletionRequest:
    body = _json_object(raw)
    _refuse_unsupported(body)
    if chat and body.get("echo") not in (None, False):
        raise unsupported("echo", "is served on /v1/completions")
    body = {k: v for k, v in body.items() if not (chat and k == "echo")}
    body = {k: v for k, v in body.items() if not (k in UNSUPPORTED_COMMON and v in (None, False))}
    if chat and isinstance(body.get("tool_choice"), dict):
        # A named function: its own errors, not those of the union's string choices.
        try:
            NamedToolChoice.model_validate(body["tool_choice"])
        except ValidationError as exc:
            raise _validation_error(exc, ("tool_choice",)) from None
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _structured(fmt: ResponseFormat | None) -> dict[str, Any]:
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise invalid("'response_format.json_schema' needs type 'json_schema'", "response_format.type")
        return {}
    if fmt.type == "json_object":
        return {"json_schema": {"type": "object"}}
    if fmt.json_schema is None:
        raise invalid("response_format of type 'json_schema' needs a 'json_schema' object",
                      "response_format.json_schema", "missing_required_parameter")
    return {"json_schema": fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {"type": "object"}}


def _max_tokens(req: ChatCompletionRequest | CompletionRequest, cap: int | None) -> int | None:
    """The requested max_tokens, refused above the key's cap; the cap when none is asked.
    A chat's max_completion_tokens wins over max_tokens, as in vLLM's server."""
    asked, name = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        asked, name = req.max_completion_tokens, "max_completion_tokens"
    if cap is not None and asked is not None and asked > cap:
        raise invalid(f"'{name}' is {asked}; this API key may ask for at most {cap}", name, "max_tokens_above_cap")
    return asked if asked is not None else cap


def _logprobs(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A completions prompt as a list of prompts, each a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    flat = bool(prompt) and isinstance(prompt[0], int)
    if flat:
        prompt = [prompt]  # one prompt of token ids
    if not prompt:
        raise invalid("'prompt' holds no prompt", "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise invalid(f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} are served at once", "prompt")
    for i, one in enumerate(prompt):
        if isinstance(one, list):
            if not one:
                raise invalid(f"'prompt[{i}]' holds no token ids", f"prompt[{i}]")
            if (bad := next((j for j, t in enumerate(one) if not 0 <= t < 1 << 63), None)) is not None:
                where = f"prompt[{bad}]" if flat else f"prompt[{i}][{bad}]"
                raise invalid(f"'{where}' is not a token id (an integer >= 0)", where)
    return list(prompt)


def _content(content: str | list[Any] | None, where: str,
             images: list[str | RemoteImage]) -> str | list[dict[str, str]]:
    """A message's content for the backend: its text, or its parts (text, and an image
    part where each picture goes, which the backend renders as vLLM's server does); the
    image_url parts' pictures go to IMAGES, in order."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type")
        if kind == "text":
            if sorted(set(part) - {"type", "text"}):
                raise unsupported(f"{at}.{sorted(set(part) - {'type', 'text'})[0]}", "is not a known field")
            if not isinstance(part.get("text"), str):
                raise invalid(f"'{at}.text' must be a string", f"{at}.text")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            if len(images) >= MAX_IMAGES:
                raise invalid(f"'{at}' is one image too many: at most {MAX_IMAGES} in one request", at)
            images.append(image_part(part, at))
            parts.append({"type": "image"})
        elif isinstance(kind, str) and kind:
            raise unsupported(f"{at}.type", f"is {kind[:32]!r}; served content parts: text, image_url")
        else:
            raise invalid(f"missing required field '{at}.type'", f"{at}.type", "missing_required_parameter")
    return parts or ""  # no parts: an empty text, as vLLM's server reads it


def message_text(content: str | list[dict[str, str]] | None) -> str:
    """A backend message content's text: the string, or its text parts."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content)
    return content or ""


def _message(m: ChatMessage, i: int, images: list[str | RemoteImage]) -> dict[str, Any]:
    """One chat message as the backend takes it (an assistant's tool calls with it)."""
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise invalid(f"'messages[{i}].content' is null; only an assistant message with tool_calls may "
                      "leave it out", f"messages[{i}].content")
    if m.tool_calls is not None and m.role != "assistant":
        raise invalid(f"'messages[{i}].tool_calls' belongs to an assistant message", f"messages[{i}].tool_calls")
    msg: dict[str, Any] = {"role": m.role, "content": _content(m.content, f"messages[{i}].content", images)}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_calls:
        msg["tool_calls"] = [call.model_dump(exclude_none=True) for call in m.tool_calls]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _tools(req: ChatCompletionRequest) -> dict[str, Any]:
    """The backend's tool fields (llmhost.backend.request.parse_tools), checked as vLLM's
    server checks them: a tool_choice other than "none" needs tools, and a named one
    must name one of them."""
    out: dict[str, Any] = {}
    choice = req.tool_choice
    if req.tools is not None:
        if not req.tools:
            raise invalid("'tools' is empty: give at least one tool or leave the field out", "tools")
        out["tools"] = [tool.model_dump(exclude_none=True) for tool in req.tools]
    if choice is not None and choice != "none" and req.tools is None:
        raise invalid("'tool_choice' needs 'tools'", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = [tool.function.name for tool in req.tools or ()]
        if choice.function.name not in names:
            raise invalid(f"'tool_choice.function.name' is {choice.function.name[:64]!r}, which is not one of "
                          "'tools'", "tool_choice.function.name")
        out["tool_choice"] = choice.model_dump()
    elif choice is not None:
        out["tool_choice"] = choice
    if req.parallel_tool_calls is not None and req.tools is not None:
        out["parallel_tool_calls"] = req.parallel_tool_calls
    return out


def to_backend(req: ChatCompletionRequest | CompletionRequest, cap: int | None = None) -> BackendRequest:
    chat = isinstance(req, ChatCompletionRequest)
    sampling: dict[str, Any] = {}
    for name in PASSED:
        value = getattr(req, name)
        if value is not None:
            sampling[name] = value
    if req.stop is not None:
        sampling["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    max_tokens = _max_tokens(req, cap)
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    fmt = _structured(req.response_format)
    if fmt and (also := next((name for name in STRUCTURED if name in sampling), None)):
        raise invalid(f"give response_format or '{also}', not both", also)
    sampling.update(fmt)
    if req.stream_options is not None and not req.stream:
        raise invalid("'stream_options' is only allowed with stream: true", "stream_options")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous_usage = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
    logprobs = _logprobs(req)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    if req.prompt_logprobs is not None:
        if req.stream:
            raise invalid("'prompt_logprobs' are not available when streaming (stream: true)", "prompt_logprobs")
        sampling["prompt_logprobs"] = req.prompt_logprobs
    text_input = messages = None
    prompt_token_ids: list[int] | None = None
    batch: list[str | list[int]] = []
    images: list[str | RemoteImage] = []
    if isinstance(req, ChatCompletionRequest):
        messages = [_message(m, i, images) for i, m in enumerate(req.messages)]
        sampling.update(_tools(req))
        sampling.update({name: getattr(req, name) for name in CHAT_PASSED if getattr(req, name) is not None})
    else:
        prompts = _prompts(req.prompt)
        if req.echo and (len(prompts) > 1 or isinstance(prompts[0], list)):
            raise unsupported("echo", "needs one prompt given as text")
        if req.echo and logprobs is not None:
            # As vLLM's server: the prompt's tokens come first in logprobs, from the
            # prompt's log probabilities (the same top k).
            if req.stream:
                raise unsupported("echo", "with 'logprobs' is served without stream")
            sampling.setdefault("prompt_logprobs", logprobs)
        if len(prompts) > 1 and req.prompt_logprobs is not None:
            raise invalid("'prompt_logprobs' needs one prompt", "prompt_logprobs")
        if len(prompts) > 1:
            batch = prompts
        elif isinstance(prompts[0], list):
            prompt_token_ids = prompts[0]
        else:
            text_input = prompts[0]
    return BackendRequest(model=req.model, text_input=text_input, messages=messages, sampling=sampling,
                          stream=bool(req.stream), n=req.n or 1, include_usage=include_usage, chat=chat,
                          user=req.user, logprobs=logprobs,
                          echo=text_input if isinstance(req, CompletionRequest) and req.echo else None,
                          prompt_token_ids=prompt_token_ids, batch=batch,
                          prompt_logprobs=req.prompt_logprobs is not None, images=images,
                          continuous_usage=continuous_usage)


def _validated(body: dict[str, Any], model: type[M]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def parse_tokenize(raw: bytes) -> tuple[BackendRequest, bool]:
    """A /tokenize body (a prompt, or a chat's messages) -> the backend request that asks
    its tokenizer alone, and whether the token strings were asked for."""
    body = _json_object(raw)
    chat = "messages" in body
    req: TokenizeChatRequest | TokenizeCompletionRequest = _validated(
        body, TokenizeChatRequest if chat else TokenizeCompletionRequest)
    for name, defaults in TOKENIZE_DEFAULTS.items():
        value, default = getattr(req, name, None), defaults[1 if chat else 0]
        if value is not None and value != default:
            raise unsupported(name, f"is served at vLLM's default only ({str(default).lower()}), as a "
                                    "generation request's prompt is tokenized")
    sampling: dict[str, Any] = {}
    messages = text_input = None
    if isinstance(req, TokenizeCompletionRequest):
        text_input = req.prompt
    else:
        images: list[str | RemoteImage] = []
        messages = [_message(m, i, images) for i, m in enumerate(req.messages)]
        if images:
            raise unsupported("messages", "with images is not tokenized here: send text parts")
        if req.tools:
            # The tools reach the chat template, as in a chat that calls none.
            sampling.update(tools=[tool.model_dump(exclude_none=True) for tool in req.tools], tool_choice="none")
        if req.chat_template_kwargs is not None:
            sampling["chat_template_kwargs"] = req.chat_template_kwargs
    out = BackendRequest(model=req.model, text_input=text_input, messages=messages, sampling=sampling,
                         stream=False, n=1, include_usage=False, chat=chat, tokens="tokenize")
    return out, bool(req.return_token_strs)


def parse_detokenize(raw: bytes) -> BackendRequest:
    """A /detokenize body -> the backend request that asks its tokenizer for the text of the ids."""
    req = _validated(_json_object(raw), DetokenizeRequest)
    return BackendRequest(model=req.model, text_input=None, messages=None, sampling={}, stream=False, n=1,
                          include_usage=False, chat=False, prompt_token_ids=list(req.tokens), tokens="detokenize")
