"""How a request's integer parameters are read: one rule for the backend, which hands
them to vLLM, and the gateway, which holds them against a key's limits (a number the
two read differently could pass a cap)."""

from __future__ import annotations

from typing import Any


def integer(value: Any) -> int | None:
    """VALUE as the integer the engine gets, or None when it is none: an int (not a bool),
    a float without a fraction, or text that Python's int() reads (sign, spaces, digit
    underscores, any Unicode decimal digits)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None
