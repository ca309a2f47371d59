"""The gateway's admin API: a key with `admin: true` holds an upstream out of the pool
(no new requests; its state reads draining) and returns it; other keys get 403."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.keys import KeysError, KeyStore, hash_key, parse_keys
from llmhost.gateway.routing.pool import PoolSettings, UpstreamPool
from tests.unit._gateway_fakes import KEY, Fake, chat, client, make_app

ADMIN_KEY = "admin-key-0123456789abcdef"


def _keys() -> KeyStore:
    return KeyStore(parse_keys(json.dumps({"keys": [{"name": "alice", "sha256": hash_key(KEY)},
                                                    {"name": "ops", "sha256": hash_key(ADMIN_KEY), "admin": True}]})))


def _app(*fakes: Fake) -> tuple[Any, UpstreamPool]:
    pool = UpstreamPool([(f"{f.name}:1", f) for f in fakes], ["m"], PoolSettings())
    config = GatewayConfig(upstreams=[m.target for m in pool.members], models=["m"], max_body_bytes=4096,
                           routing_policy="least_loaded")
    return make_app(pool, _keys(), config=config), pool


def _text(r: Any) -> str:
    return r.json()["choices"][0]["message"]["content"]


def test_a_held_upstream_gets_no_new_requests_until_it_is_returned():
    a, b = Fake("a"), Fake("b")
    app, pool = _app(a, b)

    async def run() -> None:
        async with client(app) as c, client(app, ADMIN_KEY) as admin:
            await pool.check()
            r = await admin.post("/admin/upstreams/a:1/hold")
            assert r.status_code == 200, r.text
            assert r.json()["upstreams"][0] == {"target": "a:1", "state": "draining", "held": True, "outstanding": 0}
            for _ in range(3):
                assert _text(await c.post("/v1/chat/completions", content=chat())) == "hello from b!"
            await pool.check()  # a passing check does not return a held upstream
            assert _text(await c.post("/v1/chat/completions", content=chat())) == "hello from b!"
            r = await admin.post("/admin/upstreams/a:1/return")
            assert r.json()["upstreams"][0]["state"] == "in_service"
            assert _text(await c.post("/v1/chat/completions", content=chat())) == "hello from a!"

    asyncio.run(run())
    assert (a.calls, b.calls) == (1, 4)


def test_requests_in_flight_finish_on_a_held_upstream_and_are_counted():
    a = Fake("a")
    a.gate = asyncio.Event()
    app, pool = _app(a, Fake("b"))

    async def run() -> None:
        async with client(app) as c, client(app, ADMIN_KEY) as admin:
            await pool.check()
            first = asyncio.ensure_future(c.post("/v1/chat/completions", content=chat(stream=True)))
            while a.started == 0:
                await asyncio.sleep(0.01)
            held = (await admin.post("/admin/upstreams/a:1/hold")).json()["upstreams"][0]
            assert held["outstanding"] == 1 and held["state"] == "draining"
            a.gate.set()
            r = await first
            assert r.status_code == 200 and "hello from a" in r.text
            assert (await admin.get("/admin/upstreams")).json()["upstreams"][0]["outstanding"] == 0

    asyncio.run(run())


def test_holding_the_only_upstream_turns_requests_away_with_503():
    app, pool = _app(Fake("a"))

    async def run() -> None:
        async with client(app) as c, client(app, ADMIN_KEY) as admin:
            await pool.check()
            await admin.post("/admin/upstreams/a:1/hold")
            r = await c.post("/v1/chat/completions", content=chat())
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_upstream"

    asyncio.run(run())


def test_only_admin_keys_may_use_it_and_unknown_upstreams_are_404():
    app, _ = _app(Fake("a"))

    async def run() -> None:
        async with client(app) as c, client(app, None) as nobody, client(app, ADMIN_KEY) as admin:
            for path in ("/admin/upstreams/a:1/hold", "/admin/upstreams/a:1/return"):
                r = await c.post(path)
                assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only", r.text
                assert (await nobody.post(path)).status_code == 401
            assert (await c.get("/admin/upstreams")).status_code == 403
            r = await admin.post("/admin/upstreams/nowhere:1/hold")
            assert r.status_code == 404 and "nowhere:1" in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == "target"
            assert (await admin.get("/admin/upstreams")).json()["upstreams"][0]["held"] is False

    asyncio.run(run())


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_admin_in_the_keys_file_must_be_a_boolean(value):
    with pytest.raises(KeysError, match=r"keys\[0\]\.admin must be true or false"):
        parse_keys(json.dumps({"keys": [{"name": "ops", "sha256": "0" * 64, "admin": value}]}))
