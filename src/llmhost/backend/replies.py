"""A chat's output as vLLM's OpenAI server makes it: reasoning, content and tool calls
found by vLLM's own parsers (``vllm.parser.ParserManager``: the model's ``tool_parser``
setting and vLLM's ``reasoning_parser`` engine argument).

``ChatParsing`` is made once per engine; ``parse_chat`` gives one request its
``Replies``: vLLM's ``ChatCompletionRequest`` for the chat (vLLM's checks of tools and
tool_choice), the structured output a forced tool choice needs (the tool parser's
``adjust_request``), and one parser per completion, which turns the engine's text and
token ids into vLLM's messages: a whole ``message`` for a request not streamed, and
``delta`` objects for a stream. Each is sent as plain JSON (the ``message`` output,
llmhost.backend.outputs), as vLLM's server would put it into its answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmhost.backend.errors import RequestError, safe_message
from llmhost.backend.prompts import vllm_chat_utils
from llmhost.backend.request import GenerateJob, content_text

# The served model name vLLM's request object needs; nothing reads it here.
_MODEL = "llmhost"


def _message_of(exc: Exception) -> str:
    """vLLM's validation error as one line: pydantic's first error, or the message."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        except Exception:  # noqa: BLE001 - fall back to the exception's text
            pass
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class ChatParsing:
    """The model's parser class (vLLM's ParserManager), or None when it has neither
    a tool parser nor a reasoning parser."""

    def __init__(self, tokenizer: Any, model_config: Any, tool_parser: str, reasoning_parser: str) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.parser_cls: Any = None
        if not tool_parser and not reasoning_parser:
            return  # plain text only: no parser (and none of vLLM's parser API is needed)
        from vllm.parser import ParserManager

        try:
            self.parser_cls = ParserManager.get_parser(
                tool_parser_name=tool_parser or None, reasoning_parser_name=reasoning_parser or None,
                enable_auto_tools=bool(tool_parser), tokenizer=tokenizer)
        except (TypeError, KeyError) as exc:
            raise ValueError(f"model.json: llmhost.tool_parser {tool_parser!r} / reasoning_parser "
                             f"{reasoning_parser!r}: {exc}") from None

    def replies(self, job: GenerateJob, n: int) -> Replies | None:
        """The job's Replies, or None where its output is plain text: not a chat, or a
        chat with neither tools nor a reasoning parser. Raises RequestError for tools
        this model cannot serve. Sets the job's tools to vLLM's form of them."""
        if job.messages is None or (job.tools is None and job.tool_choice is None and not self.reasoning_parser):
            return None  # plain text: no parser reads it, nothing to check (the common case, kept cheap)
        request = self._request(job)
        if request.tools:
            # The tools as vLLM's server hands them to the chat template (every field).
            job.tools = [tool.model_dump() for tool in request.tools]
        if self.parser_cls is None or (job.tools is None and not self.reasoning_parser):
            if request.tool_choice not in (None, "none"):
                raise RequestError(self._no_tool_parser(request.tool_choice))
            return None
        if not self.tool_parser and request.tool_choice not in (None, "none"):
            raise RequestError(self._no_tool_parser(request.tool_choice))
        return Replies(self, request, n)

    @staticmethod
    def _no_tool_parser(choice: Any) -> str:
        named = getattr(getattr(choice, "function", None), "name", None)
        shown = f"a named function ({named!r})" if named else repr(choice)
        return (f"'tool_choice' {shown} needs a tool parser, and this model has none: set its tool_parser "
                f"(vLLM's --tool-call-parser) in the model's settings, or send tool_choice \"none\"")

    def _request(self, job: GenerateJob) -> Any:
        """vLLM's ChatCompletionRequest for the job's chat, tools and structured output."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        # The parsers read the tools and switches, not the contents: parts as their text.
        messages = [{**m, "content": content_text(m["content"])} if isinstance(m.get("content"), list) else m
                    for m in job.messages or ()]
        body: dict[str, Any] = {"model": _MODEL, "messages": messages}
        if job.tools is not None:
            body["tools"] = job.tools
        if job.tool_choice is not None:
            body["tool_choice"] = job.tool_choice
        if job.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = job.parallel_tool_calls
        if job.reasoning_effort is not None:
            body["reasoning_effort"] = job.reasoning_effort
        if not job.include_reasoning:
            body["include_reasoning"] = False
        structured = job.sampling.get("structured_outputs")
        if structured is not None:
            body["structured_outputs"] = structured
        try:
            return ChatCompletionRequest.model_validate(body)
        except Exception as exc:  # noqa: BLE001 - vLLM's validation of the chat: the client's error
            raise RequestError(safe_message(f"invalid chat request: {_message_of(exc)}")) from None


@dataclass
class _Choice:
    """One completion's parser and what it has streamed."""

    parser: Any
    tools_streamed: bool = False
    text: str = ""
    token_ids: list[int] = field(default_factory=list)


class Replies:
    """One chat request's parsers (one per completion), as vLLM's serving_chat uses them."""

    def __init__(self, parsing: ChatParsing, request: Any, n: int) -> None:
        self.parsing = parsing
        self.request = request
        self.prompt_ids: list[int] = []
        choice = request.tool_choice
        self.named = getattr(getattr(choice, "function", None), "name", None)
        self.required = choice == "required"
        self.choices = [_Choice(self._parser()) for _ in range(n)]

    def _parser(self) -> Any:
        return self.parsing.parser_cls(self.parsing.tokenizer, self.request.tools,  # type: ignore[misc]
                                       model_config=self.parsing.model_config)

    def adjust(self, prompt_ids: list[int]) -> dict[str, Any]:
        """The sampling parameters the parsers set for this request, as vLLM's server
        sets them after rendering the chat: the structured output of a forced tool
        choice (a JSON schema of the tools, or the tool parser's structural tag) and
        skip_special_tokens. Also the engine's reasoning_ended for structured output."""
        self.prompt_ids = list(prompt_ids)
        changes: dict[str, Any] = {}
        request = self.request
        before = request.structured_outputs
        if self.parsing.reasoning_parser or request.tool_choice != "none":
            request = self.request = self._parser().adjust_request(request)
        if request.structured_outputs is not before:
            changes["structured_outputs"] = request.structured_outputs
        if not request.skip_special_tokens:
            changes["skip_special_tokens"] = False
        for one in self.choices:
            one.parser.set_prompt_token_ids(self.prompt_ids)
        return changes

    def reasoning_ended(self) -> bool | None:
        """vLLM's reasoning_ended for the engine, after adjust: whether the thinking is
        over before the first output token (structured output applies from there); None:
        the engine reads the prompt with its own reasoning parser."""
        ended: bool | None = self.request.resolve_reasoning_ended(self.choices[0].parser, self.prompt_ids)
        return ended

    def delta(self, i: int, text: str, token_ids: list[int], finished: bool) -> dict[str, Any] | None:
        """Completion I's streamed delta for TEXT and TOKEN_IDS (vLLM's DeltaMessage as
        JSON), or None where the parser holds it back (tool-call markup)."""
        from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

        one = self.choices[i]
        if not text and not token_ids and not one.token_ids:
            return None
        one.token_ids += token_ids
        message = one.parser.parse_delta(delta_text=text, delta_token_ids=list(token_ids), request=self.request,
                                         prompt_token_ids=self.prompt_ids, finished=finished)
        if message is None:
            return None
        message = maybe_filter_parallel_tool_calls(message, self.request)
        if message.tool_calls:
            one.tools_streamed = True
        said = message.model_dump(exclude_unset=True, exclude_none=True)
        if not self.request.include_reasoning:  # as vLLM's server: the thinking is not sent
            said.pop("reasoning", None)
            if not said.get("content") and not said.get("tool_calls"):
                return None
        return _with_reasoning_content(said)

    def stream_finish(self, i: int, reason: str) -> str:
        """A streamed completion's finish reason as vLLM's server gives it: "tool_calls"
        once it streamed tool calls (auto or required), unless it stopped otherwise."""
        if self.choices[i].tools_streamed and not self.named and reason == "stop":
            return "tool_calls"
        return reason

    def message(self, i: int, text: str, token_ids: list[int], reason: str) -> tuple[dict[str, Any], str]:
        """Completion I's whole message (content, reasoning, tool_calls) and finish
        reason, as vLLM's server answers a request not streamed."""
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.entrypoints.openai.chat_completion.protocol import ChatMessage
        from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

        new_id = vllm_chat_utils().make_tool_call_id
        reasoning, content, calls = self.choices[i].parser.parse(
            text, self.request, enable_auto_tools=bool(self.parsing.tool_parser), model_output_token_ids=token_ids)
        if not self.request.include_reasoning:
            reasoning = None
        auto = self.request.tools and self.request.tool_choice in ("auto", None) and self.parsing.tool_parser
        tool_calls: list[Any] = []
        if self.named or self.required:
            content = content or ""
            tool_calls = [ToolCall(id=tc.id or new_id(), function=tc) for tc in calls or []]
        elif auto and calls:
            tool_calls = [ToolCall(id=tc.id or new_id(), function=tc) for tc in calls]
        message = ChatMessage(role="assistant", reasoning=reasoning, content=content, tool_calls=tool_calls)
        message.tool_calls = maybe_filter_parallel_tool_calls(message.tool_calls, self.request)
        if (auto and calls) or (self.required and reason == "stop"):
            reason = "tool_calls"
        out = message.model_dump()
        return _with_reasoning_content({k: v for k, v in out.items() if v is not None or k == "content"}), reason


def _with_reasoning_content(message: dict[str, Any]) -> dict[str, Any]:
    """MESSAGE with its reasoning also under ``reasoning_content``, the name vLLM's
    server used before ``reasoning`` and many clients still read."""
    if message.get("reasoning") is not None:
        message["reasoning_content"] = message["reasoning"]
    return message
