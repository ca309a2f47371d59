"""Routing among a model's replicas (llmhost.gateway.routing): cache-aware by the
prompt's prefix with bounded loads, least loaded, round robin; at the pool's level
(upstreams), at an upstream's engine sockets, and through the gateway's API."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from llmhost.gateway.cli import build_parser, settings
from llmhost.gateway.config import ConfigError, GatewayConfig, parse_config
from llmhost.gateway.metrics import GatewayMetrics
from llmhost.gateway.routing.inflight import socket_load_name
from llmhost.gateway.routing.policies import (
    CACHE_AWARE,
    LEAST_LOADED,
    ROUND_ROBIN,
    Chooser,
    Route,
    load_bound,
    prompt_key_text,
    rendezvous_order,
    route_key,
)
from llmhost.gateway.routing.pool import PoolSettings, UpstreamPool
from llmhost.gateway.upstreams.client import Upstream
from tests.unit._gateway_fakes import Fake, client, keystore, make_app

NAMES = ["10.0.0.5:8001", "10.0.0.6:8001", "10.0.0.7:8001"]


def _key(text: str, session: str | None = None) -> bytes:
    key, _ = route_key("m", text, session)
    assert key is not None
    return key


def _pick(chooser: Chooser, route: Route, loads: dict[str, int]) -> str:
    return chooser.choose(route, "m", sorted(loads), lambda t: t, lambda t: loads[t])


# --- the key -----------------------------------------------------------------------


def test_a_conversations_later_turns_keep_the_key_of_its_first_user_message():
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Plan a trip to Rome."}]
    later = [*first, {"role": "assistant", "content": "Day 1: the Forum."}, {"role": "user", "content": "And day 2?"}]
    other = [first[0], {"role": "user", "content": "Plan a trip to Oslo."}]
    text = prompt_key_text(None, first, None, 2048)
    assert text is not None and "Rome" in text
    assert prompt_key_text(None, later, None, 2048) == text
    assert prompt_key_text(None, other, None, 2048) != text


def test_a_prompts_key_is_its_start_cut_at_prefix_chars():
    shared = "x" * 300
    assert prompt_key_text(shared + "tail one", None, None, 256) == prompt_key_text(shared + "tail two", None, None,
                                                                                    256)
    assert prompt_key_text(shared + "tail one", None, None, 1024) != prompt_key_text(shared + "tail two", None,
                                                                                     None, 1024)
    ids = list(range(100))
    assert prompt_key_text(None, None, ids, 40) == prompt_key_text(None, None, [*ids[:10], 999], 40)
    assert prompt_key_text(None, None, None, 40) is None


def test_a_session_hint_makes_the_key_whatever_the_prompt():
    a, kind_a = route_key("m", "prompt one", "conversation-7")
    b, kind_b = route_key("m", "prompt two", "conversation-7")
    assert a == b and kind_a == kind_b == "session"
    assert route_key("m", "prompt one", None)[1] == "prefix"
    assert route_key("m", "prompt one", None)[0] != a
    assert route_key("m", None, None) == (None, "prefix")
    # The same prompt on another model is another key.
    assert route_key("m", "prompt one", None)[0] != route_key("n", "prompt one", None)[0]


# --- consistent hashing with bounded loads ---------------------------------------------


def test_the_order_of_a_key_is_the_same_in_another_process():
    key = _key("a shared system prompt")
    code = ("import sys; from llmhost.gateway.routing.policies import rendezvous_order; "
            f"print(rendezvous_order(bytes.fromhex('{key.hex()}'), {NAMES!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == str(rendezvous_order(key, NAMES))


def test_removing_a_replica_moves_only_the_keys_it_held():
    keys = [_key(f"prefix {i}") for i in range(300)]
    before = {k: NAMES[rendezvous_order(k, NAMES)[0]] for k in keys}
    fewer = [n for n in NAMES if n != NAMES[1]]
    after = {k: fewer[rendezvous_order(k, fewer)[0]] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == NAMES[1] for k in moved)
    # Every replica holds some of the keys.
    assert set(before.values()) == set(NAMES)
    assert min(Counter(before.values()).values()) > 60


def test_the_same_prefix_goes_to_the_same_replica_and_prefixes_spread():
    chooser = Chooser()
    loads = dict.fromkeys(NAMES, 0)
    picks = {i: _pick(chooser, Route(CACHE_AWARE, _key(f"document {i}")), loads) for i in range(60)}
    again = {i: _pick(chooser, Route(CACHE_AWARE, _key(f"document {i}")), loads) for i in range(60)}
    assert picks == again
    assert set(picks.values()) == set(NAMES)


def test_a_replica_over_its_load_bound_passes_the_key_to_the_next_in_its_order():
    key = _key("a hot prefix")
    order = [NAMES[i] for i in rendezvous_order(key, NAMES)]
    chooser = Chooser()
    route = Route(CACHE_AWARE, key, load_factor=1.25)
    assert _pick(chooser, route, dict.fromkeys(NAMES, 0)) == order[0]
    assert route.reason == "prefix"
    # 10 in flight on the first choice, none elsewhere: bound ceil(1.25 * 11 / 3) = 5.
    loads = {order[0]: 10, order[1]: 0, order[2]: 0}
    assert load_bound(list(loads.values()), 1.25) == 5
    route = Route(CACHE_AWARE, key, load_factor=1.25)
    assert _pick(chooser, route, loads) == order[1]
    assert route.reason == "load_bound"
    # Under the bound it stays.
    route = Route(CACHE_AWARE, key, load_factor=1.25)
    assert _pick(chooser, route, {order[0]: 3, order[1]: 2, order[2]: 2}) == order[0]
    assert route.reason == "prefix"


def test_bounded_loads_keep_every_replica_near_its_share_under_one_hot_key():
    key = _key("one system prompt for everyone")
    chooser = Chooser()
    loads = dict.fromkeys(NAMES, 0)
    for _ in range(300):  # requests that never finish: the worst case for the bound
        loads[_pick(chooser, Route(CACHE_AWARE, key, load_factor=1.25), loads)] += 1
    # No replica past 1.25 times its share (100), and the key's first choice full to it.
    assert max(loads.values()) <= 1.25 * 300 / 3 + 1
    assert loads[NAMES[rendezvous_order(key, NAMES)[0]]] >= 1.25 * 300 / 3 - 1


def test_without_a_key_cache_aware_takes_the_least_loaded():
    route = Route(CACHE_AWARE, None)
    assert _pick(Chooser(), route, {"a": 3, "b": 1, "c": 2}) == "b"
    assert route.reason == "no_key"


def test_least_loaded_and_round_robin():
    route = Route(LEAST_LOADED)
    assert _pick(Chooser(), route, {"a": 3, "b": 1, "c": 2}) == "b"
    assert route.reason == LEAST_LOADED
    chooser = Chooser()
    picks = [_pick(chooser, Route(ROUND_ROBIN), {"a": 9, "b": 0, "c": 0}) for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_a_load_bound_at_any_level_is_what_the_request_records():
    route = Route(CACHE_AWARE, _key("p"))
    route.decided("load_bound")
    route.decided("prefix")
    assert route.reason == "load_bound"


# --- engine sockets of an upstream on this host ------------------------------------------------


def test_an_upstream_picks_the_engine_socket_of_the_requests_key(tmp_path: Path):
    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("1-m_0.sock", "1-m_1.sock"):
        (folder / name).touch()
    upstream = Upstream("127.0.0.1:1", 0.5, tmp_path)
    keys = [_key(f"doc {i}") for i in range(40)]
    first = [upstream.engine_socket("m", Route(CACHE_AWARE, k)) for k in keys]
    assert first == [upstream.engine_socket("m", Route(CACHE_AWARE, k)) for k in keys]
    assert {p.name for p in first if p is not None} == {"1-m_0.sock", "1-m_1.sock"}
    # Without a route: in turn.
    assert [upstream.engine_socket("m").name for _ in range(4)] == ["1-m_0.sock", "1-m_1.sock"] * 2
    # A busy socket passes the key on.
    key = keys[0]
    home = upstream.engine_socket("m", Route(CACHE_AWARE, key))
    assert home is not None
    busy = socket_load_name(home)
    with upstream.in_flight.holding(busy), upstream.in_flight.holding(busy), upstream.in_flight.holding(busy):
        route = Route(CACHE_AWARE, key)
        other = upstream.engine_socket("m", route)
        assert other is not None and other != home and route.reason == "load_bound"
    assert upstream.engine_socket("m", Route(CACHE_AWARE, key)) == home


# --- through the pool and the gateway ---------------------------------------------------------------


def _gateway(policy: str | None = None, **config: Any) -> tuple[Any, list[Fake], UpstreamPool, GatewayMetrics]:
    fakes = [Fake("a"), Fake("b"), Fake("c")]
    pool = UpstreamPool([(f"{f.name}:1", f) for f in fakes], ["m"], PoolSettings())
    cfg = GatewayConfig(upstreams=[m.target for m in pool.members], models=["m"], max_body_bytes=65536,
                        **({"routing_policy": policy} if policy else {}), **config)
    metrics = GatewayMetrics(["m"])
    return make_app(pool, keystore(), config=cfg, metrics=metrics), fakes, pool, metrics


def _chat(content: str, **kw: Any) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": content}],
                       **kw}).encode()


def _served_by(fakes: list[Fake]) -> list[str]:
    return [f.name for f in fakes for _ in f.seen]


def _decisions(metrics: GatewayMetrics) -> dict[str, float]:
    out = {}
    for family in metrics.registry.collect():
        if family.name == "llmhost_gateway_routing_decisions":
            out = {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}
    return out


def test_the_gateway_sends_a_documents_requests_to_one_upstream_by_default():
    app, fakes, pool, metrics = _gateway()
    # Documents longer than the key's 1,024 characters, each asked three questions.
    docs = [f"Summarise document {i}: " + "lorem ipsum " * 100 for i in range(12)]

    async def run() -> dict[int, set[str]]:
        served: dict[int, set[str]] = {}
        async with client(app) as c:
            await pool.check()
            for round_ in range(3):
                for i, doc in enumerate(docs):
                    before = {f.name: len(f.seen) for f in fakes}
                    r = await c.post("/v1/chat/completions", content=_chat(doc + f" question {round_}"))
                    assert r.status_code == 200, r.text
                    served.setdefault(i, set()).update(f.name for f in fakes if len(f.seen) > before[f.name])
        return served

    served = asyncio.run(run())
    assert all(len(names) == 1 for names in served.values()), served
    assert len({next(iter(n)) for n in served.values()}) >= 2  # the documents spread over the upstreams
    assert _decisions(metrics)["prefix"] == 36


def test_the_session_header_pins_a_conversation_whatever_its_prompts():
    app, fakes, pool, metrics = _gateway()

    async def run() -> None:
        async with client(app) as c:
            await pool.check()
            for i in range(8):
                r = await c.post("/v1/chat/completions", content=_chat(f"unrelated prompt {i}"),
                                 headers={"x-session-id": "conversation-42"})
                assert r.status_code == 200, r.text

    asyncio.run(run())
    assert len(set(_served_by(fakes))) == 1
    assert _decisions(metrics)["session"] == 8


def test_the_user_field_pins_only_where_session_user_is_set():
    async def run(app: Any, pool: UpstreamPool) -> None:
        async with client(app) as c:
            await pool.check()
            for i in range(9):
                r = await c.post("/v1/chat/completions", content=_chat(f"prompt number {i}", user="u-1"))
                assert r.status_code == 200, r.text

    app, fakes, pool, _ = _gateway(routing_session_user=True)
    asyncio.run(run(app, pool))
    assert len(set(_served_by(fakes))) == 1
    app, fakes, pool, _ = _gateway()
    asyncio.run(run(app, pool))
    assert len(set(_served_by(fakes))) > 1


def test_a_models_own_policy_round_robin_takes_the_upstreams_in_turn():
    app, fakes, pool, metrics = _gateway(model_routing={"m": ROUND_ROBIN})

    async def run() -> None:
        async with client(app) as c:
            await pool.check()
            for _ in range(6):
                r = await c.post("/v1/chat/completions", content=_chat("the same prompt every time"))
                assert r.status_code == 200, r.text

    asyncio.run(run())
    assert Counter(_served_by(fakes)) == {"a": 2, "b": 2, "c": 2}
    assert _decisions(metrics)[ROUND_ROBIN] == 6
    assert _decisions(metrics)["prefix"] == 0


def test_a_held_upstream_takes_none_of_its_keys_and_gets_them_back():
    app, fakes, pool, _ = _gateway()
    prompt = _chat("a prompt whose home is held")

    async def run() -> tuple[str, str, str]:
        async with client(app) as c:
            await pool.check()
            await c.post("/v1/chat/completions", content=prompt)
            home = _served_by(fakes)[-1]
            await pool.hold(pool.member(f"{home}:1"), True)  # type: ignore[arg-type]
            await c.post("/v1/chat/completions", content=prompt)
            elsewhere = [f.name for f in fakes if f.seen and f.name != home]
            await pool.hold(pool.member(f"{home}:1"), False)  # type: ignore[arg-type]
            await pool.check()
            await c.post("/v1/chat/completions", content=prompt)
            back = next(f.name for f in fakes if f.seen and f.seen[-1] is not None and f.name == home)
            return home, elsewhere[0], back

    home, elsewhere, back = asyncio.run(run())
    assert elsewhere != home and back == home
    assert Counter(_served_by(fakes))[home] == 2


# --- settings -----------------------------------------------------------------------------------


def test_the_routing_section_and_its_refusals():
    got = parse_config("routing: {policy: least_loaded, models: {m: round_robin}, prefix_chars: 512, "
                       "load_factor: 2, session_user: true}")
    config = GatewayConfig(models=["m"], **got)
    assert config.routing.policy_of("m") == ROUND_ROBIN
    assert config.routing.policy_of("other") == LEAST_LOADED
    assert (config.routing.prefix_chars, config.routing.load_factor, config.routing.session_user) == (512, 2.0, True)
    assert GatewayConfig().routing.policy == CACHE_AWARE
    for text, named in (("routing: {policy: random}", "routing.policy"),
                        ("routing: {models: {m: fastest}}", "routing.models.m"),
                        ("routing: {load_factor: 0.5}", "routing.load_factor"),
                        ("routing: {prefix_chars: 0}", "routing.prefix_chars"),
                        ("routing: {hash: x}", "routing.hash")):
        with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
            parse_config(text)


def test_the_routing_flags(tmp_path: Path):
    keys = tmp_path / "keys.json"
    keys.write_text('{"keys": []}')
    base = ["--model", "m", "--keys-file", str(keys)]
    config = settings(build_parser().parse_args([*base, "--routing", "round_robin", "--model-routing",
                                                 "m=least_loaded", "--routing-load-factor", "1.75",
                                                 "--routing-prefix-chars", "100", "--routing-session-user"]))
    assert (config.routing.policy, config.routing.policy_of("m")) == (ROUND_ROBIN, LEAST_LOADED)
    assert (config.routing.load_factor, config.routing.prefix_chars, config.routing.session_user) == (1.75, 100, True)
    with pytest.raises(ConfigError, match=r"--model-routing other=.*not a served model"):
        settings(build_parser().parse_args([*base, "--model-routing", "other=round_robin"]))
    for bad in (["--model-routing", "m=fastest"], ["--routing-load-factor", "0.9"], ["--routing", "random"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, *bad])
