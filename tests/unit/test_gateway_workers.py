"""The gateway's worker processes (llmhost.gateway.workers), in parts: how many, their
share of the bounds, the control connection, the shared key limits and holds, and the
upstreams as every worker sees them. tests/e2e/test_gateway_workers.py runs the processes."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.keys import ApiKey
from llmhost.gateway.limits import RateLimited
from llmhost.gateway.routing.pool import UpstreamPool
from llmhost.gateway.workers import (
    Channel,
    SharedState,
    Supervisor,
    WorkerPlace,
    listening_socket,
    merge_upstreams,
    worker_config,
    worker_count,
    worker_handler,
)


@pytest.mark.parametrize(("configured", "cores", "expected"), [
    (0, 1, 1), (0, 2, 1), (0, 7, 1), (0, 8, 2), (0, 16, 4), (0, 32, 8), (0, 128, 8), (3, 2, 3), (1, 64, 1)])
def test_worker_count(configured, cores, expected):
    assert worker_count(configured, cores) == expected


def test_each_worker_takes_its_share_of_the_bounds():
    config = GatewayConfig(max_concurrent_upstream=1024, max_queue=5, max_connections=4096, key_max_concurrent=7)
    share = worker_config(config, 3)
    assert (share.max_concurrent_upstream, share.max_queue, share.max_connections) == (342, 2, 1366)
    assert share.key_max_concurrent == 7  # kept by the supervisor for all workers
    assert worker_config(GatewayConfig(max_queue=0), 4).max_queue == 0


def test_worker_place_travels_in_one_variable():
    place = WorkerPlace(1, 4, 9, "/run/x y/control.sock")
    assert WorkerPlace.parse(place.env()) == place


def test_the_listening_sockets_share_a_port():
    first = listening_socket("127.0.0.1", 0)
    try:
        second = listening_socket("127.0.0.1", first.getsockname()[1])
        assert second.getsockname() == first.getsockname() and second.get_inheritable()
        second.close()
    finally:
        first.close()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # bound without SO_REUSEPORT: nobody may share it
    try:
        with pytest.raises(OSError):
            listening_socket("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()


def test_merge_upstreams_adds_every_workers_view_up():
    a = [{"target": "a:1", "state": "in_service", "held": False, "outstanding": 3, "up": True},
         {"target": "b:1", "state": "out", "held": False, "outstanding": 0, "up": False}]
    b = [{"target": "a:1", "state": "in_service", "held": False, "outstanding": 2, "up": True},
         {"target": "b:1", "state": "in_service", "held": False, "outstanding": 1, "up": True}]
    c = [{"target": "a:1", "state": "draining", "held": True, "outstanding": 0, "up": False},
         {"target": "b:1", "state": "draining", "held": False, "outstanding": 0, "up": False}]
    merged = {m["target"]: m for m in merge_upstreams([a, b, c])}
    assert merged["a:1"]["outstanding"] == 5 and merged["a:1"]["held"] is True
    assert merged["a:1"]["state"] == "in_service" and merged["a:1"]["up"] == pytest.approx(2 / 3)
    # One worker each: the least available state wins the tie.
    assert merged["b:1"]["state"] == "out" and merged["b:1"]["up"] == pytest.approx(1 / 3)
    assert merged["b:1"]["states"] == pytest.approx({"in_service": 1 / 3, "draining": 1 / 3, "out": 1 / 3})


async def _pair(left: Any, right: Any) -> tuple[Channel, Channel, list[asyncio.Task[None]]]:
    """Two channels over a socket pair, LEFT and RIGHT handling what the other sends."""
    s1, s2 = socket.socketpair()
    r1, w1 = await asyncio.open_connection(sock=s1)
    r2, w2 = await asyncio.open_connection(sock=s2)
    one, two = Channel(r1, w1, left), Channel(r2, w2, right)
    return one, two, [asyncio.ensure_future(one.run()), asyncio.ensure_future(two.run())]


def test_a_channel_calls_both_ways_and_fails_calls_when_closed():
    asyncio.run(_a_channel_calls_both_ways_and_fails_calls_when_closed())


async def _a_channel_calls_both_ways_and_fails_calls_when_closed():
    async def double(msg: dict[str, Any]) -> dict[str, Any]:
        return {"value": msg["value"] * 2}

    notes: list[dict[str, Any]] = []

    async def note(msg: dict[str, Any]) -> dict[str, Any]:
        notes.append(msg)
        return {}

    one, two, tasks = await _pair(note, double)
    answers = await asyncio.gather(*(one.call("double", value=i) for i in range(5)))
    assert [a["value"] for a in answers] == [0, 2, 4, 6, 8]
    two.note("seen", n=1)
    await asyncio.sleep(0.05)
    assert notes == [{"op": "seen", "n": 1}]

    async def never(msg: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {}

    two.handler = never
    pending = asyncio.ensure_future(one.call("hang"))
    await asyncio.sleep(0.05)
    two.writer.close()
    with pytest.raises(ConnectionError):
        await pending
    await asyncio.gather(*tasks)
    assert one.closed.is_set()


def _pair_key() -> ApiKey:
    return ApiKey(name="pair", sha256="0" * 64, max_concurrent=2)


def test_the_supervisor_counts_a_keys_requests_over_every_worker_and_frees_a_dead_ones():
    asyncio.run(_the_supervisor_counts_a_keys_requests_over_every_worker_and_frees_a_dead_ones())


async def _the_supervisor_counts_a_keys_requests_over_every_worker_and_frees_a_dead_ones():
    key = _pair_key()
    supervisor = Supervisor(GatewayConfig(), [key])
    links = []
    for _ in range(2):
        worker, side, _tasks = await _pair(worker_handler(UpstreamPool([("a:1", object())], ["m"])), _noop)
        side.handler = supervisor.handler(side)
        links.append((SharedState(worker, _tasks[0]), side))
    first, second = links[0][0], links[1][0]
    lease = await first.admit(key, 10)
    await second.admit(key, 10)
    with pytest.raises(RateLimited) as refused:
        await second.admit(key, 10)
    assert refused.value.status == 429 and refused.value.limit == "max_concurrent"
    assert refused.value.headers["Retry-After"] == "1"
    lease.finish(5)
    await asyncio.sleep(0.05)
    await first.admit(key, 10)  # the finished one's slot is free again
    # The second worker dies with its request in flight: its slot comes back.
    supervisor.gone(links[1][1])
    await first.admit(key, 10)
    with pytest.raises(RateLimited):
        await first.admit(key, 10)


async def _noop(msg: dict[str, Any]) -> dict[str, Any]:
    return {}


def test_a_hold_reaches_every_worker_and_a_new_one():
    asyncio.run(_a_hold_reaches_every_worker_and_a_new_one())


async def _a_hold_reaches_every_worker_and_a_new_one():
    supervisor = Supervisor(GatewayConfig(), [_pair_key()])
    pools, states = [], []
    for index in range(2):
        pool = UpstreamPool([("a:1", object()), ("b:1", object())], ["m"])
        worker, side, tasks = await _pair(worker_handler(pool), _noop)
        side.handler = supervisor.handler(side)
        await worker.call("hello", index=index)
        pools.append(pool)
        states.append(SharedState(worker, tasks[0]))
    body = await states[0].hold("b:1", True)
    assert [p.member("b:1").held for p in pools] == [True, True]  # type: ignore[union-attr]
    assert {u["target"]: u["held"] for u in body["upstreams"]} == {"a:1": False, "b:1": True}
    # A worker that (re)starts now hears of the hold.
    worker, side, _ = await _pair(worker_handler(UpstreamPool([("b:1", object())], ["m"])), _noop)
    side.handler = supervisor.handler(side)
    assert (await worker.call("hello", index=2))["held"] == ["b:1"]
    await states[1].hold("b:1", False)
    assert [p.member("b:1").held for p in pools] == [False, False]  # type: ignore[union-attr]


def test_a_worker_without_its_supervisor_answers_503():
    asyncio.run(_a_worker_without_its_supervisor_answers_503())


async def _a_worker_without_its_supervisor_answers_503():
    worker, side, tasks = await _pair(_noop, _noop)
    shared = SharedState(worker, tasks[0])
    side.writer.close()
    await asyncio.gather(*tasks)
    with pytest.raises(Exception) as exc:
        await shared.admit(_pair_key(), 1)
    assert getattr(exc.value, "status", None) == 503
