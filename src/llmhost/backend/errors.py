"""Errors a client caused, and what any error message may show a client.

A ``RequestError``'s message is sent back as the error response. Every message a
client sees, ours or one taken from vLLM's exceptions, goes through
``safe_message``: no Python traceback, no file path, no memory address, and a
bounded length.
"""

from __future__ import annotations

import re

from llmhost.backend.limits import MAX_ERROR_CHARS


class RequestError(ValueError):
    """The client sent something we cannot serve; the message names what."""


# Each pattern starts only where a match can start (a literal, or the start of a
# run of path characters), so none backtracks over long input; the input is cut first.
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):.*?(?=^\S|\Z)", re.S | re.M)
_FRAME = re.compile(r'File "[^"\n]*", line \d+(?:, in [^\n]*)?(?:\n[ \t]+[^\n]*)?')
_PYBIND_FRAME = re.compile(r"(?:At:\s*)?(?<!\S)\S+\.py\(\d+\): \S+")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_ROOTED_PATH = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|lib64|mnt|srv|etc|proc|run|work|data|nix)"
                          r"(?:/[\w.+@~\-]+)+/?")
_FILE_PATH = re.compile(r"(?<![\w.+@~/\-])(?:[\w.+@~\-]*/)+[\w.+@~\-]+"
                        r"\.(?:py|pyc|pyx|so|c|cc|cpp|h|rs|json|jinja|j2)\b")
_SOURCE_FILE = re.compile(r"(?<![\w.\-])[\w.\-]+\.py[cx]?\b")


def safe_message(text: str) -> str:
    """``text`` made safe to show a client."""
    text = text[: 8 * MAX_ERROR_CHARS]
    text = _TRACEBACK.sub("", text)
    text = _FRAME.sub("", text)
    text = _PYBIND_FRAME.sub("", text)
    text = _ADDRESS.sub("", text)
    text = _ROOTED_PATH.sub("<path>", text)
    text = _FILE_PATH.sub("<path>", text)
    text = _SOURCE_FILE.sub("<file>", text)
    text = re.sub(r"\n\s*\n", "\n", text).strip() or "error"
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + "... (cut)"
    return text


def shown(value: object, limit: int = 80) -> str:
    """A short repr of a client's value for an error message."""
    if isinstance(value, (list, tuple, dict)) and len(value) > 20:
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - e.g. an integer past Python's digit limit
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."
