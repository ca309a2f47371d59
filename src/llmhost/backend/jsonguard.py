"""Parse a client's JSON text with its size and nesting depth bounded first.

Python's json parser recurses once per nested array or object: a string of
100,000 ``[`` raises RecursionError. ``nesting_depth`` measures the depth without
parsing (vectorized with numpy, linear in the text, no recursion), so a text
nested deeper than ``MAX_JSON_DEPTH`` is refused before ``json.loads`` sees it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from llmhost.backend.errors import RequestError
from llmhost.backend.limits import MAX_JSON_DEPTH

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_DELTA = np.zeros(256, dtype=np.int8)  # byte -> +1 opens, -1 closes a level
_DELTA[[ord("["), ord("{")]] = 1
_DELTA[[ord("]"), ord("}")]] = -1


def nesting_depth(text: str | bytes) -> int:
    """How deep arrays and objects nest in a JSON text (brackets inside strings
    do not count). Malformed text gets a number too; the parser then refuses it."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    b = np.frombuffer(raw, dtype=np.uint8)
    delta = _DELTA[b]
    if not delta.any():
        return 0
    quotes = np.flatnonzero(b == _QUOTE)
    if quotes.size:
        # A quote preceded by an odd number of backslashes is escaped.
        escaped = quotes[(quotes > 0) & (b[quotes - 1] == _BACKSLASH)]
        if escaped.size:
            plain = np.flatnonzero(b != _BACKSLASH)  # the last of these before a quote ends its backslash run
            run = escaped - plain[np.searchsorted(plain, escaped) - 1] - 1
            quotes = np.setdiff1d(quotes, escaped[run % 2 == 1], assume_unique=True)
        # Bytes after an odd number of real quotes are inside a string.
        toggles = np.zeros(b.size, dtype=np.int8)
        toggles[quotes] = 1
        delta = np.where(np.bitwise_xor.accumulate(toggles).astype(bool), 0, delta)
    return int(np.cumsum(delta, dtype=np.int32).max(initial=0))


def check_depth(text: str | bytes, what: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """A RequestError naming ``what`` if ``text`` nests deeper than ``max_depth``."""
    depth = nesting_depth(text)
    if depth > max_depth:
        raise RequestError(f"{what} nests arrays/objects {depth} levels deep; at most {max_depth} are allowed")


def loads(text: str, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` for client input named ``what`` (e.g. "input 'messages'");
    a RequestError naming it when the text is too deep or not JSON."""
    check_depth(text, what, max_depth)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"{what} is not valid JSON: {exc.msg} at position {exc.pos}") from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer past Python's digit limit
        raise RequestError(f"{what} is not acceptable JSON: {str(exc).split(':')[0]}") from None
