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

from llmhost.backend import jsonguard
from llmhost.backend.config import BackendSettings
from llmhost.backend.errors import RequestError, shown
from llmhost.backend.limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_PARAMETERS_BYTES,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_STRUCTURED_CHARS,
    SEED_MAX,
    SEED_MIN,
)
from llmhost.numbers import integer


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
    # Top-k log probabilities per generated token (the 'logprobs' output); vLLM
    # bounds k by the engine's max_logprobs (20 unless model.json says otherwise).
    "logprobs": "opt_int",
    # Top-k log probabilities per prompt token besides the prompt's own token (the
    # 'prompt_logprobs' output, in the request's first response).
    "prompt_logprobs": "opt_int",
}
# Structured output: vLLM's StructuredOutputsParams fields, accepted either inside
# "structured_outputs": {...} or at the top level under these names.
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
STRUCTURED_ALIASES = {"json_schema": "json", "guided_json": "json", "guided_regex": "regex",
                      "guided_choice": "choice", "guided_grammar": "grammar"}
# (most items, longest item in characters) of the list-valued parameters.
LIST_BOUNDS: dict[str, tuple[int, int]] = {
    "stop": (MAX_STOP, MAX_STOP_CHARS),
    "bad_words": (MAX_BAD_WORDS, MAX_BAD_WORD_CHARS),
    "stop_token_ids": (MAX_STOP_TOKEN_IDS, 0),
    "allowed_token_ids": (MAX_ALLOWED_TOKEN_IDS, 0),
    "logit_bias": (MAX_LOGIT_BIAS, 0),
}
# Token ids: no vocabulary comes near this.
TOKEN_ID_MAX = 2**31 - 1


def _err(key: str, expected: str, value: Any) -> SamplingError:
    return SamplingError(f"sampling parameter '{key}' must be {expected}, got {shown(value)}")


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
    """An integer parameter, as the gateway reads it too (llmhost.numbers)."""
    out = integer(value)
    if out is None:
        raise _err(key, "an integer", value)
    return out


def _to_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _err(key, "true or false", value)


def _json_maybe(key: str, value: Any) -> Any:
    """Request parameters carry lists and objects as JSON strings (bounded in size
    and depth); a string that is not JSON stays a string."""
    if isinstance(value, str) and value[:1] in "[{":
        if len(value) > MAX_PARAMETERS_BYTES:
            raise SamplingError(f"sampling parameter '{key}' is {len(value)} characters of JSON; "
                                f"at most {MAX_PARAMETERS_BYTES} are allowed")
        jsonguard.check_depth(value, f"sampling parameter '{key}'")
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


def _token_id(key: str, value: Any) -> int:
    out = _to_int(key, value)
    if not 0 <= out <= TOKEN_ID_MAX:
        raise _err(key, f"token ids (integers from 0 to {TOKEN_ID_MAX})", value)
    return out


def _check_size(key: str, value: list[Any] | dict[Any, Any]) -> None:
    most, longest = LIST_BOUNDS[key]
    if len(value) > most:
        raise SamplingError(f"sampling parameter '{key}' has {len(value)} items; at most {most} are allowed")
    if longest:
        for i, item in enumerate(value):
            if isinstance(item, str) and len(item) > longest:
                raise SamplingError(f"sampling parameter '{key}'[{i}] is {len(item)} characters long; "
                                    f"at most {longest} are allowed")


def _coerce(key: str, kind: str, value: Any) -> Any:
    if kind == "float":
        return _to_float(key, value)
    if kind in ("int", "opt_int"):
        if value is None and kind == "opt_int":
            return None
        out = _to_int(key, value)
        if not SEED_MIN <= out <= SEED_MAX:
            # vLLM's own server takes seeds in torch.long's range; larger ones overflow in its GPU runner.
            raise _err(key, f"an integer from {SEED_MIN} to {SEED_MAX} (64-bit)", value)
        return out
    if kind == "bool":
        return _to_bool(key, value)
    value = _json_maybe(key, value)
    if isinstance(value, (list, dict)):
        _check_size(key, value)
    if kind == "stop":
        if isinstance(value, str):
            _check_size(key, [value])
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
            return [_token_id(key, v) for v in value]
        raise _err(key, "a list of token ids", value)
    if kind == "logit_bias":
        if isinstance(value, dict):
            return {_token_id(key, k): _to_float(key, v) for k, v in value.items()}
        raise _err(key, "an object of token id -> bias", value)
    raise AssertionError(kind)


def _structured(params: dict[str, Any]) -> dict[str, Any] | None:
    spec: dict[str, Any] = {}
    nested = params.pop("structured_outputs", None)
    if nested is not None:
        nested = _json_maybe("structured_outputs", nested)
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
    name = STRUCTURED_KEYS[kind]
    value = _json_maybe(name, value)
    if kind == "json":
        if isinstance(value, str):
            raise SamplingError("structured output 'json_schema' must be a JSON schema object")
        if not isinstance(value, (dict, bool)):
            raise SamplingError("structured output 'json_schema' must be a JSON schema object")
        size = len(json.dumps(value))
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise SamplingError("structured output 'choice' must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise SamplingError(f"structured output 'choice' has {len(value)} items; at most {MAX_CHOICES} "
                                "are allowed")
        size = sum(len(c) for c in value)
    elif not isinstance(value, str) or not value:
        raise SamplingError(f"structured output '{name}' must be a non-empty string")
    else:
        if "\x00" in value:
            raise SamplingError(f"structured output '{name}' must not contain a NUL character")
        size = len(value)
    if size > MAX_STRUCTURED_CHARS:
        raise SamplingError(f"structured output '{name}' is {size} characters long; at most "
                            f"{MAX_STRUCTURED_CHARS} are allowed")
    return {kind: value}


def validate_sampling(params: dict[str, Any], settings: BackendSettings,
                      max_model_len: int | None = None) -> dict[str, Any]:
    """Return SamplingParams keyword arguments (structured output under 'structured_outputs').

    With ``max_model_len`` (the running engine's), an explicit max_tokens larger
    than the context is refused, as vLLM's own server does; the engine then
    lowers max_tokens (given or default) to what the prompt leaves of the context."""
    params = dict(params)
    structured = _structured(params)
    unknown = sorted(k for k in params if k not in FIELDS)
    if unknown:
        supported = sorted([*FIELDS, *STRUCTURED_ALIASES, "structured_outputs"])
        raise SamplingError(f"unknown sampling parameter(s) {unknown}; supported: {supported}")
    out = {k: _coerce(k, FIELDS[k], v) for k, v in params.items()}
    given = "max_tokens" in out
    out.setdefault("max_tokens", settings.default_max_tokens)
    if out["max_tokens"] < 1:
        raise SamplingError(f"sampling parameter 'max_tokens' must be >= 1, got {out['max_tokens']}")
    if given and max_model_len is not None and out["max_tokens"] > max_model_len:
        raise SamplingError(f"sampling parameter 'max_tokens' ({out['max_tokens']}) cannot be greater than "
                            f"the model's max_model_len ({max_model_len}); request fewer output tokens")
    if out.get("temperature", 1.0) < 0:
        raise SamplingError(f"sampling parameter 'temperature' must be >= 0, got {out['temperature']}")
    if "top_p" in out and not 0 < out["top_p"] <= 1:
        raise SamplingError(f"sampling parameter 'top_p' must be in (0, 1], got {out['top_p']}")
    n = out.get("n", 1)
    if not 1 <= n <= settings.max_n:
        raise SamplingError(f"sampling parameter 'n' must be between 1 and {settings.max_n} (llmhost.max_n), got {n}")
    if (out.get("prompt_logprobs") or 0) < 0:
        raise SamplingError(f"sampling parameter 'prompt_logprobs' must be >= 0 (top log probabilities per "
                            f"prompt token), got {out['prompt_logprobs']}")
    if (out.get("logprobs") or 0) < 0:
        raise SamplingError(f"sampling parameter 'logprobs' must be >= 0 (top log probabilities per token), "
                            f"got {out['logprobs']}")
    if out.get("min_tokens", 0) < 0:
        raise SamplingError(f"sampling parameter 'min_tokens' must be >= 0, got {out['min_tokens']}")
    if out.get("min_tokens", 0) > out["max_tokens"]:
        raise SamplingError(
            f"sampling parameter 'min_tokens' ({out['min_tokens']}) must not exceed max_tokens ({out['max_tokens']})"
        )
    if structured is not None:
        out["structured_outputs"] = structured
    return out
