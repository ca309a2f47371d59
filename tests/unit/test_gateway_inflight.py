"""Requests in flight as the routing policies weigh them (llmhost.gateway.routing.inflight):
counted by one process, or over every gateway worker of a host in a shared table, and
what that changes in a cache-aware choice. tests/e2e/test_gateway_workers.py runs the
table between real worker processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmhost.gateway.routing import inflight
from llmhost.gateway.routing.inflight import (
    InFlight,
    SharedInFlight,
    clear_row,
    counts_by_row,
    create_table,
    upstream_load_name,
)
from llmhost.gateway.routing.policies import CACHE_AWARE, LEAST_LOADED, Route, rendezvous_order, route_key
from llmhost.gateway.routing.pool import PoolSettings, UpstreamPool
from tests.unit._gateway_fakes import Fake

A, B = upstream_load_name("a:1"), upstream_load_name("b:1")


def _table(tmp_path: Path, rows: int = 2) -> Path:
    path = tmp_path / "in-flight"
    create_table(path, rows)
    return path


def test_one_process_counts_its_own_requests():
    counts = InFlight()
    with counts.holding(A), counts.holding(A):
        counts.add(B, 1)
        assert (counts.count(A), counts.count(B)) == (2, 1)
    assert (counts.count(A), counts.count("never seen")) == (0, 0)


def test_every_workers_requests_count_and_each_worker_writes_its_own_row(tmp_path: Path):
    path = _table(tmp_path, rows=3)
    first, second = SharedInFlight(path, 0), SharedInFlight(path, 2)
    with first.holding(A), first.holding(A), second.holding(A):
        second.add(B, 3)
        assert first.count(A) == second.count(A) == 3
        assert first.count(B) == second.count(B) == 3
        assert counts_by_row(path, A) == [2, 0, 1]
    second.add(B, -3)
    assert (first.count(A), first.count(B), second.count(A)) == (0, 0, 0)
    assert counts_by_row(path, B) == [0, 0, 0]
    first.close()
    second.close()


def test_a_worker_starting_in_a_row_and_the_supervisor_after_one_ended_zero_it(tmp_path: Path):
    path = _table(tmp_path)
    reader, dead = SharedInFlight(path, 0), SharedInFlight(path, 1)
    dead.add(A, 5)
    assert reader.count(A) == 5
    clear_row(path, 1)  # the supervisor, once the worker of row 1 ended
    assert reader.count(A) == 0 and counts_by_row(path, A) == [0, 0]
    crashed = SharedInFlight(path, 1)  # a worker that died before the supervisor cleared its row
    crashed.add(B, 4)
    assert reader.count(B) == 4
    successor = SharedInFlight(path, 1)  # its successor in that row: what it left is gone
    assert reader.count(B) == 0
    successor.add(A, 1)
    assert reader.count(A) == 1 and counts_by_row(path, A) == [0, 1]
    for counts in (reader, dead, crashed, successor):
        counts.close()


def test_a_full_row_reuses_the_slot_of_a_target_with_nothing_in_flight(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(inflight, "SLOTS", 2)
    path = _table(tmp_path)
    writer, reader = SharedInFlight(path, 0), SharedInFlight(path, 1)
    writer.add("one", 1)
    writer.add("two", 1)
    writer.add("three", 1)  # no slot is free and both are busy: counted by its worker only
    assert (reader.count("one"), reader.count("two"), reader.count("three")) == (1, 1, 0)
    assert writer.count("three") == 1
    writer.add("one", -1)
    writer.add("three", 1)  # "one" has nothing in flight: its slot now counts "three" for all
    assert (reader.count("one"), reader.count("three")) == (0, 2)
    writer.add("one", 1)  # and "one", with no slot left, only here
    assert (reader.count("one"), writer.count("one")) == (0, 1)
    writer.close()
    reader.close()


def test_a_table_of_another_size_or_a_row_past_its_end_is_refused(tmp_path: Path):
    path = _table(tmp_path, rows=2)
    with pytest.raises(ValueError, match="row 2"):
        SharedInFlight(path, 2)
    (tmp_path / "short").write_bytes(b"\0" * 24)
    with pytest.raises(ValueError, match="not a table"):
        SharedInFlight(tmp_path / "short", 0)


_OTHER_WORKER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from llmhost.gateway.routing.inflight import SharedInFlight, upstream_load_name
    counts = SharedInFlight(Path(sys.argv[1]), 1)
    counts.add(upstream_load_name("a:1"), 7)
    print("counted", flush=True)
    sys.stdin.readline()
""")


def test_another_process_sees_a_workers_counts_until_the_supervisor_clears_its_row(tmp_path: Path):
    path = _table(tmp_path)
    reader = SharedInFlight(path, 0)
    other = subprocess.Popen([sys.executable, "-c", _OTHER_WORKER, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "counted"
        assert reader.count(A) == 7
    finally:
        other.kill()
        other.wait()
    assert reader.count(A) == 7  # a dead worker's row stays until the supervisor clears it
    clear_row(path, 1)
    assert reader.count(A) == 0
    reader.close()


def _key_whose_first_choice_is(target: str) -> bytes:
    for i in range(100):
        key, _ = route_key("m", f"document {i}", None)
        assert key is not None
        if ["a:1", "b:1"][rendezvous_order(key, ["a:1", "b:1"])[0]] == target:
            return key
    raise AssertionError("no key found")


def _routed(pool: UpstreamPool, route: Route) -> str:
    async def pick() -> str:
        member = await pool.acquire("m", route=route)
        await pool.release(member)
        return member.target
    return asyncio.run(pick())


def test_a_key_stays_on_its_replica_while_the_hosts_load_is_even_though_this_workers_is_not(tmp_path: Path):
    """13 of this worker's 16 requests on a, the other worker's 20 on b and 10 on a: the
    host has 23 and 23 in flight, so a key whose first choice is a goes to a; counted by
    this worker alone it would pass the bound (ceil(1.5 * 17 / 2) = 13) and go to b."""
    path = _table(tmp_path)
    key = _key_whose_first_choice_is("a:1")

    def pool_with(counts: InFlight) -> UpstreamPool:
        pool = UpstreamPool([("a:1", Fake("a")), ("b:1", Fake("b"))], ["m"], PoolSettings())
        pool.in_flight = counts
        counts.add(A, 13)
        counts.add(B, 3)
        return pool

    alone = pool_with(InFlight())
    route = Route(CACHE_AWARE, key)
    assert _routed(alone, route) == "b:1" and route.reason == "load_bound"

    shared = pool_with(SharedInFlight(path, 0))
    other = SharedInFlight(path, 1)
    other.add(A, 10)
    other.add(B, 20)
    route = Route(CACHE_AWARE, key)
    assert _routed(shared, route) == "a:1" and route.reason == "prefix"
    # The least-loaded choice weighs the host's counts too: b has 23 to a's 24.
    other.add(A, 1)
    route = Route(LEAST_LOADED)
    assert _routed(shared, route) == "b:1"
    # A worker's own bound on requests in flight (max_concurrent) still counts its own.
    assert [m.outstanding for m in shared.members] == [0, 0]
    other.close()
