"""The gateway's settings, from flags and/or a YAML file (``--config PATH``).

The file holds the same settings as the flags; a flag given on the command line
wins over the file, the file over the defaults. Every key is optional; an
unknown key is refused by name. Relative paths are relative to the file's folder::

    upstreams: ["127.0.0.1:8001", "10.0.0.6:8001"]  # --upstream (repeat); Triton gRPC HOST:PORT
    upstream_ca: /etc/llmhost/triton-grpc-ca.crt  # --upstream-ca; gRPC over TLS to upstreams off loopback
    models: [tiny]                     # --model (repeat); required, from the file or flags
    listen: "0.0.0.0:18080"            # --listen
    grpc_listen: "0.0.0.0:18082"       # --grpc-listen; Triton's gRPC API (doors.grpc); default: none
    allow_plaintext: false             # --allow-plaintext; plain HTTP on an address other than loopback
    metrics_listen: "127.0.0.1:18081"  # --metrics-listen
    metrics_token_file: /etc/llmhost/metrics-token.sha256  # --metrics-token-file; SHA-256 of /metrics' token
    allow_anonymous_metrics: false     # --allow-anonymous-metrics; /metrics off loopback without a token
    metrics_tls: true                  # --metrics-tls / --no-metrics-tls; /metrics over HTTPS (default: with tls)
    allow_remote_images: false         # --allow-remote-images; fetch chats' http(s) image URLs (else 400)
    keys_file: /etc/llmhost/keys.json  # --keys-file; required, from the file or flags
    max_body_bytes: 8388608            # --max-body-bytes; larger bodies: 413
    drain_timeout_s: 30                # --drain-timeout-s; on SIGTERM, in-flight requests get this long
    log_level: warning                 # --log-level: critical, error, warning, info, debug
    event_loop: asyncio                # --event-loop: asyncio (its own loop) or uvloop
    workers: 0                         # --workers; processes on the port (0: one per 4 cores, 1 to 8)
    engine_sockets:                    # --engine-sockets UPSTREAM=DIR; an upstream on this host: the
      "127.0.0.1:8001": /run/tritonserver/engine  # folder of its engine sockets (streams go there)
    health:
      interval_s: 2                    # --health-interval-s; ModelReady on every upstream this often
      timeout_s: 2                     # --health-timeout-s; each check's timeout
      unhealthy_threshold: 3           # --health-unhealthy-threshold; failed checks in a row that take it out
      healthy_threshold: 2             # --health-healthy-threshold; passed checks in a row that bring it back
    limits:
      max_concurrent_upstream: 1024    # --max-concurrent-upstream; requests in flight per upstream
      max_queue: 512                   # --max-queue; requests waiting for room (0: none wait)
      queue_timeout_s: 30              # --queue-timeout-s; then 503 with Retry-After
      key_max_concurrent: 512          # --key-max-concurrent; in flight per key without its own (0: no bound)
    connections:
      max: 4096                        # --max-connections; more are closed at once
      header_timeout_s: 10             # --header-timeout-s; a request head must arrive whole in this long
      body_timeout_s: 30               # --body-timeout-s; then the request body (else 408)
      idle_timeout_s: 5                # --idle-timeout-s; a kept-alive connection without a request
    routing:                           # which replica takes a request (llmhost.gateway.routing.policies)
      policy: cache_aware              # --routing: cache_aware, kv_events, least_loaded or round_robin
      models: {embedder: least_loaded} # --model-routing NAME=POLICY; a model's own policy
      prefix_chars: 1024               # --routing-prefix-chars; the prompt's start that makes its key
      load_factor: 1.5                 # --routing-load-factor; a replica's bound, times the mean load
      session_user: false              # --routing-session-user; the OpenAI user field pins like x-session-id
    tls:                               # both or neither
      cert: /etc/llmhost/gateway.crt   # --tls-cert
      key: /etc/llmhost/gateway.key    # --tls-key

Per-key limits (``rpm``, ``tpm``, ``max_concurrent``, ``max_tokens``) live in the
keys file (see ``keys``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from llmhost.gateway.routing.policies import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_POLICY,
    DEFAULT_PREFIX_CHARS,
    POLICIES,
    RoutingSettings,
)

# Larger request bodies are refused (413) before parsing; raise it (--max-body-bytes)
# for long-context models whose prompts, JSON-escaped, need more.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_UPSTREAM = "127.0.0.1:8001"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# asyncio's own event loop, or uvloop (if installed). No consistent difference was
# measured between them (docs/performance.md), so the default stays asyncio's.
EVENT_LOOPS = ("asyncio", "uvloop")


class ConfigError(ValueError):
    """The settings are unusable; the message names the key or flag."""


def parse_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port of 1-65535, got {text!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether HOST (an address or name) is this machine's loopback only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def join_host_port(host_port: tuple[str, int]) -> str:
    host, port = host_port
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class GatewayConfig:
    upstreams: list[str] = field(default_factory=lambda: [DEFAULT_UPSTREAM])  # Triton gRPC HOST:PORT each
    models: list[str] = field(default_factory=list)  # the model names served through the gateway
    # PEM CA certificates verifying the Triton gRPC servers of upstreams off loopback:
    # with it, their channels use TLS; loopback upstreams stay plaintext.
    upstream_ca: Path | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    listen: tuple[str, int] = ("127.0.0.1", 18080)
    metrics_listen: tuple[str, int] = ("127.0.0.1", 18081)
    # Triton's KServe v2 gRPC API (doors.grpc), with the API's TLS; None: not served.
    grpc_listen: tuple[str, int] | None = None
    # A file holding the hex SHA-256 of the token a scrape of /metrics must carry
    # (metrics.metrics_app); None: no token asked for.
    metrics_token_file: Path | None = None
    # /metrics (it names the keys) off loopback without a token: refused unless this is set.
    allow_anonymous_metrics: bool = False
    # /metrics over HTTPS with the API's certificate and key (tls_cert, tls_key; loaded
    # again on SIGHUP too); None: when the API has them.
    metrics_tls: bool | None = None
    # Image parts of chats given as http(s) URLs: fetched by the gateway if set, else
    # refused naming the field (data URLs are always taken; llmhost.gateway.doors.openai.images).
    allow_remote_images: bool = False
    keys_file: Path | None = None
    drain_timeout_s: float = 30.0
    log_level: str = "warning"
    event_loop: str = "asyncio"
    # Processes sharing the port (gateway.workers); 0: one per 4 usable cores, 1 to 8.
    workers: int = 0
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    health_unhealthy_threshold: int = 3
    health_healthy_threshold: int = 2
    # vLLM's own server admits up to its max_num_seqs (1,024 on a GPU) at once: the
    # gateway's bound must not be the lower one.
    max_concurrent_upstream: int = 1024
    max_queue: int = 512
    queue_timeout_s: float = 30.0
    # Requests in flight of one key that sets no max_concurrent of its own (0: no bound),
    # so that one key cannot hold every upstream slot.
    key_max_concurrent: int = 512
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Plain HTTP (no TLS) on an address other than loopback: refused unless this is set.
    allow_plaintext: bool = False
    # Upstream HOST:PORT -> the folder of its engine sockets (llmhost.backend.stream_socket).
    engine_sockets: dict[str, Path] = field(default_factory=dict)
    # Client connections (llmhost.gateway.connections): how many at once, and how long a
    # request's head, its body and an idle kept-alive connection may take.
    max_connections: int = 4096
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 5.0
    # Routing among a model's replicas (llmhost.gateway.routing.policies).
    routing_policy: str = DEFAULT_POLICY
    model_routing: dict[str, str] = field(default_factory=dict)
    routing_prefix_chars: int = DEFAULT_PREFIX_CHARS
    routing_load_factor: float = DEFAULT_LOAD_FACTOR
    routing_session_user: bool = False

    @cached_property
    def routing(self) -> RoutingSettings:
        """The routing settings as one value (made once: every request reads them)."""
        return RoutingSettings(self.routing_policy, dict(self.model_routing), self.routing_prefix_chars,
                               self.routing_load_factor, self.routing_session_user)


# File key -> (GatewayConfig field, kind); sections hold nested keys.
_TOP: dict[str, tuple[str, str]] = {
    "upstreams": ("upstreams", "host_ports"), "models": ("models", "names"), "listen": ("listen", "host_port"),
    "metrics_listen": ("metrics_listen", "host_port"), "grpc_listen": ("grpc_listen", "host_port"),
    "keys_file": ("keys_file", "path"),
    "max_body_bytes": ("max_body_bytes", "positive_int"), "drain_timeout_s": ("drain_timeout_s", "positive"),
    "log_level": ("log_level", "log_level"), "event_loop": ("event_loop", "event_loop"),
    "engine_sockets": ("engine_sockets", "socket_dirs"), "allow_plaintext": ("allow_plaintext", "bool"),
    "workers": ("workers", "non_negative_int"), "metrics_token_file": ("metrics_token_file", "path"),
    "allow_anonymous_metrics": ("allow_anonymous_metrics", "bool"), "upstream_ca": ("upstream_ca", "path"),
    "allow_remote_images": ("allow_remote_images", "bool"), "metrics_tls": ("metrics_tls", "bool"),
}
# Kinds whose value is one of a few names.
_CHOICES: dict[str, tuple[str, ...]] = {"log_level": LOG_LEVELS, "event_loop": EVENT_LOOPS, "policy": POLICIES}
_SECTIONS: dict[str, dict[str, tuple[str, str]]] = {
    "health": {"interval_s": ("health_interval_s", "positive"), "timeout_s": ("health_timeout_s", "positive"),
               "unhealthy_threshold": ("health_unhealthy_threshold", "positive_int"),
               "healthy_threshold": ("health_healthy_threshold", "positive_int")},
    "limits": {"max_concurrent_upstream": ("max_concurrent_upstream", "positive_int"),
               "max_queue": ("max_queue", "non_negative_int"), "queue_timeout_s": ("queue_timeout_s", "positive"),
               "key_max_concurrent": ("key_max_concurrent", "non_negative_int")},
    "connections": {"max": ("max_connections", "positive_int"), "header_timeout_s": ("header_timeout_s", "positive"),
                    "body_timeout_s": ("body_timeout_s", "positive"), "idle_timeout_s": ("idle_timeout_s", "positive")},
    "tls": {"cert": ("tls_cert", "path"), "key": ("tls_key", "path")},
    "routing": {"policy": ("routing_policy", "policy"), "models": ("model_routing", "policies"),
                "prefix_chars": ("routing_prefix_chars", "positive_int"),
                "load_factor": ("routing_load_factor", "load_factor"),
                "session_user": ("routing_session_user", "bool")},
}


def _value(where: str, kind: str, raw: Any, base: Path) -> Any:
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{where} must be {expected} (got {raw!r})")

    is_int = isinstance(raw, int) and not isinstance(raw, bool)
    if kind == "bool":
        if not isinstance(raw, bool):
            raise bad("true or false")
        return raw
    if kind == "positive_int":
        if not is_int or raw < 1:
            raise bad("a positive integer")
        return raw
    if kind == "non_negative_int":
        if not is_int or raw < 0:
            raise bad("an integer >= 0")
        return raw
    if kind == "positive":
        if isinstance(raw, bool) or not isinstance(raw, int | float) or raw <= 0:
            raise bad("a positive number")
        return float(raw)
    if kind == "path":
        if not isinstance(raw, str) or not raw:
            raise bad("a path")
        return base / Path(raw).expanduser()
    if (choices := _CHOICES.get(kind)) is not None:
        if raw not in choices:
            raise bad(f"one of {', '.join(choices)}")
        return raw
    if kind == "host_port":
        try:
            return parse_host_port(raw if isinstance(raw, str) else "")
        except ValueError:
            raise bad("HOST:PORT with a port of 1-65535") from None
    if kind == "host_ports":
        if not isinstance(raw, list) or not raw:
            raise bad("a non-empty list of HOST:PORT")
        return [join_host_port(_value(f"{where}[{i}]", "host_port", item, base)) for i, item in enumerate(raw)]
    if kind == "socket_dirs":
        if not isinstance(raw, dict):
            raise bad("a mapping of upstream HOST:PORT to the folder of its engine sockets")
        return {join_host_port(_value(f"{where} key", "host_port", k, base)): _value(f"{where}[{k}]", "path", v, base)
                for k, v in raw.items()}
    if kind == "load_factor":
        if isinstance(raw, bool) or not isinstance(raw, int | float) or raw < 1:
            raise bad("a number >= 1")
        return float(raw)
    if kind == "policies":
        if not isinstance(raw, dict) or not all(isinstance(k, str) and k for k in raw):
            raise bad(f"a mapping of model names to a policy ({', '.join(POLICIES)})")
        return {name: _value(f"{where}.{name}", "policy", value, base) for name, value in raw.items()}
    if kind == "names":
        if not isinstance(raw, list) or not raw or not all(isinstance(x, str) and x for x in raw):
            raise bad("a non-empty list of model names")
        return list(dict.fromkeys(raw))
    raise AssertionError(kind)


def load_yaml(text: str) -> Any:
    """YAML text -> data; ValueError(" at line N") (or "") when it does not parse."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ValueError(f" at line {mark.line + 1}" if mark is not None else "") from None


def parse_config(text: str, source: str = "config", base: Path = Path()) -> dict[str, Any]:
    """The settings a YAML config file gives, as GatewayConfig field names."""
    try:
        data = load_yaml(text)
    except ValueError as exc:
        raise ConfigError(f"{source} is not valid YAML{exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must be a mapping of settings")
    known = sorted([*_TOP, *_SECTIONS])
    out: dict[str, Any] = {}
    for key, raw in data.items():
        if key in _TOP:
            name, kind = _TOP[key]
            out[name] = _value(str(key), kind, raw, base)
        elif key in _SECTIONS:
            if not isinstance(raw, dict):
                raise ConfigError(f"{key} must be a mapping with keys {', '.join(_SECTIONS[key])}")
            for sub, value in raw.items():
                if sub not in _SECTIONS[key]:
                    raise ConfigError(f"{source} has an unknown key '{key}.{sub}'; allowed in {key}: "
                                      f"{', '.join(_SECTIONS[key])}")
                name, kind = _SECTIONS[key][sub]
                out[name] = _value(f"{key}.{sub}", kind, value, base)
        else:
            raise ConfigError(f"{source} has an unknown key '{key}'; allowed: {', '.join(known)}")
    return out


def load_config(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"the config file {path} is not UTF-8 text") from None
    return parse_config(text, str(path), path.parent)
