"""OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``.

Rate limits answer as OpenAI does: HTTP 429, ``type`` ``"requests"`` (requests per
minute, concurrent requests) or ``"tokens"`` (tokens per minute), ``code``
``"rate_limit_exceeded"``, and a ``Retry-After`` header in whole seconds.
"""

from __future__ import annotations

import json
import math
from typing import Any

# The status each error type is sent with (OpenAI's own pairing).
INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER = "server_error"
UNAVAILABLE = "service_unavailable_error"
RATE_LIMIT_CODE = "rate_limit_exceeded"


class ApiError(Exception):
    """An error a client sees, with the HTTP status it is sent with."""

    def __init__(self, status: int, message: str, type_: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        return json.dumps(self.body()).encode()


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, INVALID_REQUEST, param, code)


def unsupported(param: str, why: str = "is not supported by this server") -> ApiError:
    return ApiError(400, f"'{param}' {why}", INVALID_REQUEST, param, "unsupported_parameter")


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, AUTHENTICATION, None, "invalid_api_key")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model '{model}' does not exist or is not served here", NOT_FOUND, "model",
                    "model_not_found")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes", INVALID_REQUEST, None,
                    "request_too_large")


def body_too_slow(timeout_s: float) -> ApiError:
    return ApiError(408, f"the request body did not arrive whole within {timeout_s:g} s", INVALID_REQUEST, None,
                    "request_timeout")


def retry_after(seconds: float) -> dict[str, str]:
    """The Retry-After header: whole seconds, rounded up, at least 1."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def unavailable(message: str, code: str = "upstream_unavailable", retry_s: float | None = None) -> ApiError:
    return ApiError(503, message, UNAVAILABLE, None, code, retry_after(retry_s) if retry_s is not None else None)


def rate_limited(message: str, kind: str, retry_s: float) -> ApiError:
    """429 as OpenAI sends it; KIND is "requests" or "tokens"."""
    return ApiError(429, message, kind, None, RATE_LIMIT_CODE, retry_after(retry_s))

