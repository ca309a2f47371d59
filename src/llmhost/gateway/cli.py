"""`llmhost gateway`: run the gateway, or `llmhost gateway hash-key` to hash a key.

Settings come from flags and/or ``--config PATH`` (YAML, see ``config``); a flag
given wins over the file. Exit 2 names the flag, key or file that is wrong. SIGHUP
loads the TLS certificate and key again (new connections get them; a pair that does
not load leaves the old one serving), on the API and on /metrics when it has TLS
too (``--metrics-tls``, by default with the API's), so a renewed certificate needs
no restart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import ssl
import sys
from collections.abc import Coroutine, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from llmhost.gateway.config import (
    DEFAULT_MAX_BODY_BYTES,
    EVENT_LOOPS,
    LOG_LEVELS,
    ConfigError,
    GatewayConfig,
    is_loopback,
    join_host_port,
    load_config,
    parse_host_port,
)
from llmhost.gateway.connections import guarded_protocol, raise_open_files_limit
from llmhost.gateway.keys import MIN_KEY_CHARS, ApiKey, KeysError, KeyStore, hash_key, load_keys
from llmhost.gateway.routing.policies import POLICIES, SESSION_HEADER
from llmhost.gateway.workers import (
    CORES_PER_WORKER,
    MAX_AUTO_WORKERS,
    WORKER_ENV,
    WorkerPlace,
    listening_socket,
    worker_config,
    worker_count,
)


def _host_port(text: str) -> tuple[str, int]:
    try:
        return parse_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_at_least(minimum: int, what: str) -> Any:
    """An argparse type: an integer of at least MINIMUM (WHAT names it in the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive = _int_at_least(1, "a positive integer")
_non_negative = _int_at_least(0, "an integer >= 0")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _engine_sockets(text: str) -> tuple[str, Path]:
    upstream, sep, directory = text.partition("=")
    if not sep or not directory:
        raise argparse.ArgumentTypeError(f"expected UPSTREAM=DIR (HOST:PORT=folder), got {text!r}")
    return join_host_port(_host_port(upstream)), Path(directory)


def _model_policy(text: str) -> tuple[str, str]:
    name, sep, policy = text.partition("=")
    if not sep or not name or policy not in POLICIES:
        raise argparse.ArgumentTypeError(f"expected NAME=POLICY with a policy of {', '.join(POLICIES)}, got {text!r}")
    return name, policy


def _load_factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = GatewayConfig()
    p = argparse.ArgumentParser(
        prog="llmhost gateway",
        description="OpenAI-compatible API (and Triton's generate API) with API keys in front of Triton. "
                    "`llmhost gateway hash-key` prints the hash of a key read from stdin.")
    p.add_argument("--config", type=Path, metavar="PATH",
                   help="YAML file with the same settings (see llmhost.gateway.config); flags given win")
    p.add_argument("--upstream", type=_host_port, action="append", metavar="HOST:PORT",
                   help=f"a Triton gRPC address; repeat for several (default {d.upstreams[0]})")
    p.add_argument("--upstream-ca", type=Path, metavar="PATH",
                   help="CA certificate(s) (PEM) verifying the Triton gRPC servers of upstreams off loopback: "
                        "their channels use TLS (Triton's --grpc-use-ssl); loopback upstreams stay plaintext")
    p.add_argument("--listen", type=_host_port, metavar="HOST:PORT",
                   help=f"where the gateway listens (default {join_host_port(d.listen)})")
    p.add_argument("--grpc-listen", type=_host_port, metavar="HOST:PORT",
                   help="also serve Triton's gRPC API (KServe v2, for tritonclient.grpc) here, with the same "
                        "keys, limits and TLS (default: not served)")
    p.add_argument("--keys-file", type=Path, metavar="PATH",
                   help="JSON or YAML file of named keys stored as SHA-256 hashes, with optional limits")
    p.add_argument("--model", action="append", metavar="NAME",
                   help="a Triton model served through the gateway (repeat for several)")
    p.add_argument("--max-body-bytes", type=_positive,
                   help=f"largest request body (default {DEFAULT_MAX_BODY_BYTES}); larger: 413")
    p.add_argument("--metrics-listen", type=_host_port, metavar="HOST:PORT",
                   help=f"Prometheus metrics, GET /metrics (default {join_host_port(d.metrics_listen)})")
    p.add_argument("--metrics-token-file", type=Path, metavar="PATH",
                   help="a file holding the SHA-256 (hex, as hash-key prints it) of the token /metrics asks "
                        "for: Authorization: Bearer TOKEN, or basic auth with TOKEN as the password; else 401")
    p.add_argument("--metrics-tls", action=argparse.BooleanOptionalAction, default=None,
                   help="serve /metrics over HTTPS with the API's certificate and key (--tls-cert, --tls-key; "
                        "loaded again on SIGHUP too); default: when the API has them")
    p.add_argument("--allow-anonymous-metrics", action="store_true", default=None,
                   help="serve /metrics (it names the keys) on an address other than loopback without a "
                        "token (refused otherwise)")
    p.add_argument("--allow-remote-images", action="store_true", default=None,
                   help="fetch the http(s) image URLs of chat messages (default: refused with a 400; data "
                        "URLs are always taken)")
    p.add_argument("--health-interval-s", type=_seconds, metavar="S",
                   help=f"how often every upstream's models are checked (default {d.health_interval_s:g})")
    p.add_argument("--health-timeout-s", type=_seconds, metavar="S",
                   help=f"timeout of each readiness check (default {d.health_timeout_s:g})")
    p.add_argument("--health-unhealthy-threshold", type=_positive, metavar="N",
                   help="failed checks in a row (late or unreachable) before an upstream is taken out "
                        f"(default {d.health_unhealthy_threshold}); a request that cannot reach it takes it "
                        "out at once")
    p.add_argument("--health-healthy-threshold", type=_positive, metavar="N",
                   help="passed checks in a row before an upstream that was out comes back "
                        f"(default {d.health_healthy_threshold})")
    p.add_argument("--max-concurrent-upstream", type=_positive, metavar="N",
                   help=f"requests in flight per upstream; more wait (default {d.max_concurrent_upstream})")
    p.add_argument("--max-queue", type=_non_negative, metavar="N",
                   help=f"requests that may wait for room; more get 503 (default {d.max_queue})")
    p.add_argument("--key-max-concurrent", type=_non_negative, metavar="N",
                   help="requests in flight per key that sets no max_concurrent of its own; more get 429 "
                        f"(default {d.key_max_concurrent}; 0: no bound)")
    p.add_argument("--queue-timeout-s", type=_seconds, metavar="S",
                   help=f"longest wait for room, then 503 (default {d.queue_timeout_s:g})")
    p.add_argument("--max-connections", type=_positive, metavar="N",
                   help=f"client connections at once; more are closed at once (default {d.max_connections})")
    p.add_argument("--header-timeout-s", type=_seconds, metavar="S",
                   help="a request's head must arrive whole within this long of the connection's start or "
                        f"of the previous response's end, else the connection is closed (default "
                        f"{d.header_timeout_s:g})")
    p.add_argument("--body-timeout-s", type=_seconds, metavar="S",
                   help=f"then its body, else 408 (default {d.body_timeout_s:g})")
    p.add_argument("--idle-timeout-s", type=_seconds, metavar="S",
                   help=f"a kept-alive connection without a new request is closed after this long (default "
                        f"{d.idle_timeout_s:g})")
    p.add_argument("--tls-cert", type=Path, metavar="PATH", help="HTTPS certificate (PEM; with --tls-key)")
    p.add_argument("--tls-key", type=Path, metavar="PATH", help="HTTPS private key (PEM; with --tls-cert)")
    p.add_argument("--allow-plaintext", action="store_true", default=None,
                   help="serve plain HTTP on an address other than loopback (refused otherwise: keys and "
                        "prompts would cross the network in the clear)")
    p.add_argument("--drain-timeout-s", type=_seconds, metavar="S",
                   help=f"on SIGTERM, requests in flight get this long to finish (default {d.drain_timeout_s:g})")
    p.add_argument("--engine-sockets", type=_engine_sockets, action="append", metavar="UPSTREAM=DIR",
                   help="an upstream on this host and the folder of its engine sockets: its streams go "
                        "through them, one line per engine step (repeat per upstream)")
    p.add_argument("--routing", choices=POLICIES,
                   help="how a model's replicas (upstreams, and engine sockets on this host) share its requests: "
                        "by the prompt's prefix with a load bound (cache_aware), by what each engine's cache "
                        "holds as its KV-cache events tell (kv_events: the engine sockets of this host; needs the "
                        "model's backend setting kv_events), the fewest in flight "
                        f"(least_loaded), or in turn (round_robin); default {d.routing_policy}")
    p.add_argument("--model-routing", type=_model_policy, action="append", metavar="NAME=POLICY",
                   help="a model's own routing policy (repeat per model)")
    p.add_argument("--routing-prefix-chars", type=_positive, metavar="N",
                   help="cache_aware: the prompt's leading characters that make its routing key "
                        f"(default {d.routing_prefix_chars})")
    p.add_argument("--routing-load-factor", type=_load_factor, metavar="F",
                   help="cache_aware: a replica takes a request while its requests in flight are under F times "
                        f"the mean (default {d.routing_load_factor:g})")
    p.add_argument("--routing-session-user", action="store_true", default=None,
                   help="cache_aware: the OpenAI user field pins a conversation to a replica, as the "
                        f"{SESSION_HEADER} header does")
    p.add_argument("--log-level", choices=LOG_LEVELS)
    p.add_argument("--event-loop", choices=EVENT_LOOPS,
                   help=f"asyncio's own event loop or uvloop (default {d.event_loop})")
    p.add_argument("--workers", type=_non_negative, metavar="N",
                   help="gateway processes sharing the port, the keys' limits and the admin API's holds "
                        f"(default {d.workers}: one per {CORES_PER_WORKER} cores this process may use, 1 to "
                        f"{MAX_AUTO_WORKERS})")
    return p


def hash_key_main(argv: list[str]) -> int:
    if argv:
        print("llmhost gateway hash-key: takes no arguments; give the key on stdin", file=sys.stderr)
        return 2
    key = sys.stdin.readline().strip()
    if len(key) < MIN_KEY_CHARS:
        print(f"llmhost gateway hash-key: the key on stdin must be at least {MIN_KEY_CHARS} characters",
              file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


# Flag dest -> GatewayConfig field, where they differ.
_FLAG_FIELDS = {"upstream": "upstreams", "model": "models", "routing": "routing_policy"}


def settings(args: argparse.Namespace) -> GatewayConfig:
    """GatewayConfig from defaults < the config file < flags given; ConfigError names what is wrong."""
    values: dict[str, Any] = load_config(args.config) if args.config is not None else {}
    names = {f.name for f in fields(GatewayConfig)}
    for dest, value in vars(args).items():
        name = _FLAG_FIELDS.get(dest, dest)
        if value is None or name not in names:
            continue
        if name == "upstreams":
            value = [join_host_port(v) for v in value]
        elif name == "models":
            value = list(dict.fromkeys(value))
        elif name in ("engine_sockets", "model_routing"):
            value = dict(value)
        values[name] = value
    config = GatewayConfig(**values)
    if not config.models:
        raise ConfigError("no model: give --model NAME (or models: in the config file)")
    if config.keys_file is None:
        raise ConfigError("no keys file: give --keys-file PATH (or keys_file: in the config file)")
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ConfigError("give both --tls-cert and --tls-key (tls.cert and tls.key), or neither")
    if config.metrics_tls and config.tls_cert is None:
        raise ConfigError("--metrics-tls (metrics_tls: true) serves /metrics with the API's certificate: give "
                          "--tls-cert and --tls-key too")
    if config.tls_cert is None and not is_loopback(config.listen[0]) and not config.allow_plaintext:
        raise ConfigError(f"--listen {join_host_port(config.listen)} without TLS would take API keys and prompts in "
                          "plain HTTP from the network: give --tls-cert and --tls-key, listen on loopback, or "
                          "say --allow-plaintext (allow_plaintext: true)")
    if (config.grpc_listen is not None and config.tls_cert is None and not is_loopback(config.grpc_listen[0])
            and not config.allow_plaintext):
        raise ConfigError(f"--grpc-listen {join_host_port(config.grpc_listen)} without TLS would take API keys and "
                          "prompts in the clear from the network: give --tls-cert and --tls-key, listen on loopback, "
                          "or say --allow-plaintext (allow_plaintext: true)")
    if (config.metrics_token_file is None and not is_loopback(config.metrics_listen[0])
            and not config.allow_anonymous_metrics):
        raise ConfigError(f"--metrics-listen {join_host_port(config.metrics_listen)} without a token would show "
                          "every key's name and traffic to the network: give --metrics-token-file, listen on "
                          "loopback, or say --allow-anonymous-metrics (allow_anonymous_metrics: true)")
    if len(set(config.upstreams)) != len(config.upstreams):
        raise ConfigError("an upstream is given twice")
    for name in config.model_routing:
        if name not in config.models:
            raise ConfigError(f"--model-routing {name}=...: {name} is not a served model ({', '.join(config.models)})")
    for upstream in config.engine_sockets:
        if upstream not in config.upstreams:
            raise ConfigError(f"--engine-sockets {upstream}=...: {upstream} is not an upstream "
                              f"({', '.join(config.upstreams)})")
    return config


def check_loop(name: str) -> None:
    """ConfigError when the event loop NAME (asyncio or uvloop) cannot be had here."""
    if name == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            raise ConfigError("--event-loop uvloop (event_loop: uvloop): uvloop is not installed in this "
                              "Python environment; install it, or use asyncio") from None


def run(main: Coroutine[Any, Any, None], loop: str) -> None:
    """MAIN to its end on a new event loop of kind LOOP (uvloop or asyncio)."""
    if loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


def check_tls(config: GatewayConfig) -> None:
    """Both TLS files readable and a matching certificate and key; ConfigError names the file."""
    if config.tls_cert is None or config.tls_key is None:
        return
    for flag, path in (("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key)):
        try:
            with path.open("rb") as f:
                f.read(1)
        except OSError as exc:
            raise ConfigError(f"{flag} {path}: cannot read it: {exc.strerror}") from None
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(config.tls_cert, config.tls_key)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"--tls-cert {config.tls_cert} / --tls-key {config.tls_key}: not a matching PEM "
                          f"certificate and key ({exc})") from None


def check_upstream_ca(config: GatewayConfig) -> None:
    """The upstream CA file readable and holding PEM certificates; ConfigError names it.
    Without one, upstreams off loopback are reached in plaintext: said on stderr."""
    path = config.upstream_ca
    if path is None:
        remote = [u for u in config.upstreams if not is_loopback(parse_host_port(u)[0])]
        if remote:
            print(f"llmhost gateway: warning: gRPC to {', '.join(remote)} is plaintext (no TLS, no server "
                  "check): give --upstream-ca with the CA of Triton's --grpc-server-cert", file=sys.stderr, flush=True)
        return
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--upstream-ca {path}: cannot read it: {exc.strerror}") from None
    try:
        found = ssl.create_default_context(cadata=data.decode("ascii")).get_ca_certs() if data.strip() else []
    except (ssl.SSLError, ValueError, UnicodeDecodeError):
        found = []
    if not found:
        raise ConfigError(f"--upstream-ca {path}: holds no PEM CA certificate") from None


def metrics_token(config: GatewayConfig) -> str | None:
    """The SHA-256 (hex) in the metrics token file, or None without one; ConfigError
    names the file when it cannot be read or holds anything else."""
    path = config.metrics_token_file
    if path is None:
        return None
    try:
        text = path.read_text(encoding="ascii").strip().lower()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not ASCII text"
        raise ConfigError(f"--metrics-token-file {path}: cannot read it: {reason}") from None
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise ConfigError(f"--metrics-token-file {path}: must hold the 64 hex digits of the token's SHA-256 "
                          "(`llmhost gateway hash-key` prints them)")
    return text


def metrics_tls(config: GatewayConfig) -> bool:
    """Whether /metrics is served over HTTPS: as asked (metrics_tls), else when the API is."""
    return config.tls_cert is not None if config.metrics_tls is None else config.metrics_tls


def reload_tls(contexts: list[ssl.SSLContext], config: GatewayConfig, what: str = "") -> bool:
    """The certificate and key files loaded again into the serving CONTEXTS (the API's,
    /metrics'): connections from now on get them. A pair that does not load leaves
    every context as it was. Says on stderr what happened (WHAT names the listeners)."""
    try:
        check_tls(config)
        for context in contexts:
            context.load_cert_chain(config.tls_cert, config.tls_key)  # type: ignore[arg-type]
    except (ConfigError, ssl.SSLError, OSError) as exc:
        print(f"llmhost gateway: SIGHUP: kept the certificate in use{what}: {exc}", file=sys.stderr, flush=True)
        return False
    print(f"llmhost gateway: SIGHUP: certificate reloaded from {config.tls_cert}{what}", file=sys.stderr, flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "hash-key":
        return hash_key_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        config = settings(args)
        check_tls(config)
        check_upstream_ca(config)
        token = metrics_token(config)
        check_loop(config.event_loop)
    except ConfigError as exc:
        print(f"llmhost gateway: {exc}", file=sys.stderr)
        return 2
    assert config.keys_file is not None
    try:
        keys = load_keys(config.keys_file)
    except KeysError as exc:
        print(f"llmhost gateway: {config.keys_file}: {exc}", file=sys.stderr)
        return 2
    if not keys:
        print(f"llmhost gateway: {config.keys_file}: holds no keys; nobody could use the gateway", file=sys.stderr)
        return 2
    place_text = os.environ.pop(WORKER_ENV, None)
    place = WorkerPlace.parse(place_text) if place_text else None
    count = place.count if place is not None else worker_count(config.workers)
    if place is None and count > 1:
        return supervise_main(config, keys, argv, count, token)
    if count > 1:
        config = worker_config(config, count)
    from llmhost.gateway.accesslog import AccessLog
    from llmhost.gateway.app import create_app
    from llmhost.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics(config.models)
    app = create_app(config, KeyStore(keys), metrics=metrics, access_log=AccessLog())
    _raise_open_files(config)
    if place is None:
        _say_serving(config, len(keys), "one process")
    run(_serve(app, metrics, config, place, token), config.event_loop)
    return 0


def _raise_open_files(config: GatewayConfig) -> None:
    # Every connection is a file; the rest (upstream channels, sockets, logs) gets room too.
    open_files = raise_open_files_limit(config.max_connections + OTHER_OPEN_FILES)
    if open_files < config.max_connections + OTHER_OPEN_FILES:
        print(f"llmhost gateway: warning: open files are limited to {open_files}, fewer than "
              f"--max-connections {config.max_connections} needs; raise the limit (LimitNOFILE)",
              file=sys.stderr, flush=True)


def _say_serving(config: GatewayConfig, keys: int, processes: str) -> None:
    scheme = "https" if config.tls_cert is not None else "http"
    print(f"llmhost gateway: OpenAI API on {scheme}://{join_host_port(config.listen)}/v1 for "
          f"{', '.join(config.models)} via {', '.join(config.upstreams)}; {keys} key(s); metrics on "
          f"{'https' if metrics_tls(config) else 'http'}://{join_host_port(config.metrics_listen)}/metrics"
          f"{' (token)' if config.metrics_token_file is not None else ''}; event loop "
          f"{config.event_loop}; {processes}", file=sys.stderr, flush=True)
    if config.grpc_listen is not None:
        print(f"llmhost gateway: Triton's gRPC API on {join_host_port(config.grpc_listen)}"
              f"{' (TLS)' if config.tls_cert is not None else ''}", file=sys.stderr, flush=True)


def supervise_main(config: GatewayConfig, keys: list[ApiKey], argv: list[str], count: int,
                   token: str | None = None) -> int:
    """COUNT worker processes on the port, each with a socket of its own (workers.supervise)."""
    from llmhost.gateway.metrics import metrics_app
    from llmhost.gateway.workers import supervise

    try:
        sockets = [listening_socket(*config.listen) for _ in range(count)]
    except OSError as exc:
        print(f"llmhost gateway: --listen {join_host_port(config.listen)}: cannot listen there: {exc.strerror}",
              file=sys.stderr)
        return 2

    contexts: list[ssl.SSLContext] = []

    def metrics_server(scrape: Any) -> Any:
        side = uvicorn_configs(None, metrics_app(scrape, token), config)[1]
        side.load()  # now, so that its SSL context exists for SIGHUP
        if side.ssl is not None:
            contexts.append(side.ssl)
        return _side_server(side)

    def reload_metrics_tls() -> None:
        # The workers load the API's certificate themselves (they get SIGHUP too).
        if contexts:
            reload_tls(contexts, config, " (/metrics)")

    _say_serving(config, len(keys), f"{count} worker processes")
    run(supervise(config, keys, argv, sockets, metrics_server, reload_metrics_tls), "asyncio")
    return 0


# Open files besides client connections: upstream channels and sockets, logs, libraries.
OTHER_OPEN_FILES = 1024


def uvicorn_configs(app: Any, metrics_app: Any, config: GatewayConfig) -> tuple[Any, Any]:
    """The API server's and the metrics server's uvicorn.Config."""
    import uvicorn

    # Both listeners bound their connections and close idle and slow ones.
    common: dict[str, Any] = {"log_level": config.log_level, "access_log": False, "server_header": False,
                              "lifespan": "off", "http": guarded_protocol(config),
                              "timeout_keep_alive": config.idle_timeout_s}
    tls: dict[str, Any] = {}
    if config.tls_cert is not None:
        tls = {"ssl_certfile": str(config.tls_cert), "ssl_keyfile": str(config.tls_key)}
    api = uvicorn.Config(app, host=config.listen[0], port=config.listen[1],
                         timeout_graceful_shutdown=max(1, round(config.drain_timeout_s)), **tls, **common)
    # /metrics over HTTPS with the same certificate and key, by default when the API has them.
    side = uvicorn.Config(metrics_app, host=config.metrics_listen[0], port=config.metrics_listen[1],
                          **(tls if metrics_tls(config) else {}), **common)
    return api, side


def _side_server(config: Any) -> Any:
    """A uvicorn.Server that leaves the signals to the process's own handlers."""
    import uvicorn

    class Beside(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Beside(config)


async def _serve(app: Any, metrics: Any, config: GatewayConfig, place: WorkerPlace | None = None,
                 token: str | None = None) -> None:
    """The API server (it takes SIGTERM/SIGINT: stops accepting, lets requests in flight
    finish for up to drain_timeout_s) and, beside it, the metrics server and the
    upstream health checks, which end with it. As worker PLACE: on its inherited
    socket, with the supervisor's shared limits and holds, and no metrics server of
    its own (the supervisor serves every worker's); it stops when the supervisor is gone."""
    import uvicorn

    from llmhost.gateway.metrics import metrics_app
    from llmhost.gateway.workers import join

    api_config, side_config = uvicorn_configs(app, metrics_app(metrics, token), config)
    api_config.load()  # now, so that the SSL contexts exist for SIGHUP
    contexts = [api_config.ssl] if api_config.ssl is not None else []
    if place is None:  # a worker serves no /metrics of its own
        side_config.load()
        if side_config.ssl is not None:
            contexts.append(side_config.ssl)
    if contexts:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_tls, contexts, config)
    api = uvicorn.Server(api_config)
    pool = app.state.gateway.pool
    sockets: list[socket.socket] | None = None
    beside = side = None
    if place is not None:
        shared = app.state.gateway.shared = await join(place, pool)
        sockets = [socket.socket(fileno=place.fd)]
        shared.reading.add_done_callback(lambda _: setattr(api, "should_exit", True))
    else:
        beside = _side_server(side_config)
        side = asyncio.ensure_future(beside.serve())
    health = asyncio.ensure_future(pool.run_health_checks())
    door = await _grpc_door(app, config)
    door_stopped = asyncio.ensure_future(_stop_with(api, door, config.drain_timeout_s)) if door else None
    try:
        await api.serve(sockets=sockets)
    finally:
        if door_stopped is not None:
            api.should_exit = True
            await door_stopped
        if beside is not None:
            beside.should_exit = True
        health.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await health
        if side is not None:
            await side
        for member in pool.members:
            close = getattr(member.client, "close", None)
            if close is not None:
                await close()


async def _stop_with(api: Any, door: Any, grace_s: float) -> None:
    """Stop the gRPC DOOR once the API server begins to stop (SIGTERM): no new calls,
    and those in flight get GRACE_S, as the API's requests do."""
    while not api.should_exit:
        await asyncio.sleep(0.2)
    await door.stop(grace_s)


async def _grpc_door(app: Any, config: GatewayConfig) -> Any:
    """The gRPC door (doors.grpc) of APP, started where config.grpc_listen names one;
    SystemExit(2) when it cannot listen there."""
    if config.grpc_listen is None:
        return None
    from llmhost.gateway.doors.grpc import start

    try:
        return await start(app.state.gateway, app.state.observers, config)
    except RuntimeError as exc:
        print(f"llmhost gateway: --grpc-listen {join_host_port(config.grpc_listen)}: cannot listen there: {exc}",
              file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    sys.exit(main())
