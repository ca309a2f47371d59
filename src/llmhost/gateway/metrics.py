"""The gateway's Prometheus metrics, served on their own listener (``--metrics-listen``,
``GET /metrics`` only). They name the keys, so the listener can ask for a token
(``--metrics-token-file``: a file holding the SHA-256 of it, as ``llmhost gateway
hash-key`` prints it): a scrape then needs ``Authorization: Bearer TOKEN`` (or basic
auth with TOKEN as the password, any user name), else 401.

- ``llmhost_gateway_requests_total{model,key,status}``: every response, once, when
  it has been sent (a stream: at its end; a client that left first: 499).
- ``llmhost_gateway_request_duration_seconds{model}``: arrival to last byte.
- ``llmhost_gateway_time_to_first_token_seconds{model}``: streams, arrival to the
  first token from the upstream.
- ``llmhost_gateway_output_tokens_total{model,key}``: tokens generated.
- ``llmhost_gateway_tokens_per_event{model}``: streams, output tokens of one
  completion in each response from the upstream (each is one event to the
  client; with n > 1, the completion that got the most): 1 while every engine step
  reaches the client as its own event.
- ``llmhost_gateway_upstream_transit_seconds{model}``: engine socket streams, from
  the backend writing a response to the gateway reading it (wall clocks of one host).
- ``llmhost_gateway_rate_limited_total{key,limit}``: 429s by key and limit (rpm,
  tpm, max_concurrent).
- ``llmhost_gateway_upstream_up{upstream}``: 1 while the upstream is in service, not
  draining, and has at least one served model ready; else 0.
- ``llmhost_gateway_upstream_state{upstream,state}``: 1 for the upstream's state
  (``in_service``, ``draining`` or ``out``), 0 for the other two.
- ``llmhost_gateway_panic_routed_total``: requests sent to an upstream out of service
  because none was in service for their model (the pool's panic mode).
- ``llmhost_gateway_upstream_outstanding{upstream}``: requests in flight on it.
- ``llmhost_gateway_routing_decisions_total{model,reason}``: requests routed to a
  replica, by the decision's reason (``llmhost.gateway.routing.policies``): ``prefix`` or
  ``session`` (the routing key's replica), ``load_bound`` (that one was over its load
  bound), ``no_key``, ``no_match`` (kv_events: no engine held a block of the prompt),
  ``least_loaded``, ``round_robin``.

With several worker processes (``workers``), the supervisor serves every worker's
counters and histograms in one /metrics (prometheus_client's multiprocess mode), and
the upstream gauges from every worker's view: ``up`` and ``state`` as the share of
workers that see the upstream so, ``outstanding`` and ``panic_routed`` summed.

Labels only take values the gateway knows: a model that is not served is
``unknown`` and an unauthenticated request has the key ``""``, so a client cannot
grow the series without bound.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import Receive, Scope, Send

from llmhost.gateway.record import RequestRecord
from llmhost.gateway.routing.policies import REASONS
from llmhost.gateway.routing.pool import STATES

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
EVENT_TOKEN_BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50, 100)
TRANSIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
UNKNOWN_MODEL = "unknown"


# The upstream gauges: (target, up, requests in flight, {state: value}) per upstream,
# and the requests routed in panic mode.
PoolRows = tuple[list[tuple[str, float, float, dict[str, float]]], float]


def pool_rows(pool: Any) -> PoolRows:
    """The upstream gauges of one pool (``pool.view()``, ``pool.panic_routed``)."""
    rows = [(r["target"], 1.0 if r["up"] else 0.0, float(r["outstanding"]),
             {s: 1.0 if s == r["state"] else 0.0 for s in STATES}) for r in pool.view()]
    return rows, float(pool.panic_routed)


class PoolCollector(Collector):
    """The upstream gauges, read from ROWS (a function) at each scrape."""

    def __init__(self, rows: Callable[[], PoolRows]) -> None:
        self.rows = rows

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily("llmhost_gateway_upstream_up", "1 while the upstream is in service, not draining "
                               "and has a served model ready, else 0 (with several workers: the share of "
                               "workers that route to it)", labels=["upstream"])
        outstanding = GaugeMetricFamily("llmhost_gateway_upstream_outstanding", "Requests of the gateway in "
                                        "flight on the upstream", labels=["upstream"])
        state = GaugeMetricFamily("llmhost_gateway_upstream_state", "1 for the upstream's state in the pool "
                                  "(in_service, draining, out), 0 for the others (with several workers: the "
                                  "share of workers that see it so)", labels=["upstream", "state"])
        rows, panic_routed = self.rows()
        for target, is_up, count, states in rows:
            up.add_metric([target], is_up)
            outstanding.add_metric([target], count)
            for name in STATES:
                state.add_metric([target, name], states.get(name, 0.0))
        yield up
        yield outstanding
        yield state
        yield CounterMetricFamily("llmhost_gateway_panic_routed", "Requests sent to an upstream out of service "
                                  "because none was in service for their model", value=panic_routed)


class GatewayMetrics:
    def __init__(self, models: list[str]) -> None:
        self.models = set(models)
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("llmhost_gateway_requests", "Responses of the gateway by model, key name and "
                                "HTTP status", ["model", "key", "status"], registry=self.registry)
        self.duration = Histogram("llmhost_gateway_request_duration_seconds", "Time from a request's arrival to "
                                  "its last byte sent", ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("llmhost_gateway_time_to_first_token_seconds", "Streams: time from a request's "
                              "arrival to its first token from the upstream", ["model"], buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.output_tokens = Counter("llmhost_gateway_output_tokens", "Tokens generated for the gateway's "
                                     "clients", ["model", "key"], registry=self.registry)
        self.tokens_per_event = Histogram("llmhost_gateway_tokens_per_event", "Streams: output tokens in each "
                                          "response from the upstream, each one event to the client", ["model"],
                                          buckets=EVENT_TOKEN_BUCKETS, registry=self.registry)
        self.transit = Histogram("llmhost_gateway_upstream_transit_seconds", "Engine socket streams: time from "
                                 "the backend writing a response to the gateway reading it", ["model"],
                                 buckets=TRANSIT_BUCKETS, registry=self.registry)
        self._transit_of: dict[str, Any] = {}
        self.rate_limited = Counter("llmhost_gateway_rate_limited", "Requests refused (429) by a key's limit",
                                    ["key", "limit"], registry=self.registry)
        self.routing = Counter("llmhost_gateway_routing_decisions", "Requests routed to a replica, by the "
                               "decision's reason (prefix, session, load_bound, no_key, no_match, least_loaded, "
                               "round_robin)",
                               ["model", "reason"], registry=self.registry)
        for model in sorted(self.models):  # at zero from the start, so rate() sees the first decision
            for reason in REASONS:
                self.routing.labels(model, reason)

    def watch_pool(self, pool: Any) -> None:
        """Serve the upstream gauges of POOL (anything with ``view()`` and ``panic_routed``)."""
        self.registry.register(PoolCollector(lambda: pool_rows(pool)))
        pool.on_route = self.routed

    def routed(self, model: str, reason: str) -> None:
        """One request routed for REASON (the pool's on_route)."""
        self.routing.labels(self.model_label(model), reason if reason in REASONS else "no_key").inc()

    def engine_line(self, model: str, tokens: int, transit_s: float) -> None:
        """One engine socket line read (upstream.Upstream's on_line)."""
        child = self._transit_of.get(model)
        if child is None:
            child = self._transit_of[model] = self.transit.labels(self.model_label(model))
        child.observe(max(0.0, transit_s))

    def model_label(self, model: str | None) -> str:
        return model if model in self.models else UNKNOWN_MODEL

    def __call__(self, rec: RequestRecord, scope: Scope) -> None:
        """Observe one finished request (a ``record.RequestMiddleware`` observer)."""
        model = self.model_label(rec.model)
        self.requests.labels(model, rec.key, str(rec.status)).inc()
        self.duration.labels(model).observe(rec.duration_s)
        if rec.ttft_s is not None:
            self.ttft.labels(model).observe(rec.ttft_s)
        if rec.output_tokens:
            self.output_tokens.labels(model, rec.key).inc(rec.output_tokens)
        if rec.ttft_s is not None and rec.event_tokens:
            per_event = self.tokens_per_event.labels(model)
            for tokens in rec.event_tokens:
                per_event.observe(tokens)
        if rec.limited is not None:
            self.rate_limited.labels(rec.key, rec.limited).inc()

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))

    async def scrape(self) -> bytes:
        return self.render()


def presented_token(authorization: bytes | None) -> str | None:
    """The token of an Authorization header: a Bearer token, or a basic-auth password
    (the user name is not checked); None for anything else."""
    if not authorization:
        return None
    scheme, _, value = authorization.decode("latin-1").strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer" and value:
        return value
    if scheme.lower() == "basic" and value:
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, sep, password = decoded.partition(":")
        return password if sep and password else None
    return None


def token_allowed(authorization: bytes | None, token_sha256: str) -> bool:
    """Whether AUTHORIZATION carries the token whose hex SHA-256 is TOKEN_SHA256
    (compared in constant time)."""
    token = presented_token(authorization)
    digest = hashlib.sha256((token or "").encode("utf-8")).hexdigest()
    return token is not None and hmac.compare_digest(digest, token_sha256.lower())


def metrics_app(metrics: GatewayMetrics | Callable[[], Awaitable[bytes]], token_sha256: str | None = None
                ) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The metrics listener: ``GET /metrics`` (METRICS' own, or what a scrape function
    returns: the supervisor of several workers); anything else 404. With TOKEN_SHA256
    (the hex SHA-256 of a token), a request without that token gets 401 and nothing else."""
    scrape = metrics.scrape if isinstance(metrics, GatewayMetrics) else metrics

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers: list[tuple[bytes, bytes]] = []
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if token_sha256 is not None and not token_allowed(authorization, token_sha256):
            status, body, ctype = 401, b"unauthorized: /metrics needs its token (Authorization: Bearer)\n", "text/plain"
            headers.append((b"www-authenticate", b'Bearer realm="metrics"'))
        elif scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            status, body, ctype = 200, await scrape(), CONTENT_TYPE_LATEST
        else:
            status, body, ctype = 404, b"not found: only GET /metrics is served here\n", "text/plain"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode()),
                                *headers]})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    return app
