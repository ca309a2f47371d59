"""Sampling parameters a client may set, coerced to vLLM SamplingParams' field types.

The table below is the public surface: a key not in it is refused by name. Values
arrive as JSON (typed) or as Triton request parameters (often strings), so each is
coerced to its field's type ("0.7" -> 0.7, "true" -> True, 5.0 -> 5) and checked.
A unit test holds the table against the installed vLLM's SamplingParams fields.
"""

from __future__ import annotations

import json
import math
from typing import Any

from llmhost.backend.config import BackendSettings
from llmhost.backend.errors import RequestError


class SamplingError(RequestError):
    """A sampling parameter is unknown, of the wrong type or out of range."""


# key -> kind; kinds: float, int, bool, opt_int, stop, int_list, str_list, logit_bias
FIELDS: dict[str, str] = {
    "n": "int",
    "presence_penalty": "float",
    "frequency_penalty": "float",
    "repetition_penalty": "float",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "min_p": "float",
    "seed": "opt_int",
    "stop": "stop",
    "stop_token_ids": "int_list",
    "ignore_eos": "bool",
    "max_tokens": "int",
    "min_tokens": "int",
    "include_stop_str_in_output": "bool",
    "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool",
    "bad_words": "str_list",
    "logit_bias": "logit_bias",
    "allowed_token_ids": "int_list",
}
# Structured output: vLLM's StructuredOutputsParams fields, accepted either inside
# "structured_outputs": {...} or at the top level under these names.
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
STRUCTURED_ALIASES = {"json_schema": "json", "guided_json": "json", "guided_regex": "regex",
                      "guided_choice": "choice", "guided_grammar": "grammar"}


def _err(key: str, expected: str, value: Any) -> SamplingError:
    return SamplingError(f"sampling parameter '{key}' must be {expected}, got {value!r}")


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise _err(key, "a number", value)
    if isinstance(value, (int, float)):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            raise _err(key, "a number", value) from None
    else:
        raise _err(key, "a number", value)
    if not math.isfinite(out):
        raise _err(key, "a finite number", value)
    return out


def _to_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise _err(key, "an integer", value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise _err(key, "an integer", value) from None
    raise _err(key, "an integer", value)


def _to_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _err(key, "true or false", value)


def _json_maybe(value: Any) -> Any:
    """Request parameters carry lists and objects as JSON strings."""
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _coerce(key: str, kind: str, value: Any) -> Any:
    if kind == "float":
        return _to_float(key, value)
    if kind == "int":
        return _to_int(key, value)
    if kind == "opt_int":
        return None if value is None else _to_int(key, value)
    if kind == "bool":
        return _to_bool(key, value)
    value = _json_maybe(value)
    if kind == "stop":
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(s, str) and s for s in value):
            return value
        raise _err(key, "a string or a list of non-empty strings", value)
    if kind == "str_list":
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise _err(key, "a list of strings", value)
    if kind == "int_list":
        if isinstance(value, list):
            return [_to_int(key, v) for v in value]
        raise _err(key, "a list of integers", value)
    if kind == "logit_bias":
        if isinstance(value, dict):
            return {_to_int(key, k): _to_float(key, v) for k, v in value.items()}
        raise _err(key, "an object of token id -> bias", value)
    raise AssertionError(kind)


def _structured(params: dict[str, Any]) -> dict[str, Any] | None:
    spec: dict[str, Any] = {}
    nested = params.pop("structured_outputs", None)
    if nested is not None:
        nested = _json_maybe(nested)
        if not isinstance(nested, dict):
            raise SamplingError("sampling parameter 'structured_outputs' must be an object")
        for k, v in nested.items():
            name = STRUCTURED_ALIASES.get(k, k)
            if name not in STRUCTURED_KEYS:
                raise SamplingError(
                    f"unknown structured_outputs key '{k}'; use one of {sorted(STRUCTURED_KEYS)}"
                )
            spec[name] = v
    for alias, name in STRUCTURED_ALIASES.items():
        if alias in params:
            spec[name] = params.pop(alias)
    for name in ("regex", "choice", "grammar"):
        if name in params:
            spec[name] = params.pop(name)
    if not spec:
        return None
    if len(spec) > 1:
        raise SamplingError(f"give one kind of structured output, not {sorted(spec)}")
    (kind, value), = spec.items()
    value = _json_maybe(value)
    if kind == "json":
        if isinstance(value, str):
            raise SamplingError("structured output 'json_schema' must be a JSON schema object")
        if not isinstance(value, (dict, bool)):
            raise SamplingError("structured output 'json_schema' must be a JSON schema object")
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise SamplingError("structured output 'choice' must be a non-empty list of non-empty strings")
    elif not isinstance(value, str) or not value:
        raise SamplingError(f"structured output '{STRUCTURED_KEYS[kind]}' must be a non-empty string")
    return {kind: value}


def validate_sampling(params: dict[str, Any], settings: BackendSettings) -> dict[str, Any]:
    """Return SamplingParams keyword arguments (structured output under 'structured_outputs')."""
    params = dict(params)
    structured = _structured(params)
    unknown = sorted(k for k in params if k not in FIELDS)
    if unknown:
        supported = sorted([*FIELDS, *STRUCTURED_ALIASES, "structured_outputs"])
        raise SamplingError(f"unknown sampling parameter(s) {unknown}; supported: {supported}")
    out = {k: _coerce(k, FIELDS[k], v) for k, v in params.items()}
    out.setdefault("max_tokens", settings.default_max_tokens)
    if out["max_tokens"] < 1:
        raise SamplingError(f"sampling parameter 'max_tokens' must be >= 1, got {out['max_tokens']}")
    if out.get("temperature", 1.0) < 0:
        raise SamplingError(f"sampling parameter 'temperature' must be >= 0, got {out['temperature']}")
    if "top_p" in out and not 0 < out["top_p"] <= 1:
        raise SamplingError(f"sampling parameter 'top_p' must be in (0, 1], got {out['top_p']}")
    n = out.get("n", 1)
    if not 1 <= n <= settings.max_n:
        raise SamplingError(f"sampling parameter 'n' must be between 1 and {settings.max_n} (llmhost.max_n), got {n}")
    if out.get("min_tokens", 0) < 0:
        raise SamplingError(f"sampling parameter 'min_tokens' must be >= 0, got {out['min_tokens']}")
    if out.get("min_tokens", 0) > out["max_tokens"]:
        raise SamplingError(
            f"sampling parameter 'min_tokens' ({out['min_tokens']}) must not exceed max_tokens ({out['max_tokens']})"
        )
    if structured is not None:
        out["structured_outputs"] = structured
    return out
