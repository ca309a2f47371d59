"""The upstream pool: least outstanding among ready upstreams, health checks,
retry once before the first response (down or draining), never after; the
per-upstream concurrency limit with its bounded queue; 503 without a healthy
upstream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.routing.inflight import upstream_load_name
from llmhost.gateway.routing.pool import PoolSettings, UpstreamPool
from llmhost.gateway.upstreams.client import Piece, UpstreamDown
from llmhost.gateway.upstreams.request import BackendRequest
from tests.unit._gateway_fakes import Fake, chat, client, keystore, make_app


def _states(pool: UpstreamPool) -> list[tuple[str, str]]:
    """(target, state) per upstream, as the admin API lists them."""
    return [(u["target"], u["state"]) for u in pool.view()]

def _pool(*fakes: Fake, models: tuple[str, ...] = ("m",), **settings: Any) -> UpstreamPool:
    return UpstreamPool([(f"{f.name}:1", f) for f in fakes], list(models), PoolSettings(**settings))


def _app(pool: UpstreamPool, models: tuple[str, ...] = ("m",)) -> Any:
    # Least loaded: these tests are of the pool's slots, checks and retries, not of
    # routing by prompt (tests/unit/test_gateway_routing.py).
    config = GatewayConfig(upstreams=[m.target for m in pool.members], models=list(models),
                           routing_policy="least_loaded")
    return make_app(pool, config=config)


def _text(r: Any) -> str:
    return r.json()["choices"][0]["message"]["content"]


def test_requests_go_to_the_upstream_with_the_fewest_outstanding():
    a, b = Fake("a"), Fake("b")
    a.gate = asyncio.Event()
    pool = _pool(a, b)

    async def run() -> None:
        async with client(_app(pool)) as c:
            first = asyncio.ensure_future(c.post("/v1/chat/completions", content=chat()))
            while a.started == 0:
                await asyncio.sleep(0.01)
            r = await c.post("/v1/chat/completions", content=chat())  # a has one outstanding: b
            assert _text(r) == "hello from b!"
            a.gate.set()
            assert _text(await first) == "hello from a!"

    asyncio.run(run())
    assert (a.calls, b.calls) == (1, 1)


def test_only_upstreams_where_the_model_is_ready_are_picked_and_listed():
    a, b = Fake("a", ready=("n",)), Fake("b", ready=("m",))
    pool = _pool(a, b, models=("m", "n", "o"))

    async def run() -> None:
        async with client(_app(pool, ("m", "n", "o"))) as c:
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["m", "n"]
            for _ in range(3):
                assert _text(await c.post("/v1/chat/completions", content=chat())) == "hello from b!"
            r = await c.post("/v1/chat/completions", content=chat(model="o"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_upstream"
            assert r.headers["retry-after"] == "2"
            assert (await c.get("/v1/models/o")).status_code == 404

    asyncio.run(run())
    assert a.calls == 0


def test_health_checks_mark_upstreams_down_and_up():
    a = Fake("a", reachable=False)
    pool = _pool(a, Fake("b"), healthy_threshold=2)

    async def run() -> None:
        await pool.check()  # at start, the first check decides
        assert [(u["target"], u["up"]) for u in pool.view()] == [("a:1", False), ("b:1", True)]
        a.reachable = True
        await pool.check()
        assert [u["up"] for u in pool.view()] == [False, True]  # one pass is not enough to come back
        await pool.check()
        assert [u["up"] for u in pool.view()] == [True, True]
        a.ready = set()  # reachable, but the model is not ready
        await pool.check()
        assert [u["up"] for u in pool.view()] == [False, True]

    asyncio.run(run())


def test_an_upstream_that_stops_answering_is_out_after_the_failures_and_back_after_the_passes():
    a, b = Fake("a"), Fake("b")
    pool = _pool(a, b, unhealthy_threshold=3, healthy_threshold=2)

    async def states() -> list[str]:
        seen = []
        await pool.check()
        seen.append(pool.view()[0]["state"])
        a.reachable = False
        for _ in range(3):
            await pool.check()
            seen.append(pool.view()[0]["state"])
        a.reachable = True
        for _ in range(2):
            await pool.check()
            seen.append(pool.view()[0]["state"])
        return seen

    assert asyncio.run(states()) == ["in_service", "in_service", "in_service", "out", "out", "in_service"]


def test_a_slow_health_check_times_out_and_marks_down():
    class Slow(Fake):
        async def model_ready(self, model: str) -> bool:
            await asyncio.Event().wait()
            return True

    pool = _pool(Slow("a"), timeout_s=0.01)
    asyncio.run(pool.check())
    assert [(u["target"], u["up"], u["outstanding"]) for u in pool.view()] == [("a:1", False, 0)]


def test_an_upstream_that_answers_late_under_load_stays_in_until_the_threshold():
    class Late(Fake):
        slow = False

        async def model_ready(self, model: str) -> bool:
            if self.slow:
                await asyncio.Event().wait()
            return True

    late = Late("a")
    pool = _pool(late, timeout_s=0.01, unhealthy_threshold=3)

    async def checks() -> list[bool]:
        await pool.check()
        seen = [pool.view()[0]["up"]]
        late.slow = True
        for _ in range(2):
            await pool.check()
            seen.append(pool.view()[0]["up"])
        late.slow = False
        await pool.check()  # a check that passes starts the count again
        late.slow = True
        for _ in range(3):
            await pool.check()
            seen.append(pool.view()[0]["up"])
        return seen

    assert asyncio.run(checks()) == [True, True, True, True, True, False]


def test_the_health_loop_runs_until_cancelled():
    a = Fake("a", reachable=False)
    pool = _pool(a, interval_s=0.01)

    async def run() -> None:
        task = asyncio.ensure_future(pool.run_health_checks())
        while not pool.members[0].checked:
            await asyncio.sleep(0.01)
        assert not pool.members[0].up
        a.reachable = True
        while not pool.members[0].up:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(run())


def test_an_unreachable_upstream_is_marked_down_and_the_request_retried_once():
    a, b = Fake("a", fail="down"), Fake("b")
    pool = _pool(a, b)

    async def run() -> None:
        async with client(_app(pool)) as c:
            await pool.check()
            r = await c.post("/v1/chat/completions", content=chat(stream=True))
            assert r.status_code == 200 and "hello from b" in r.text
            assert [u["up"] for u in pool.view()] == [False, True]
            assert _text(await c.post("/v1/chat/completions", content=chat())) == "hello from b!"

    asyncio.run(run())
    assert (a.calls, b.calls) == (1, 2)


def test_a_draining_upstream_is_taken_out_until_its_health_checks_pass():
    a, b = Fake("a", fail="the model is shutting down; retry on another instance"), Fake("b")
    pool = _pool(a, b, healthy_threshold=2)

    async def run() -> None:
        async with client(_app(pool)) as c:
            assert _text(await c.post("/v1/chat/completions", content=chat())) == "hello from b!"
            assert _states(pool) == [("a:1", "draining"), ("b:1", "in_service")]
            a.fail = None
            assert _text(await c.post("/v1/chat/completions", content=chat())) == "hello from b!"
            await pool.check()
            assert _text(await c.post("/v1/chat/completions", content=chat())) == "hello from b!"
            await pool.check()
            assert _text(await c.post("/v1/chat/completions", content=chat())) == "hello from a!"

    asyncio.run(run())
    assert (a.calls, b.calls) == (2, 3)


class Late(Fake):
    """An upstream whose health checks, while `slow`, never answer (they time out)."""

    slow = False

    async def model_ready(self, model: str) -> bool:
        if self.slow:
            await asyncio.Event().wait()
        return await super().model_ready(model)


def test_a_health_check_late_once_turns_no_request_away():
    """Every upstream answers one check late (a busy machine): requests still go through,
    and a lone upstream taken out by late checks is still tried (panic mode)."""
    a = Late("a")
    pool = _pool(a, timeout_s=0.01, unhealthy_threshold=1)

    async def run() -> None:
        async with client(_app(pool)) as c:
            await pool.check()
            a.slow = True
            await pool.check()  # late once: with a threshold of 1 it is out
            assert _states(pool) == [("a:1", "out")]
            r = await c.post("/v1/chat/completions", content=chat())
            assert r.status_code == 200 and _text(r) == "hello from a!", r.text
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["m"]
            assert pool.panic_routed == 1

    asyncio.run(run())


def test_one_late_health_check_with_the_default_thresholds_keeps_the_upstream_in_service():
    """The lone upstream of a busy machine answers one check after its timeout: it stays in
    service (not only tried in panic mode), and requests before and after are answered."""
    a = Late("a")
    pool = _pool(a, timeout_s=0.01)  # default thresholds: out after 3 failures, back after 2 passes

    async def run() -> None:
        async with client(_app(pool)) as c:
            await pool.check()
            a.slow = True
            await pool.check()
            assert _states(pool) == [("a:1", "in_service")]
            r = await c.post("/v1/chat/completions", content=chat(stream=True))
            assert r.status_code == 200 and "hello from a" in r.text, r.text
            a.slow = False
            await pool.check()
            assert _text(await c.post("/v1/chat/completions", content=chat())) == "hello from a!"

    asyncio.run(run())
    assert pool.panic_routed == 0 and a.calls == 2


@pytest.mark.parametrize(("unhealthy", "healthy"), [(1, 1), (2, 3), (4, 2)])
def test_out_after_the_configured_failures_and_back_after_the_configured_passes(unhealthy: int, healthy: int):
    """Requests follow the states: only to B while A is out, to A again once it is back."""
    a, b = Fake("a"), Fake("b")
    pool = _pool(a, b, unhealthy_threshold=unhealthy, healthy_threshold=healthy)

    async def served_by(c: Any) -> set[str]:
        return {_text(await c.post("/v1/chat/completions", content=chat())) for _ in range(4)}

    async def run() -> None:
        async with client(_app(pool)) as c:
            await pool.check()
            a.reachable = False
            for _ in range(unhealthy - 1):
                await pool.check()
                assert _states(pool)[0] == ("a:1", "in_service")
            await pool.check()
            assert _states(pool)[0] == ("a:1", "out")
            assert await served_by(c) == {"hello from b!"}
            a.reachable = True
            for _ in range(healthy - 1):
                await pool.check()
                assert _states(pool)[0] == ("a:1", "out")
                assert await served_by(c) == {"hello from b!"}
            await pool.check()
            assert _states(pool)[0] == ("a:1", "in_service")
            assert "hello from a!" in await served_by(c)

    asyncio.run(run())


def test_panic_mode_skips_upstreams_known_to_be_unreachable_or_draining():
    a, b = Fake("a"), Fake("b", fail="the model is shutting down; retry on another instance")
    pool = _pool(a, b, unhealthy_threshold=1)

    async def run() -> None:
        async with client(_app(pool)) as c:
            await pool.check()
            a.reachable = False
            await pool.check()  # a: out, unreachable; b: in service
            r = await c.post("/v1/chat/completions", content=chat())  # b says it is stopping
            assert r.status_code == 503, r.text
            assert _states(pool) == [("a:1", "out"), ("b:1", "draining")]
            r = await c.post("/v1/chat/completions", content=chat())
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_upstream"

    asyncio.run(run())
    assert (a.calls, b.calls) == (0, 1)
    assert pool.panic_routed == 0


def test_the_pool_states_and_panic_count_reach_the_metrics():
    from llmhost.gateway.metrics import GatewayMetrics

    a, b = Fake("a"), Fake("b")
    pool = _pool(a, b, unhealthy_threshold=1)
    metrics = GatewayMetrics(["m"])
    metrics.watch_pool(pool)

    async def run() -> None:
        await pool.check()
        b.reachable = False
        pool.mark_draining(pool.members[0])
        await pool.check()

    asyncio.run(run())
    text = metrics.render().decode()
    assert 'llmhost_gateway_upstream_state{state="draining",upstream="a:1"} 1.0' in text
    assert 'llmhost_gateway_upstream_state{state="in_service",upstream="a:1"} 0.0' in text
    assert 'llmhost_gateway_upstream_state{state="out",upstream="b:1"} 1.0' in text
    assert "llmhost_gateway_panic_routed_total 0.0" in text


def test_an_upstream_unloading_the_model_on_stop_is_skipped_like_a_draining_one():
    """Triton's own answer while it unloads the model on stop ("has no available
    versions") comes before any token: the request goes to the other upstream."""
    a, b = Fake("a", fail="Request for unknown model: 'm' has no available versions"), Fake("b")
    pool = _pool(a, b)

    async def run() -> None:
        async with client(_app(pool)) as c:
            for _ in range(2):
                r = await c.post("/v1/chat/completions", content=chat())
                assert r.status_code == 200 and _text(r) == "hello from b!", r.text

    asyncio.run(run())
    assert (a.calls, b.calls) == (1, 2)


STUB_MISSED = "Stub process 'm_0_0' is not healthy."  # Triton's python backend, on a busy machine


class FailsOnce(Fake):
    """An upstream whose next call fails with FAIL once, then serves."""

    async def _before(self) -> None:
        failing, self.fail = self.fail, None
        self.calls += 1
        if failing is not None:
            from llmhost.gateway.upstreams.client import classify
            raise classify(failing)


def test_a_request_the_stub_missed_is_tried_on_another_upstream_and_nobody_is_taken_out():
    a, b = FailsOnce("a", fail=STUB_MISSED), Fake("b")
    lines: list[str] = []
    pool = UpstreamPool([("a:1", a), ("b:1", b)], ["m"], PoolSettings(), log=lines.append)
    pool.in_flight.add(upstream_load_name("b:1"), 1)  # a is picked first

    async def run() -> None:
        async with client(_app(pool)) as c:
            await pool.check()
            lines.clear()
            r = await c.post("/v1/chat/completions", content=chat(stream=True))
            assert r.status_code == 200 and "hello from b" in r.text, r.text

    asyncio.run(run())
    assert (a.calls, b.calls) == (1, 1)
    assert _states(pool) == [("a:1", "in_service"), ("b:1", "in_service")]
    assert lines == []


def test_a_request_the_stub_missed_on_the_only_upstream_serving_is_tried_there_again():
    """B is held (a roll changes it), A alone serves: a request A's stub missed is not a
    503 and A stays in service."""
    a, b = FailsOnce("a", fail=STUB_MISSED), Fake("b")
    pool = _pool(a, b)

    async def run() -> None:
        async with client(_app(pool)) as c:
            await pool.check()
            await pool.hold(pool.members[1], True)
            for stream in (False, True):
                a.fail = STUB_MISSED
                r = await c.post("/v1/chat/completions", content=chat(stream=stream))
                assert r.status_code == 200 and "hello from a" in r.text, r.text
            assert _states(pool) == [("a:1", "in_service"), ("b:1", "draining")]

    asyncio.run(run())
    assert (a.calls, b.calls) == (4, 0)


def test_a_stub_that_misses_twice_in_a_row_fails_the_request_with_503():
    a = Fake("a", fail=STUB_MISSED)
    pool = _pool(a)

    async def run() -> None:
        async with client(_app(pool)) as c:
            r = await c.post("/v1/chat/completions", content=chat())
            assert r.status_code == 503, r.text
            assert r.json()["error"]["message"] == STUB_MISSED
            assert _states(pool) == [("a:1", "in_service")]

    asyncio.run(run())
    assert a.calls == 2


def test_each_change_of_an_upstreams_state_is_logged_with_why():
    a, b = Fake("a"), Fake("b", fail="the model is shutting down; retry on another instance")
    lines: list[str] = []
    pool = UpstreamPool([("a:1", a), ("b:1", b)], ["m"], PoolSettings(unhealthy_threshold=2, healthy_threshold=2),
                        log=lines.append)

    async def run() -> None:
        async with client(_app(pool)) as c:
            await pool.check()
            pool.in_flight.add(upstream_load_name("a:1"), 1)  # b is picked first, and says it is stopping
            assert _text(await c.post("/v1/chat/completions", content=chat())) == "hello from a!"
            pool.in_flight.add(upstream_load_name("a:1"), -1)
            a.reachable = False
            await pool.check()  # a: one failure of two; b: one pass of two
            await pool.check()
            await pool.hold(pool.members[1], True)
            await pool.hold(pool.members[1], False)

    asyncio.run(run())
    assert lines == [
        "upstream a:1 in_service: 1 passed health check(s) in a row",
        "upstream b:1 in_service: 1 passed health check(s) in a row",
        "upstream b:1 draining: it said: the model is shutting down; retry on another instance",
        "upstream a:1 in_service (unreachable): 1 failed health check(s) in a row, the last unreachable",
        "upstream a:1 out (unreachable): 2 failed health check(s) in a row, the last unreachable",
        "upstream b:1 in_service: 2 passed health check(s) in a row",
        "upstream b:1 draining (held): held by the admin API",
        "upstream b:1 in_service: returned by the admin API",
    ], "\n".join(lines)


def test_only_one_retry_and_the_first_error_when_every_upstream_fails():
    a, b, c_ = Fake("a", fail="down"), Fake("b", fail="down"), Fake("c", fail="down")
    pool = _pool(a, b, c_)

    async def run() -> None:
        async with client(_app(pool)) as c:
            r = await c.post("/v1/chat/completions", content=chat())
            assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"

    asyncio.run(run())
    assert a.calls + b.calls + c_.calls == 2


def test_no_retry_once_a_token_went_to_the_client():
    class DiesMidStream(Fake):
        async def generate(self, req: BackendRequest) -> AsyncIterator[Piece]:
            self.calls += 1
            yield Piece(["x"], [""], 1, [1], False)
            raise UpstreamDown(self.name)

    a, b = DiesMidStream("a"), Fake("b")
    pool = _pool(a, b)

    async def run() -> None:
        async with client(_app(pool)) as c:
            r = await c.post("/v1/chat/completions", content=chat(stream=True))
            assert r.status_code == 200 and '"content":"x"' in r.text
            assert '"code":"upstream_unavailable"' in r.text.replace(" ", "")

    asyncio.run(run())
    assert (a.calls, b.calls) == (1, 0)
    assert [u["up"] for u in pool.view()] == [False, True]


def test_no_healthy_upstream_is_503_with_the_openai_error_object():
    pool = _pool(Fake("a", reachable=False), Fake("b", reachable=False))

    async def run() -> None:
        async with client(_app(pool)) as c:
            r = await c.post("/v1/chat/completions", content=chat())
            assert r.status_code == 503 and "retry-after" in r.headers
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert r.json()["error"]["type"] == "service_unavailable_error"
            assert (await c.get("/v1/models")).json()["data"] == []

    asyncio.run(run())


def test_over_the_upstream_limit_requests_queue_then_a_full_queue_is_503():
    a = Fake("a")
    a.gate = asyncio.Event()
    pool = _pool(a, max_concurrent=1, max_queue=1, queue_timeout_s=60)

    async def run() -> None:
        async with client(_app(pool)) as c:
            first = asyncio.ensure_future(c.post("/v1/chat/completions", content=chat()))
            while a.started == 0:
                await asyncio.sleep(0.01)
            queued = asyncio.ensure_future(c.post("/v1/chat/completions", content=chat()))
            while pool.waiting == 0:
                await asyncio.sleep(0.01)
            r = await c.post("/v1/chat/completions", content=chat())
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
            assert r.headers["retry-after"] == "1"
            assert a.started == 1  # the queued one waits
            a.gate.set()
            assert (await first).status_code == 200 and (await queued).status_code == 200

    asyncio.run(run())
    assert a.calls == 2 and [(u["target"], u["up"], u["outstanding"]) for u in pool.view()] == [("a:1", True, 0)]


def test_a_queued_request_gives_up_after_the_queue_timeout():
    a = Fake("a")
    a.gate = asyncio.Event()
    pool = _pool(a, max_concurrent=1, max_queue=4, queue_timeout_s=0.05)

    async def run() -> None:
        async with client(_app(pool)) as c:
            first = asyncio.ensure_future(c.post("/v1/chat/completions", content=chat()))
            while a.started == 0:
                await asyncio.sleep(0.01)
            r = await c.post("/v1/chat/completions", content=chat())
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"
            assert r.headers["retry-after"] == "1"
            a.gate.set()
            assert (await first).status_code == 200

    asyncio.run(run())
    assert pool.waiting == 0


def test_a_request_that_leaves_the_queue_frees_its_place():
    a = Fake("a")
    pool = _pool(a, max_concurrent=1, max_queue=1, queue_timeout_s=60)

    async def run() -> None:
        held = await pool.acquire("m")
        waiter = asyncio.ensure_future(pool.acquire("m"))
        while pool.waiting == 0:
            await asyncio.sleep(0.01)
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        assert pool.waiting == 0
        await pool.release(held)
        assert [(u["target"], u["up"], u["outstanding"]) for u in pool.view()] == [("a:1", True, 0)]
        second = await pool.acquire("m")  # room again, no slot leaked
        await pool.release(second)

    asyncio.run(run())


def test_an_unexpected_failure_of_a_health_check_marks_down_and_checks_go_on():
    class Broken(Fake):
        async def model_ready(self, model: str) -> bool:
            raise RuntimeError("a bug")

    pool = _pool(Broken("a"), Fake("b"))
    asyncio.run(pool.check())
    assert [u["up"] for u in pool.view()] == [False, True]


def test_a_key_sees_only_the_models_it_may_use():
    fake = Fake(ready=("m", "other"))
    app = make_app(UpstreamPool([("up:1", fake)], ["m", "other"]),
                   keys=keystore(models=["other"]), config=GatewayConfig(upstreams=["up:1"], models=["m", "other"]))

    async def go() -> list[Any]:
        async with client(app) as c:
            return [await c.get("/v1/models"), await c.get("/v1/models/m"),
                    await c.post("/v1/chat/completions", content=chat()),
                    await c.post("/v2/models/m/generate", json={"text_input": "x"}),
                    await c.get("/v2/models/m/ready"),
                    await c.post("/v1/chat/completions", content=chat(model="other"))]

    listing, one, completion, native, ready, allowed = asyncio.run(go())
    assert [m["id"] for m in listing.json()["data"]] == ["other"]
    for r in (one, completion, native, ready):
        assert r.status_code == 404, r.text
    assert completion.json()["error"]["code"] == "model_not_found"
    assert allowed.status_code == 200 and fake.seen[-1].model == "other"
