"""One JSON line per request on stderr: who, what, how long, how many tokens.

Fields: ``time`` (UTC, ISO 8601), ``key`` (the key's name), ``method``, ``path``,
``model``, ``status``, ``duration_s``, ``ttft_s`` (streams), ``prompt_tokens``,
``completion_tokens``, ``upstream``, ``client`` (address:port). Never the body
(prompts), the query string, the key or any header.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime

from starlette.types import Scope

from llmhost.gateway.record import RequestRecord

_MAX_FIELD = 200  # a client-chosen model name or path is cut to this


def _cut(value: str | None) -> str | None:
    return value if value is None or len(value) <= _MAX_FIELD else value[:_MAX_FIELD] + "..."


def _write_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class AccessLog:
    def __init__(self, write: Callable[[str], None] = _write_stderr) -> None:
        self.write = write

    def __call__(self, rec: RequestRecord, scope: Scope) -> None:
        client = scope.get("client")
        entry = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "key": rec.key or None,
            "method": scope.get("method"),
            "path": _cut(scope.get("path")),
            "model": _cut(rec.model),
            "status": rec.status,
            "duration_s": round(rec.duration_s, 6),
            "ttft_s": None if rec.ttft_s is None else round(rec.ttft_s, 6),
            "prompt_tokens": rec.prompt_tokens,
            "completion_tokens": rec.output_tokens if rec.prompt_tokens is not None or rec.output_tokens else None,
            "upstream": rec.upstream,
            "client": f"{client[0]}:{client[1]}" if client else None,
        }
        if rec.limited is not None:
            entry["rate_limited"] = rec.limited
        self.write(json.dumps(entry, separators=(",", ":")))
