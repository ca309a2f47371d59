"""The gateway's settings."""

from __future__ import annotations

from dataclasses import dataclass, field

# Larger request bodies are refused (413) before parsing; raise it (--max-body-bytes)
# for long-context models whose prompts, JSON-escaped, need more.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass
class GatewayConfig:
    upstream: str  # Triton's gRPC HOST:PORT
    models: list[str] = field(default_factory=list)  # the model names served through the gateway
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    upstream_timeout_s: float = 5.0  # for health checks, not for generation
