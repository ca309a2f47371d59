"""The gateway as several worker processes on one port (``--workers``), in front of the
real stack: what one worker decides holds for all (a key's concurrent requests, an
operator's hold, the requests in flight that routing weighs), a killed worker is
replaced, the metrics add every worker up, and SIGTERM ends them all."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmhost.gateway.keys import hash_key
from llmhost.gateway.routing.inflight import counts_by_row, upstream_load_name
from llmhost.gateway.workers import WORKER_ENV, WorkerPlace, in_flight_table
from tests.harness.gateway import KEY, Gateway, start_gateway, stop_gateway
from tests.harness.net import CLIENT_TIMEOUT_S, free_port
from tests.harness.server import process_name

ADMIN_KEY = "admin-key-0123456789abcdef"
PAIR_KEY = "pair-key-0123456789abcdef"  # at most 2 requests in flight
WORKERS = 2


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("gateway-workers")
    keys = work / "keys.yml"
    keys.write_text(f"keys:\n  - name: tester\n    sha256: {hash_key(KEY)}\n"
                    f"  - name: admin\n    sha256: {hash_key(ADMIN_KEY)}\n    admin: true\n"
                    f"  - name: pair\n    sha256: {hash_key(PAIR_KEY)}\n    max_concurrent: 2\n")
    port, metrics_port = free_port(), free_port()
    log = work / "gateway.log"
    cmd = [str(Path(sys.executable).parent / "llmhost"), "gateway", "--upstream", server.grpc,
           "--engine-sockets", f"{server.grpc}={server.engine_sockets}", "--listen", f"127.0.0.1:{port}",
           "--keys-file", str(keys), "--model", server.name, "--metrics-listen", f"127.0.0.1:{metrics_port}",
           "--health-interval-s", "1", "--workers", str(WORKERS)]
    url = f"http://127.0.0.1:{port}/v1"
    proc = start_gateway(cmd, log, url)
    yield Gateway(url, proc, log, f"http://127.0.0.1:{metrics_port}/metrics")
    workers = psutil.Process(proc.pid).children()
    stop_gateway(proc, log)
    assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], log.read_text()


def _workers(gateway: Gateway) -> list[int]:
    return sorted(p.pid for p in psutil.Process(gateway.proc.pid).children())


def _chat(gateway: Gateway, model: str, key: str = KEY, max_tokens: int = 4, stream: bool = False
          ) -> tuple[int, int, int]:
    """(status, streamed events with a choice, completion tokens of the streamed usage) of
    one completion on a connection of its own; (status, 0, 0) when not streamed."""
    body: dict[str, Any] = {"model": model, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True,
                            "stream": stream}
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {key}"}, timeout=CLIENT_TIMEOUT_S) as c:
        if not stream:
            return c.post("/completions", json=body).status_code, 0, 0
        body["stream_options"] = {"include_usage": True}
        with c.stream("POST", "/completions", json=body) as r:
            chunks = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: {")]
            usage = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
            return (r.status_code, sum(1 for chunk in chunks if chunk.get("choices")),
                    usage[-1]["completion_tokens"] if usage else 0)


def _admin(gateway: Gateway, path: str, method: str = "GET") -> dict:
    with httpx.Client(base_url=gateway.url.removesuffix("/v1"), timeout=30,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        r = c.request(method, path)
        assert r.status_code == 200, r.text
        return r.json()


def test_the_workers_run_and_stream(gateway, server):
    assert len(_workers(gateway)) == WORKERS, gateway.log.read_text()
    results = [_chat(gateway, server.name, max_tokens=6, stream=True) for _ in range(8)]
    # Every stream whole, on whichever worker took the connection: its 6 tokens in one event
    # per engine step. vLLM hands over the steps its consumer has not taken yet as one output,
    # so on a loaded machine an event may carry two tokens: fewer events then, never more.
    assert [(status, tokens) for status, _, tokens in results] == [(200, 6)] * 8, results
    assert all(1 <= events <= 6 for _, events, _ in results), results


def test_a_keys_concurrent_requests_are_counted_across_workers(gateway, server):
    # Eight streams of a key allowed 2 at once, each on its own connection (the kernel spreads
    # them over the workers): 2 run and 6 get 429, as with one process; a limit kept per worker
    # would let up to 2 per worker through.
    start = threading.Barrier(8)
    statuses: list[int] = []

    def one() -> None:
        start.wait()
        statuses.append(_chat(gateway, server.name, key=PAIR_KEY, max_tokens=120, stream=True)[0])

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses) == [200, 200] + [429] * 6, gateway.log.read_text()
    # Their slots came back: the key runs two more.
    assert [_chat(gateway, server.name, key=PAIR_KEY)[0] for _ in range(2)] == [200, 200]


def test_a_hold_reaches_every_worker(gateway, server):
    target = server.grpc
    held = _admin(gateway, f"/admin/upstreams/{target}/hold", "POST")
    assert held["upstreams"] == [{"target": target, "state": "draining", "held": True, "outstanding": 0}]
    try:
        # Every connection, whichever worker takes it, finds the only upstream held.
        assert {_chat(gateway, server.name)[0] for _ in range(8)} == {503}
        assert all(_admin(gateway, "/admin/upstreams")["upstreams"][0]["held"] for _ in range(4))
    finally:
        returned = _admin(gateway, f"/admin/upstreams/{target}/return", "POST")
    assert returned["upstreams"][0]["held"] is False
    assert {_chat(gateway, server.name)[0] for _ in range(8)} == {200}


def _places(gateway: Gateway) -> dict[int, WorkerPlace]:
    """Each worker's pid and its place (index, supervisor's control socket), from its environment."""
    return {pid: WorkerPlace.parse(psutil.Process(pid).environ()[WORKER_ENV]) for pid in _workers(gateway)}


def _rows(table: Path, target: str) -> list[int]:
    return counts_by_row(table, upstream_load_name(target))


def test_every_workers_requests_in_flight_are_counted_for_all_and_a_dead_ones_cleared(gateway, server):
    places = _places(gateway)
    table = in_flight_table(next(iter(places.values())).control)
    assert _rows(table, server.grpc) == [0] * WORKERS
    # Six long streams, each on a connection of its own (the kernel spreads them over the
    # workers): every one counts in its worker's row, which every worker reads.
    first_event = [threading.Event() for _ in range(6)]
    ended: list[tuple[int, Exception | None]] = []

    def stream(i: int) -> None:
        body = {"model": server.name, "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        try:
            with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {KEY}"},
                              timeout=CLIENT_TIMEOUT_S) as c, c.stream("POST", "/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first_event[i].set()
            ended.append((i, None))
        except httpx.HTTPError as exc:  # the stream of the worker killed below
            ended.append((i, exc))
        finally:
            first_event[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    engine = server.engine_cores()
    assert engine, [process_name(p) for p in server.descendants()]
    try:
        for event in first_event:
            assert event.wait(CLIENT_TIMEOUT_S), gateway.log.read_text()
        for p in engine:  # the streams stay in flight, however fast the engine, until it goes on
            p.send_signal(signal.SIGSTOP)
        rows = _rows(table, server.grpc)
        assert sum(rows) == 6 and not ended, (rows, ended)
        # The worker with the most of them dies: the supervisor zeroes its row before its
        # successor starts (a second later), so the others stop counting its requests.
        victim_index = max(range(WORKERS), key=lambda i: rows[i])
        victim = next(pid for pid, place in places.items() if place.index == victim_index)
        psutil.Process(victim).send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while f"(pid {victim}) ended with -9" not in gateway.log.read_text():
            assert time.monotonic() < deadline, gateway.log.read_text()
            time.sleep(0.05)
        after = _rows(table, server.grpc)
        assert after[victim_index] == 0 and sum(after) == 6 - rows[victim_index], (rows, after)
    finally:
        for p in engine:
            p.send_signal(signal.SIGCONT)
        for t in threads:
            t.join()
    # The dead worker's streams broke; the others ran to their end.
    assert len(ended) == 6 and sum(1 for _, exc in ended if exc is not None) == rows[victim_index], ended
    deadline = time.monotonic() + 30
    while sum(_rows(table, server.grpc)):  # every request's end counted
        assert time.monotonic() < deadline, _rows(table, server.grpc)
        time.sleep(0.1)
    deadline = time.monotonic() + 30
    while len(_workers(gateway)) < WORKERS:
        assert time.monotonic() < deadline, gateway.log.read_text()
        time.sleep(0.2)


def _requests_total(gateway: Gateway, key: str) -> float:
    text = httpx.get(gateway.metrics, timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "llmhost_gateway_requests"
               for s in f.samples if s.name.endswith("_total") and s.labels["key"] == key)


def test_a_killed_worker_is_replaced_and_the_metrics_add_up(gateway, server):
    before = _requests_total(gateway, "tester")
    victim = _workers(gateway)[0]
    psutil.Process(victim).send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while len(now := _workers(gateway)) < WORKERS or victim in now:
        assert time.monotonic() < deadline, gateway.log.read_text()
        time.sleep(0.2)
    assert f"(pid {victim}) ended with -9; starting it again" in gateway.log.read_text()
    assert [_chat(gateway, server.name)[0] for _ in range(8)] == [200] * 8
    # Every worker's counts, the dead one's too, in one /metrics.
    assert _requests_total(gateway, "tester") == before + 8
    text = httpx.get(gateway.metrics, timeout=30).text
    assert f'llmhost_gateway_upstream_state{{state="in_service",upstream="{server.grpc}"}} 1.0' in text
