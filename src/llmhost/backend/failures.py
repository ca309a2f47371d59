"""Whose fault a failed request is, and what its client is told.

Client errors (our validation's ``RequestError``, and vLLM's own validation: its
``VLLMClientError`` classes and the bare ValueError/TypeError/OverflowError that
vLLM's OpenAI server also answers with 400) count as ``invalid_request``; every
other failure is the server's and counts as ``engine_error``, the only reason the
error-ratio alert pages on. vLLM wraps an unexpected exception raised while it
takes a request in EngineGenerateError; the exception it wraps decides. One
assertion of vLLM's is the client's too: its multimodal processor's failure to place
a picture, when the prompt holds fewer image placeholders than images.

Classes are matched by name, so this module needs no vLLM import (unit tests).
"""

from __future__ import annotations

from llmhost.backend.errors import RequestError, safe_message

INVALID_REQUEST = "invalid_request"
ENGINE_ERROR = "engine_error"
# The server's state, not a fault: it is stopping, or its engine died (retry elsewhere).
SHUTTING_DOWN = "shutting_down"
ENGINE_DEAD = "engine_dead"
# What a request gets that comes while the model drains (Triton's path and the engine socket).
SHUTTING_DOWN_MESSAGE = "the model is shutting down; retry on another instance"
_CLIENT_BASES = {"VLLMClientError"}
_BARE_CLIENT = (ValueError, TypeError, OverflowError)
# vLLM's AssertionError when a multimodal item finds no placeholder in the prompt
# (e.g. LLaVA given two pictures and one "<image>"): "Failed to apply prompt
# replacement for mm_items['image'][1]".
_UNPLACED_ITEM = "Failed to apply prompt replacement for mm_items"


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _is_client(exc: BaseException) -> bool:
    names = _names(exc)
    if names & _CLIENT_BASES:
        return True
    if "GracefulHTTPError" in names:  # vLLM's admission control: 4xx the client's, 5xx (overload) ours
        return int(getattr(exc, "http_status", 500)) < 500
    if "VLLMServerError" in names:
        return False
    return isinstance(exc, _BARE_CLIENT)


def classify(exc: BaseException) -> tuple[str, str]:
    """(metric reason, the client's error message) for a failed request."""
    if isinstance(exc, RequestError):
        return INVALID_REQUEST, safe_message(str(exc))
    cause = exc
    if "EngineGenerateError" in _names(exc) and exc.__cause__ is not None:
        cause = exc.__cause__
    if _is_client(cause):
        return INVALID_REQUEST, safe_message(f"invalid request: {cause}")
    if isinstance(cause, AssertionError) and str(cause).startswith(_UNPLACED_ITEM):
        return INVALID_REQUEST, safe_message(
            "invalid request: the prompt holds fewer of the model's image placeholders (e.g. <image>) than the "
            f"request has images; give each image its placeholder (vLLM: {cause})")
    detail = str(exc).strip()
    return ENGINE_ERROR, safe_message(f"engine error: {type(exc).__name__}" + (f": {detail}" if detail else ""))
