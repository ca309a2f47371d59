"""OpenAI's response bodies and streamed chunks (``chat.completion``,
``chat.completion.chunk``, ``text_completion``), built from backend pieces."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from llmhost.gateway.errors import ApiError
from llmhost.gateway.httpio import sse
from llmhost.gateway.upstreams.client import Piece
from llmhost.gateway.upstreams.request import BackendRequest

DONE = b"data: [DONE]\n\n"


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


# One encoder for every chunk: json.dumps with separators builds a new one per call.
_encode = json.JSONEncoder(separators=(",", ":")).encode


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


# One generated token's log probabilities: (token text, log probability) for the
# sampled token first, then the top ones, as vLLM orders them.
Position = list[tuple[str, float | None]]
# OpenAI's stand-in for minus infinity, as vLLM's server sends it.
LOWEST_LOGPROB = -9999.0


def positions(raw: str | None) -> list[Position]:
    """One completion's log probabilities from the backend's ``logprobs`` output (JSON:
    per token, token id -> {"logprob", "rank", "decoded_token"}, the sampled token first)."""
    data = json.loads(raw) if raw else None
    return [[(entry.get("decoded_token") or "",
              max(float(entry["logprob"]), LOWEST_LOGPROB) if entry["logprob"] is not None else None)
             for entry in position.values()] for position in data or ()]


def vllm_prompt_logprobs(raw: str | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs`` field from the backend's output: null for the first
    token (nothing comes before it), then per token id its logprob, rank and text."""
    data = json.loads(raw) if raw else None
    return [None, *data[1:]] if data else None


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", "replace"))


def chat_logprobs(tokens: list[Position], top: int) -> dict[str, Any]:
    """Chat's ``logprobs`` object: per token its text, log probability, UTF-8 bytes and
    the first TOP entries of its position (vLLM's server takes them in its order)."""
    return {"content": [
        {"token": position[0][0], "logprob": position[0][1], "bytes": _token_bytes(position[0][0]),
         "top_logprobs": [{"token": t, "logprob": lp, "bytes": _token_bytes(t)} for t, lp in position[:top]]}
        for position in tokens if position]}


def completion_logprobs(tokens: list[Position], top: int, offset: int) -> tuple[dict[str, Any], int]:
    """Completions' ``logprobs`` object (tokens, token_logprobs, top_logprobs with up to
    TOP + 1 entries, text_offset from OFFSET) and the offset after its last token."""
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for position in tokens:
        if not position:
            continue
        token, logprob = position[0]
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        # The prompt's first token has no log probability, nor top ones (echo).
        out["top_logprobs"].append({t: lp for t, lp in position[:top + 1]} if logprob is not None else None)
        out["text_offset"].append(offset)
        offset += len(token)
    return out, offset


class Accumulator:
    """Whole completions from a non-streamed (or streamed) sequence of pieces."""

    def __init__(self, n: int) -> None:
        self.texts = [""] * n
        self.reasons: list[str | None] = [None] * n
        self.num_input: int | None = None
        self.num_output = [0] * n
        self.logprobs: list[list[Position]] = [[] for _ in range(n)]
        # Per choice: the backend withheld its log probabilities although they were
        # asked for (a chat that hides the model's thinking: include_reasoning false).
        self.withheld = [False] * n
        self.prompt_logprobs: str | None = None  # the backend's JSON, from the first piece with it
        # Per choice, its message as the model's parsers read it (content, reasoning,
        # tool_calls); None: its text is the content.
        self.messages: list[dict[str, Any] | None] = [None] * n

    def add(self, piece: Piece) -> list[list[Position]]:
        """Adds PIECE; returns its own log probabilities per choice (parsed once here)."""
        for i, text in enumerate(piece.texts[:len(self.texts)]):
            self.texts[i] += text
            self.reasons[i] = _finish(piece.finish_reasons, i) or self.reasons[i]
        added: list[list[Position]] = [[] for _ in self.logprobs]
        for i, raw in enumerate(piece.logprobs[:len(self.logprobs)]):
            if raw is not None and raw.strip() == "null":
                self.withheld[i] = True
            added[i] = positions(raw)
            self.logprobs[i] += added[i]
        for i, raw in enumerate(piece.messages[:len(self.messages)]):
            said = json.loads(raw) if raw else []
            if said and not piece.final:
                continue  # a stream's deltas: sent as they come (stream_chunks)
            if said:
                self.messages[i] = said[-1]
        if piece.num_input_tokens is not None:
            self.num_input = piece.num_input_tokens
        if piece.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = piece.prompt_logprobs
        for i, count in enumerate(piece.num_output_tokens[:len(self.num_output)]):
            self.num_output[i] += count  # the backend counts each response's own tokens
        return added


def _logprobs(req: BackendRequest, tokens: list[Position], offset: int = 0,
              withheld: bool = False) -> dict[str, Any] | None:
    if req.logprobs is None or withheld:
        return None
    return chat_logprobs(tokens, req.logprobs) if req.chat else completion_logprobs(tokens, req.logprobs, offset)[0]


def _message(text: str, parsed: dict[str, Any] | None) -> dict[str, Any]:
    """A chat choice's message: its text, or what the model's parsers made of it."""
    if parsed is None:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", **parsed}


def _deltas(piece: Piece, n: int) -> list[list[dict[str, Any]]] | None:
    """Per choice, the piece's parsed deltas (None: the piece carries plain text)."""
    if not piece.messages:
        return None
    out: list[list[dict[str, Any]]] = [json.loads(raw) if raw else [] for raw in piece.messages[:n]]
    return out + [[] for _ in range(n - len(out))]


def completion_body(req: BackendRequest, acc: Accumulator, rid: str, created: int) -> dict[str, Any]:
    shown = vllm_prompt_logprobs(acc.prompt_logprobs) if req.prompt_logprobs else None
    if req.chat:
        choices: list[dict[str, Any]] = [
            {"index": i, "message": _message(text, acc.messages[i]),
             "logprobs": _logprobs(req, acc.logprobs[i], withheld=acc.withheld[i]), "finish_reason": acc.reasons[i]}
            for i, text in enumerate(acc.texts)]
        body: dict[str, Any] = {"id": rid, "object": "chat.completion"}
        if req.prompt_logprobs:
            body["prompt_logprobs"] = shown
    else:
        # echo with logprobs: the prompt's tokens come first (vLLM's server does the same).
        before = positions(acc.prompt_logprobs) if req.echo is not None and req.logprobs is not None else []
        choices = [{"index": i, "text": (req.echo or "") + text, "logprobs": _logprobs(req, before + acc.logprobs[i]),
                    "finish_reason": acc.reasons[i]} for i, text in enumerate(acc.texts)]
        if req.prompt_logprobs:
            for choice in choices:
                choice["prompt_logprobs"] = shown
        body = {"id": rid, "object": "text_completion"}
    return {**body, "created": created, "model": req.answer_model or req.model, "choices": choices,
            "usage": usage(acc.num_input, acc.num_output)}


def chunk(req: BackendRequest, rid: str, created: int, choices: list[dict[str, Any]],
          usage_value: dict[str, int] | None = None, final_usage: bool = False) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
                           "created": created, "model": req.answer_model or req.model, "choices": choices}
    if req.include_usage:
        obj["usage"] = usage_value if final_usage else None
    return obj


def _choice(req: BackendRequest, i: int, text: str | None, reason: str | None, role: bool = False,
            logprobs: dict[str, Any] | None = None, parsed: dict[str, Any] | None = None) -> dict[str, Any]:
    if req.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if parsed is not None:
            delta.update(parsed)
        elif text is not None:
            delta["content"] = text
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    return {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": reason}


class _StreamLogprobs:
    """Each streamed chunk's log probabilities: its own tokens' (completions' text
    offsets go on from the tokens sent before)."""

    def __init__(self, req: BackendRequest) -> None:
        self.req = req
        self.offsets = [len(req.echo or "")] * req.choices

    def of(self, tokens: list[Position], i: int) -> dict[str, Any] | None:
        """Choice I's log probabilities for TOKENS, this chunk's."""
        if self.req.logprobs is None:
            return None
        if self.req.chat:
            return chat_logprobs(tokens, self.req.logprobs)
        out, self.offsets[i] = completion_logprobs(tokens, self.req.logprobs, self.offsets[i])
        return out


def _parsed_rounds(req: BackendRequest, piece: Piece, deltas: list[list[dict[str, Any]]],
                   finished: list[str | None], added: list[list[Position]], acc: Accumulator, before: list[int],
                   logprobs: _StreamLogprobs) -> list[list[dict[str, Any]]]:
    """The choices of the chunks for one piece of a parsed chat: as vLLM's server, one
    chunk per delta (the k-th delta of every choice in the k-th chunk), the finish
    reason and the piece's log probabilities with a choice's last one; a choice with no
    delta gets an empty one only for its finish reason or its tokens' log probabilities."""
    rounds: list[list[dict[str, Any]]] = [[] for _ in range(max((len(d) for d in deltas), default=0) or 1)]
    for i, said in enumerate(deltas):
        reason = None if finished[i] is not None else _finish(piece.finish_reasons, i)
        grew = req.logprobs is not None and not acc.withheld[i] and acc.num_output[i] > before[i]
        lp = logprobs.of(added[i], i) if grew else None
        if not said and reason is None and lp is None:
            continue
        said = said or [{}]
        for k, delta in enumerate(said):
            last = k == len(said) - 1
            rounds[k].append(_choice(req, i, None, reason if last else None, logprobs=lp if last else None,
                                     parsed=delta))
    return [choices for choices in rounds if choices]


async def stream_chunks(req: BackendRequest, first: Piece | None, rest: AsyncIterator[Piece],
                        rid: str) -> AsyncIterator[bytes]:
    """SSE bytes for a streamed request: for chat, a role chunk per choice first; a
    chunk per backend piece; finish reasons; usage (include_usage); ``[DONE]``.
    An upstream error after the first chunk is sent as a ``data: {"error": ...}`` event."""
    created = int(time.time())
    acc = Accumulator(req.choices)
    logprobs = _StreamLogprobs(req)
    # Completions' echo: the prompt's text comes with each completion's first chunk.
    unechoed = [req.echo if req.echo else None] * req.choices
    head, tail = _envelope(chunk(req, rid, created, []))

    def framed(choices: list[dict[str, Any]]) -> bytes:
        if req.continuous_usage:  # as vLLM's server: every chunk with the usage so far
            return sse(chunk(req, rid, created, choices, usage(acc.num_input, acc.num_output), final_usage=True))
        return head + _encode(choices).encode() + tail

    if req.chat:
        if first is not None and acc.num_input is None:
            acc.num_input = first.num_input_tokens  # the role chunk's usage: the prompt's alone
        yield framed([_choice(req, i, "", None, role=True) for i in range(req.choices)])
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
            added = acc.add(piece)
            deltas = _deltas(piece, req.choices) if req.chat else None
            if deltas is not None:
                for choices in _parsed_rounds(req, piece, deltas, finished, added, acc, before, logprobs):
                    yield framed(choices)
                continue
            choices = []
            for i in range(req.choices):
                text = piece.texts[i] if i < len(piece.texts) else ""
                # Once per choice: a completion that finished before the others keeps
                # its reason in the backend's later responses.
                reason = None if finished[i] is not None else _finish(piece.finish_reasons, i)
                # A completion's new tokens get a chunk even while their text is still
                # an incomplete character (as vLLM's server does); chat sends content
                # only, or the tokens' log probabilities where they were asked for.
                grew = (not req.chat or req.logprobs is not None) and acc.num_output[i] > before[i]
                if unechoed[i] is not None:
                    text, unechoed[i] = unechoed[i] + text, None
                if text or reason or grew:
                    choices.append(_choice(req, i, text if text or not req.chat else None, reason,
                                           logprobs=logprobs.of(added[i], i)))
            if choices:
                yield framed(choices)
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
