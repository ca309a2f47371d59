"""What a client may be told: no traceback, no path, bounded length; and whose
fault a failure is (the metric reason), for our errors and vLLM's."""

from __future__ import annotations

import pytest

from llmhost.backend.errors import RequestError, safe_message, shown
from llmhost.backend.failures import ENGINE_ERROR, INVALID_REQUEST, classify
from llmhost.backend.limits import MAX_ERROR_CHARS

LEAKS = ("Traceback", 'File "', "/site-packages/", "/usr/", "/opt/", "/tmp/", ".py")


def assert_clean(text: str) -> None:
    for needle in LEAKS:
        assert needle not in text, (needle, text)


def test_traceback_and_paths_removed():
    text = (
        "Traceback (most recent call last):\n"
        '  File "/opt/llmhost/.venv/lib/python3.11/site-packages/vllm/foo.py", line 12, in bar\n'
        "    raise RecursionError()\n"
        "RecursionError: maximum recursion depth exceeded while decoding a JSON array from a unicode string"
    )
    out = safe_message(text)
    assert_clean(out)
    assert out.startswith("RecursionError: maximum recursion depth exceeded")


@pytest.mark.parametrize(
    "text",
    [
        "cannot open /usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "see /tmp/llmhost-xyz/model.json for details",
        "At:\n  /work/main/.venv/lib/python3.11/site-packages/vllm/engine.py(123): generate",
        "error in vllm/v1/engine/async_llm.py",
        "bad object <Foo object at 0x7f3a2b1c>",
        "raised in json_decoder.py",
    ],
)
def test_paths_and_addresses(text):
    out = safe_message(text)
    assert_clean(out)
    assert "0x7f3a" not in out


def test_length_bounded_and_never_empty():
    assert len(safe_message("x" * 100_000)) <= MAX_ERROR_CHARS + 20
    assert safe_message("   ") == "error"


def test_ordinary_messages_unchanged():
    msg = "sampling parameter 'seed' must be an integer from -9223372036854775808 to 9223372036854775807 (64-bit)"
    assert safe_message(msg) == msg


def test_shown_is_short():
    assert shown(list(range(1000))) == "<list of 1000 items>"
    assert shown(10**5000).startswith("<an integer of")
    assert len(shown("x" * 1000)) < 100


class VLLMError(Exception):
    pass


class VLLMClientError(VLLMError):
    pass


class VLLMValidationError(VLLMClientError):
    pass


class VLLMServerError(VLLMError):
    pass


class EngineGenerateError(VLLMServerError):
    pass


class EngineDeadError(VLLMServerError):
    pass


class GracefulHTTPError(VLLMError):
    def __init__(self, message: str, http_status: int) -> None:
        super().__init__(message)
        self.http_status = http_status


def wrapped(cause: BaseException) -> EngineGenerateError:
    try:
        raise EngineGenerateError() from cause
    except EngineGenerateError as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "reason", "needle"),
    [
        (RequestError("input 'x' is bad"), INVALID_REQUEST, "input 'x' is bad"),
        (VLLMValidationError("Failed to transform regex into a grammar: bad"), INVALID_REQUEST,
         "invalid request: Failed to transform regex"),
        (ValueError("min_tokens must be less than or equal to max_tokens"), INVALID_REQUEST, "invalid request"),
        (wrapped(ValueError("Regex compilation timed out after 30s")), INVALID_REQUEST, "timed out"),
        (wrapped(RuntimeError("CUDA error: an illegal memory access")), ENGINE_ERROR,
         "engine error: EngineGenerateError"),
        # LLaVA given two pictures and one <image> (seen on the H100, 2026-11-25): the client's.
        (wrapped(AssertionError("Failed to apply prompt replacement for mm_items['image'][1]")), INVALID_REQUEST,
         "fewer of the model's image placeholders (e.g. <image>) than the request has images"),
        # Any other assertion of vLLM's stays the server's.
        (wrapped(AssertionError("num_computed_tokens went negative")), ENGINE_ERROR,
         "engine error: EngineGenerateError"),
        (EngineDeadError("EngineCore encountered an issue"), ENGINE_ERROR, "engine error: EngineDeadError"),
        (RuntimeError("boom"), ENGINE_ERROR, "engine error: RuntimeError: boom"),
        (GracefulHTTPError("queue full", 503), ENGINE_ERROR, "queue full"),
        (GracefulHTTPError("conflict", 409), INVALID_REQUEST, "conflict"),
    ],
)
def test_classify(exc, reason, needle):
    got_reason, message = classify(exc)
    assert got_reason == reason
    assert needle in message
    assert_clean(message)


def test_classify_real_vllm_validation_error():
    from vllm.exceptions import VLLMValidationError as Real

    assert classify(Real("Failed to transform regex into a grammar", parameter="regex"))[0] == INVALID_REQUEST
