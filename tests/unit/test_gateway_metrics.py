"""The gateway's metrics: every response counted once with its status, model and
key name; stream TTFT and output tokens; 429s by key and limit; the upstreams'
up and outstanding gauges; labels bounded; the metrics listener."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmhost.gateway.app import create_app
from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.metrics import GatewayMetrics, metrics_app
from llmhost.gateway.routing.pool import UpstreamPool
from llmhost.gateway.upstreams.client import Piece
from llmhost.gateway.upstreams.request import BackendRequest
from tests.unit._gateway_fakes import KEY, Fake, chat, client, keystore


class Upstream:
    async def model_ready(self, model: str) -> bool:
        return True

    async def generate(self, req: BackendRequest) -> AsyncIterator[Piece]:
        if req.sampling.get("temperature") == 1.9:
            raise RuntimeError("a bug of ours")
        yield Piece(["he"], [""], 3, [2], False)
        yield Piece(["llo"], ["length"], 3, [3], True)  # per response: 2 + 3


def _samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_responses_are_counted_by_model_key_and_status():
    metrics = GatewayMetrics(["m"])
    app = create_app(GatewayConfig(upstreams=["x:1"], models=["m"]), keystore(), Upstream(), metrics)

    async def run() -> None:
        async with client(app) as c:
            assert (await c.post("/v1/chat/completions", content=chat())).status_code == 200
            r = await c.post("/v1/chat/completions", content=chat(stream=True))
            assert r.status_code == 200 and r.text.endswith("[DONE]\n\n")
            assert (await c.post("/v1/chat/completions", content=chat(model="x" * 40))).status_code == 404
            r = await c.post("/v1/chat/completions", content=chat(), headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            assert (await c.post("/v1/chat/completions", content=chat(temperature=1.9))).status_code == 500
            assert (await c.post("/v1/chat/completions", content=chat(temperature=-1))).status_code == 400

    asyncio.run(run())
    got = _samples(metrics)
    total = "llmhost_gateway_requests_total"
    assert got[(total, (("key", "alice"), ("model", "m"), ("status", "200")))] == 2
    # A model that is not served is "unknown": a client cannot make new series.
    assert got[(total, (("key", "alice"), ("model", "unknown"), ("status", "404")))] == 1
    assert got[(total, (("key", ""), ("model", "unknown"), ("status", "401")))] == 1
    assert got[(total, (("key", "alice"), ("model", "m"), ("status", "500")))] == 1
    assert got[(total, (("key", "alice"), ("model", "m"), ("status", "400")))] == 1  # refused while parsing
    assert got[("llmhost_gateway_output_tokens_total", (("key", "alice"), ("model", "m")))] == 10  # 5 + 5
    assert got[("llmhost_gateway_time_to_first_token_seconds_count", (("model", "m"),))] == 1  # the stream only
    assert got[("llmhost_gateway_request_duration_seconds_count", (("model", "m"),))] == 4  # 200, 200, 500, 400
    assert not any("x" * 40 in str(labels) for _, labels in got)


def test_rate_limited_requests_are_counted_by_key_and_limit():
    metrics = GatewayMetrics(["m"])
    app = create_app(GatewayConfig(upstreams=["x:1"], models=["m"]), keystore(rpm=1), Upstream(), metrics)

    async def run() -> None:
        async with client(app) as c:
            assert (await c.post("/v1/chat/completions", content=chat())).status_code == 200
            assert (await c.post("/v1/chat/completions", content=chat())).status_code == 429

    asyncio.run(run())
    got = _samples(metrics)
    assert got[("llmhost_gateway_rate_limited_total", (("key", "alice"), ("limit", "rpm")))] == 1
    assert got[("llmhost_gateway_requests_total", (("key", "alice"), ("model", "m"), ("status", "429")))] == 1


def test_upstream_gauges_show_up_down_and_outstanding():
    metrics = GatewayMetrics(["m"])
    up, down = Fake("a"), Fake("b", reachable=False)
    up.gate = asyncio.Event()
    pool = UpstreamPool([("a:1", up), ("b:1", down)], ["m"])
    app = create_app(GatewayConfig(upstreams=["a:1", "b:1"], models=["m"]), keystore(), pool, metrics)

    async def run() -> dict[Any, float]:
        async with client(app) as c:
            task = asyncio.ensure_future(c.post("/v1/chat/completions", content=chat()))
            while up.started == 0:
                await asyncio.sleep(0.01)
            during = _samples(metrics)
            up.gate.set()
            assert (await task).status_code == 200
        return during

    during = asyncio.run(run())
    assert during[("llmhost_gateway_upstream_up", (("upstream", "a:1"),))] == 1
    assert during[("llmhost_gateway_upstream_up", (("upstream", "b:1"),))] == 0
    assert during[("llmhost_gateway_upstream_outstanding", (("upstream", "a:1"),))] == 1
    after = _samples(metrics)
    assert after[("llmhost_gateway_upstream_outstanding", (("upstream", "a:1"),))] == 0


def test_the_metrics_listener_serves_only_metrics():
    metrics = GatewayMetrics(["m"])
    metrics.watch_pool(UpstreamPool([("a:1", Fake())], ["m"]))

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=metrics_app(metrics)),
                                     base_url="http://m") as c:
            r = await c.get("/metrics")
            assert r.status_code == 200 and 'llmhost_gateway_upstream_up{upstream="a:1"} 0.0' in r.text
            assert r.headers["content-type"].startswith("text/plain")
            assert (await c.get("/v1/models")).status_code == 404
            assert (await c.post("/metrics")).status_code == 404

    asyncio.run(run())


def test_metrics_never_hold_the_key_or_the_prompt():
    metrics = GatewayMetrics(["m"])
    app = create_app(GatewayConfig(upstreams=["x:1"], models=["m"]), keystore(), Upstream(), metrics)
    prompt = "the secret prompt text 4711"

    async def run() -> None:
        async with client(app) as c:
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]})
            assert (await c.post("/v1/chat/completions", content=body)).status_code == 200

    asyncio.run(run())
    text = metrics.render().decode()
    assert KEY not in text and prompt not in text and "alice" in text
