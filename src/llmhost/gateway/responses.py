"""OpenAI's response bodies and streamed chunks (``chat.completion``,
``chat.completion.chunk``, ``text_completion``), built from backend pieces."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from llmhost.gateway.errors import ApiError
from llmhost.gateway.mapping import BackendRequest
from llmhost.gateway.upstream import Piece

DONE = b"data: [DONE]\n\n"


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


# One encoder for every event: json.dumps with separators builds a new one per call.
_encode = json.JSONEncoder(separators=(",", ":")).encode


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encode(obj).encode() + b"\n\n"


def _envelope(empty_chunk: dict[str, Any]) -> tuple[bytes, bytes]:
    """The SSE bytes of EMPTY_CHUNK (a chunk with no choices) before and after its
    choices: a request's chunks differ only in their choices, so the rest is encoded
    once per request, not once per token. (`"choices":[]` cannot occur inside an
    encoded string, whose quotes are escaped.)"""
    head, tail = _encode(empty_chunk).split('"choices":[]')
    return b"data: " + head.encode() + b'"choices":', tail.encode() + b"\n\n"


# The backend's finish_reason for a completion still running (vllm_backend's str(None)).
UNFINISHED = "None"


def _finish(reasons: list[str], i: int) -> str | None:
    reason = reasons[i] if i < len(reasons) else ""
    return reason if reason and reason != UNFINISHED else None


def usage(num_input: int | None, num_output: list[int]) -> dict[str, int]:
    prompt, completion = int(num_input or 0), int(sum(num_output))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Accumulator:
    """Whole completions from a non-streamed (or streamed) sequence of pieces."""

    def __init__(self, n: int) -> None:
        self.texts = [""] * n
        self.reasons: list[str | None] = [None] * n
        self.num_input: int | None = None
        self.num_output = [0] * n

    def add(self, piece: Piece) -> None:
        for i, text in enumerate(piece.texts[:len(self.texts)]):
            self.texts[i] += text
            self.reasons[i] = _finish(piece.finish_reasons, i) or self.reasons[i]
        if piece.num_input_tokens is not None:
            self.num_input = piece.num_input_tokens
        for i, count in enumerate(piece.num_output_tokens[:len(self.num_output)]):
            self.num_output[i] += count  # the backend counts each response's own tokens


def completion_body(req: BackendRequest, acc: Accumulator, rid: str, created: int) -> dict[str, Any]:
    if req.chat:
        choices: list[dict[str, Any]] = [
            {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
             "finish_reason": acc.reasons[i]} for i, text in enumerate(acc.texts)]
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": acc.reasons[i]}
                   for i, text in enumerate(acc.texts)]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": choices,
            "usage": usage(acc.num_input, acc.num_output)}


def chunk(req: BackendRequest, rid: str, created: int, choices: list[dict[str, Any]],
          usage_value: dict[str, int] | None = None, final_usage: bool = False) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
                           "created": created, "model": req.model, "choices": choices}
    if req.include_usage:
        obj["usage"] = usage_value if final_usage else None
    return obj


def _choice(req: BackendRequest, i: int, text: str | None, reason: str | None, role: bool = False) -> dict[str, Any]:
    if req.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
    return {"index": i, "text": text or "", "logprobs": None, "finish_reason": reason}


async def stream_chunks(req: BackendRequest, first: Piece | None, rest: AsyncIterator[Piece],
                        rid: str) -> AsyncIterator[bytes]:
    """SSE bytes for a streamed request: for chat, a role chunk per choice first; a
    chunk per backend piece; finish reasons; usage (include_usage); ``[DONE]``.
    An upstream error after the first chunk is sent as a ``data: {"error": ...}`` event."""
    created = int(time.time())
    acc = Accumulator(req.n)
    head, tail = _envelope(chunk(req, rid, created, []))
    if req.chat:
        yield sse(chunk(req, rid, created, [_choice(req, i, "", None, role=True) for i in range(req.n)]))
    try:
        pieces: list[Piece] = [first] if first is not None else []
        while True:
            if not pieces:
                try:
                    pieces.append(await anext(rest))
                except StopAsyncIteration:
                    break
            piece = pieces.pop()
            before, finished = list(acc.num_output), list(acc.reasons)
            acc.add(piece)
            choices = []
            for i in range(req.n):
                text = piece.texts[i] if i < len(piece.texts) else ""
                # Once per choice: a completion that finished before the others keeps
                # its reason in the backend's later responses.
                reason = None if finished[i] is not None else _finish(piece.finish_reasons, i)
                # A completion's new tokens get a chunk even while their text is still
                # an incomplete character (as vLLM's server does); chat sends content only.
                grew = not req.chat and acc.num_output[i] > before[i]
                if text or reason or grew:
                    choices.append(_choice(req, i, text if text or not req.chat else None, reason))
            if choices:
                yield head + _encode(choices).encode() + tail
    except ApiError as exc:
        yield sse(exc.body())
        yield DONE
        return
    finally:
        # Closed early (the client left): close the upstream call now, not at garbage collection.
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()
    if req.include_usage:
        yield sse(chunk(req, rid, created, [], usage(acc.num_input, acc.num_output), final_usage=True))
    yield DONE
