"""Prompts become token ids on worker threads, never on the engine's event loop.

Tokenizing a prompt takes time in proportion to its size (seconds for megabytes);
on the one asyncio loop that runs vLLM's engine it would stall every other request.
``PromptEncoder`` renders chat templates and tokenizes on a small pool of daemon
threads (Hugging Face's fast tokenizers release the GIL while they encode), each
with its own copy of the tokenizer (a tokenizer is not safe to share between
threads). Prompts over ``LARGE_PROMPT_BYTES`` take at most all but one of the
threads, so a burst of huge prompts leaves a thread for everyone else.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from llmhost.backend.errors import RequestError, safe_message
from llmhost.backend.images import open_images
from llmhost.backend.request import GenerateJob

T = TypeVar("T")
LARGE_PROMPT_BYTES = 64 * 1024
UTF8_MAX_BYTES = 4


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest token (vLLM computes it on loading)."""
    try:
        return max(int(tokenizer.max_chars_per_token), 1)
    except Exception:  # noqa: BLE001 - a tokenizer without vLLM's property: be generous
        return 64


def derived_prompt_bytes(max_model_len: int, longest_token: int) -> int:
    """The default byte limit: no prompt that fits ``max_model_len`` tokens is longer.

    vLLM's own server refuses a prompt longer than max_model_len x the longest
    token's characters before tokenizing it (a token never stands for more
    characters than that); a character takes at most 4 bytes in UTF-8.
    """
    return max_model_len * longest_token * UTF8_MAX_BYTES


# apply_chat_template's own arguments that a client's chat_template_kwargs may not set:
# the prompt is always text, rendered for generation, with the request's tools.
_CALL_ARGUMENTS = frozenset({"conversation", "tools", "tokenize", "padding", "truncation", "max_length",
                             "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
                             "add_generation_prompt", "continue_final_message"})


def vllm_chat_utils() -> Any:
    """vLLM's chat utilities: ``vllm.renderers.chat_utils``, or
    ``vllm.entrypoints.chat_utils`` where releases before the renderers (0.20) keep them."""
    try:
        from vllm.renderers import chat_utils
    except ImportError:
        from vllm.entrypoints import chat_utils  # type: ignore[no-redef]
    return chat_utils


def template_kwargs(tokenizer: Any, job: GenerateJob) -> dict[str, Any]:
    """The job's extra chat template arguments (GenerateJob.template_kwargs) as vLLM's
    server passes them on: those the template or apply_chat_template knows (vLLM's
    resolve_chat_template_kwargs; 'chat_template' and 'tokenize' are refused)."""
    asked = job.template_kwargs()
    if not asked:
        return {}
    from vllm.renderers.hf import resolve_chat_template_kwargs

    template = tokenizer.chat_template
    if not isinstance(template, str):
        template = tokenizer.get_chat_template()
    try:
        known = resolve_chat_template_kwargs(tokenizer, template, asked)
    except ValueError as exc:
        raise RequestError(safe_message(f"'chat_template_kwargs': {exc}")) from None
    return {k: v for k, v in known.items() if k not in _CALL_ARGUMENTS}


@dataclass(frozen=True)
class ContentRendering:
    """How a chat's contents given as parts reach the model's template, as vLLM's server
    renders them: ``openai`` templates take the parts themselves (text, and an image
    part per picture); ``string`` templates take one text, the parts' texts joined by
    newlines, with the model's image placeholder (e.g. LLaVA's ``<image>``) put first
    for each picture the text does not already hold. PLACEHOLDER gives the i-th picture's
    placeholder (1-based over the chat), None where the model needs none."""

    content_format: str = "string"
    placeholder: Callable[[int], str | None] | None = None


def content_rendering(tokenizer: Any, model_config: Any, multimodal: bool) -> ContentRendering:
    """The model's ContentRendering as vLLM's server finds it: the content format its chat
    template takes (vLLM's detection, "string" where it cannot tell) and, for a model that
    takes images, the model class's image placeholder."""
    from vllm.renderers.hf import resolve_chat_template_content_format

    try:
        content_format = str(resolve_chat_template_content_format(None, None, "auto", tokenizer,
                                                                  model_config=model_config))
    except Exception:  # noqa: BLE001 - no chat template to read (a model for prompts only)
        content_format = "string"
    if not multimodal:
        return ContentRendering(content_format)
    from vllm.model_executor.model_loader import get_model_cls

    model_cls = get_model_cls(model_config)
    return ContentRendering(content_format, lambda i: model_cls.get_placeholder_str("image", i))


def render_contents(messages: list[dict[str, Any]],
                    find_rendering: Callable[[], ContentRendering]) -> list[dict[str, Any]]:
    """MESSAGES with each content given as parts rendered as FIND_RENDERING's answer says
    (vLLM's own placement of the placeholders), asked only when a content has parts;
    messages with string contents are kept as they are."""
    if not any(isinstance(m.get("content"), list) for m in messages):
        return messages
    rendering = find_rendering()
    full_text_prompt = vllm_chat_utils()._get_full_multimodal_text_prompt
    out: list[dict[str, Any]] = []
    seen = 0
    for m in messages:
        parts = m.get("content")
        if not isinstance(parts, list):
            out.append(m)
            continue
        holders: list[str] = []
        for part in parts:
            if part["type"] == "image":
                seen += 1
                if rendering.placeholder is not None and (holder := rendering.placeholder(seen)) is not None:
                    holders.append(holder)
        if rendering.content_format == "openai":
            out.append({**m, "content": [dict(part) for part in parts]})
            continue
        texts = [part["text"] for part in parts if part["type"] == "text"]
        try:
            text = (full_text_prompt({"image": holders}, texts, interleave_strings=False)
                    if holders else "\n".join(texts))
        except Exception as exc:  # noqa: BLE001 - vLLM's VLLMValidationError: more placeholders than pictures
            raise RequestError(safe_message(f"'messages': {exc}")) from None
        out.append({**m, "content": text})
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """MESSAGES as chat templates take them: an assistant's tool call arguments as objects,
    not JSON text (vLLM's own conversion, on a copy)."""
    if not any(m.get("tool_calls") for m in messages):
        return messages
    out = copy.deepcopy(messages)
    vllm_chat_utils()._postprocess_messages(out)
    return out


class WorkerPool:
    """``threads`` daemon threads running blocking calls for an asyncio loop."""

    def __init__(self, threads: int, name: str) -> None:
        self._work: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]]
                                      | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            fn, loop, fut = item
            if fut.cancelled():  # the client left while this waited
                continue
            try:
                result: Any = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, fut, result, None)

    async def run(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._work.put((fn, loop, fut))
        return await fut

    def close(self) -> None:
        for _ in self._threads:
            self._work.put(None)


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class PromptEncoder:
    """Token ids for a job's prompt or messages, computed on the worker pool."""

    def __init__(self, tokenizer: Any, max_model_len: int, threads: int,
                 rendering: Callable[[], ContentRendering] | None = None) -> None:
        self.max_model_len = max_model_len
        # Found on the first chat with contents given as parts (vLLM reads the model's
        # chat template and class for it), not while the model loads.
        self._find_rendering = rendering or ContentRendering
        self._rendering: ContentRendering | None = None
        self._rendering_lock = threading.Lock()
        self._original = tokenizer
        self._local = threading.local()
        self._pool = WorkerPool(threads, "llmhost-tokenize")
        self._large = asyncio.Semaphore(max(1, threads - 1))

    async def encode(self, job: GenerateJob) -> list[int]:
        if job.prompt_token_ids is not None:
            return self._given_ids(job.prompt_token_ids)
        if job.prompt_bytes > LARGE_PROMPT_BYTES:
            async with self._large:
                return await self._pool.run(lambda: self._encode(job))
        return await self._pool.run(lambda: self._encode(job))

    async def images(self, blobs: list[bytes]) -> list[Any]:
        """The 'image' input's pictures opened (Pillow, RGB) on the worker pool."""
        return await self._pool.run(lambda: open_images(blobs))

    def rendering(self) -> ContentRendering:
        """How contents given as parts reach the chat template, found once."""
        with self._rendering_lock:
            if self._rendering is None:
                self._rendering = self._find_rendering()
            return self._rendering

    def close(self) -> None:
        self._pool.close()

    def _tokenizer(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self._original)
        return tok

    def _given_ids(self, ids: list[int]) -> list[int]:
        """A prompt given as token ids: each in the vocabulary, leaving room for output."""
        vocab = len(self._original)
        if (top := max(ids)) >= vocab:
            raise RequestError(f"input 'prompt_token_ids' holds token id {top}; the model's vocabulary has "
                               f"{vocab} tokens (0-{vocab - 1})")
        self._check_length(len(ids))
        return ids

    def _check_length(self, n: int) -> None:
        if n >= self.max_model_len:
            raise RequestError(
                f"prompt is {n} tokens; the model's max_model_len is {self.max_model_len} "
                f"(the prompt must leave room for at least one output token)"
            )

    def _encode(self, job: GenerateJob) -> list[int]:
        tok = self._tokenizer()
        if job.messages is not None:
            try:
                tools = {"tools": job.tools} if job.tools else {}
                extra = template_kwargs(tok, job)
                messages = template_messages(render_contents(job.messages, self.rendering))
                text = tok.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True, **tools, **extra)
            except RequestError:
                raise
            except Exception as exc:  # noqa: BLE001 - the template itself can reject a conversation
                raise RequestError(safe_message(f"the model's chat template rejected 'messages': {exc}")) from None
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(job.prompt, add_special_tokens=True)
        if not ids:
            raise RequestError("the prompt encodes to no tokens")
        self._check_length(len(ids))
        return list(ids)
