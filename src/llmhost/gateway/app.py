"""The ASGI app: every HTTP door (``doors``: OpenAI's API, Triton's native
generate/health/metadata API, the admin API) on one Starlette app, in front of our
backend on a pool of Triton servers (``routing.pool``), with the request record's
middleware (metrics, access log) around them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmhost.gateway.config import GatewayConfig, is_loopback, parse_host_port
from llmhost.gateway.doors.admin import AdminApi
from llmhost.gateway.doors.native import NativeApi
from llmhost.gateway.doors.openai.api import OpenAiApi, _counted, _estimate
from llmhost.gateway.doors.openai.responses import ResponsesApi
from llmhost.gateway.doors.openai.tokenize import TokenizeApi
from llmhost.gateway.errors import ApiError
from llmhost.gateway.httpio import error_response
from llmhost.gateway.keys import KeyStore
from llmhost.gateway.limits import KeyLimiter
from llmhost.gateway.record import Observer, RequestMiddleware
from llmhost.gateway.routing.kvevents import KvEventsIndex
from llmhost.gateway.routing.policies import KV_EVENTS
from llmhost.gateway.routing.pool import PoolSettings, UpstreamPool
from llmhost.gateway.upstreams.client import Upstream


def make_pool(config: GatewayConfig, upstream: Any = None,
              on_line: Callable[[str, int, float], None] | None = None) -> UpstreamPool:
    """The pool for CONFIG: real upstreams, or UPSTREAM (a pool, or one client, for tests).
    ON_LINE sees each engine socket line (upstream.Upstream)."""
    if isinstance(upstream, UpstreamPool):
        return upstream
    settings = PoolSettings(max_concurrent=config.max_concurrent_upstream, max_queue=config.max_queue,
                            queue_timeout_s=config.queue_timeout_s, interval_s=config.health_interval_s,
                            timeout_s=config.health_timeout_s,
                            unhealthy_threshold=config.health_unhealthy_threshold,
                            healthy_threshold=config.health_healthy_threshold)
    # What this host's engines' caches hold, for the kv_events policy: one index for every
    # upstream with engine sockets here.
    kv_events = KvEventsIndex() if config.engine_sockets else None
    if upstream is not None:
        members = [(config.upstreams[0], upstream)]
    else:
        members = [(t, Upstream(t, config.health_timeout_s, config.engine_sockets.get(t), on_line,
                                upstream_ca(config, t), kv_events)) for t in config.upstreams]
    pool = UpstreamPool(members, config.models, settings)
    pool.kv_events = kv_events
    pool.kv_events_models = [m for m in config.models if config.routing.policy_of(m) == KV_EVENTS]
    return pool


def upstream_ca(config: GatewayConfig, target: str) -> bytes | None:
    """The CA certificates that verify TARGET's gRPC over TLS: CONFIG's upstream_ca for
    an upstream off loopback; None (plaintext) on loopback or without one."""
    if config.upstream_ca is None or is_loopback(parse_host_port(target)[0]):
        return None
    return config.upstream_ca.read_bytes()


def create_app(config: GatewayConfig, keys: KeyStore, upstream: Any = None, metrics: Any = None,
               access_log: Observer | None = None, limiter: KeyLimiter | None = None) -> Starlette:
    """The gateway's ASGI app. UPSTREAM: an UpstreamPool, one upstream client (tests),
    or None for CONFIG's upstreams. METRICS (a GatewayMetrics) and ACCESS_LOG observe
    every finished request."""
    pool = make_pool(config, upstream, metrics.engine_line if metrics is not None else None)
    gw = OpenAiApi(config, keys, pool, limiter)
    native = NativeApi(gw)
    responses_api = ResponsesApi(gw, lambda req, request, rec: _counted(gw._pieces(req, request), rec), _estimate)
    observers: list[Observer] = []
    if metrics is not None:
        metrics.watch_pool(pool)
        observers.append(metrics)
    if access_log is not None:
        observers.append(access_log)

    async def on_missing(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        if status == 405:
            return error_response(ApiError(405, f"method {request.method} is not allowed on {request.url.path}",
                                           "invalid_request_error", None, "method_not_allowed"))
        return await gw.not_found(request)

    async def on_error(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}; the gateway log has the "
                                       "details", "server_error", None, "internal_error"))

    routes = [
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gw.model, methods=["GET"]),
        Route("/v1/chat/completions", gw.chat, methods=["POST"]),
        Route("/v1/completions", gw.completions, methods=["POST"]),
        Route("/v1/embeddings", gw.embeddings, methods=["POST"]),
        Route("/v1/responses", responses_api.create, methods=["POST"]),
        *TokenizeApi(gw).routes(),
        *native.routes(),
        *AdminApi(gw).routes(),
    ]
    app = Starlette(routes=routes, exception_handlers={404: on_missing, 405: on_missing, Exception: on_error},
                    middleware=[Middleware(RequestMiddleware, observers=observers)])
    app.state.gateway = gw
    app.state.observers = observers  # for the gRPC door (doors.grpc), which runs beside the app
    return app
