"""Two booted hosts behind one gateway (issue 13, "many hosts").

Host A is the session's converged host. Host B is booted here and converged with
site.yml as an inference host whose gateway lists two upstreams: its own Triton
and A's (`gateway_upstreams`). Both hosts share this machine's network, so A's
Triton on 127.0.0.1 is reachable from B; on a real site A's Triton would listen on
a private address (llmhost_bind_address) for B's gateway to reach.

What must hold: requests through B's gateway are served by both hosts; while A's
tritonserver stops (drain, then down) and stays stopped, every request that starts
through the gateway is answered whole (none is lost); the gateway's metrics say A
is down, and say it is back once A serves again.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import requests
from _converge import METRICS_ADDRESS, Converged, converge
from _host import NAME_PREFIX, BootedHost, free_port

MODEL = "tiny"
READY_TIMEOUT_S = 300


@dataclass
class Pair:
    a: Converged  # the session's host: an upstream of B's gateway
    b: Converged  # the gateway's host: upstreams B and A
    a_upstream: str
    b_upstream: str

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.b.ports['gateway']}"

    @property
    def key(self) -> str:
        assert self.b.gateway_key_file is not None
        return self.b.gateway_key_file.read_text().strip()


@pytest.fixture(scope="module")
def pair(converged: Converged, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    a_upstream = f"127.0.0.1:{converged.ports['grpc']}"
    host_b = BootedHost.start(name=f"{NAME_PREFIX}{os.getpid()}-b")
    try:
        work = tmp_path_factory.mktemp("converge-b")
        # B's own gRPC port must be known before the converge: choose it here.
        b_grpc = free_port()
        b_upstream = f"127.0.0.1:{b_grpc}"
        b = converge(host_b, work, groups=("inference",),
                     ports={"grpc": b_grpc}, overrides={"gateway_upstreams": [b_upstream, a_upstream]})
        yield Pair(converged, b, a_upstream, b_upstream)
    finally:
        host_b.stop()


def _completion(p: Pair, prompt: str, max_tokens: int = 8) -> requests.Response:
    return requests.post(f"{p.gateway}/v1/completions", timeout=120,
                         headers={"Authorization": f"Bearer {p.key}"},
                         json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})


def _gateway_metrics(p: Pair) -> str:
    return requests.get(f"http://{METRICS_ADDRESS}:{p.b.ports['gateway_metrics']}/metrics", timeout=10).text


def _upstream_up(p: Pair) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^llmhost_gateway_upstream_up\{upstream="([^"]+)"\} (\S+)$', _gateway_metrics(p), re.M)}


def _served(c: Converged) -> float:
    """Successful inferences of MODEL on C's Triton, from its /metrics."""
    text = requests.get(f"{c.triton_metrics}/metrics", timeout=10).text
    m = re.search(rf'^nv_inference_request_success\{{model="{MODEL}",version="1"\}} (\S+)$', text, re.M)
    assert m, text[:2000]
    return float(m.group(1))


def _wait_for(what: str, check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(1)


def _triton_ready(c: Converged) -> bool:
    try:
        return requests.get(f"{c.triton_http}/v2/health/ready", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def test_requests_through_one_gateway_are_served_by_both_hosts(pair: Pair):
    _wait_for("both upstreams up", lambda: _upstream_up(pair) == {pair.b_upstream: 1.0, pair.a_upstream: 1.0})
    before = {"a": _served(pair.a), "b": _served(pair.b)}
    # Concurrent requests: least outstanding first sends the second of two at once elsewhere.
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda i: _completion(pair, f"request {i}:", max_tokens=32), range(24)))
    assert [r.status_code for r in answers] == [200] * 24, [r.text for r in answers if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 32 for r in answers)
    served = {"a": _served(pair.a) - before["a"], "b": _served(pair.b) - before["b"]}
    print(f"\n24 requests through host B's gateway: served by A {served['a']:.0f}, by B {served['b']:.0f}")
    assert served["a"] >= 1 and served["b"] >= 1, served
    assert served["a"] + served["b"] == 24, served


@dataclass
class _Load:
    """A client sending one request after another through the gateway until told to stop."""

    pair: Pair
    stop: threading.Event = field(default_factory=threading.Event)
    results: list[tuple[float, int, str]] = field(default_factory=list)  # (start, status, text or error)

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                r = _completion(self.pair, f"load {i}:")
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                self.results.append((t0, r.status_code, text))
            except requests.RequestException as exc:
                self.results.append((t0, -1, repr(exc)))
            i += 1


def test_stopping_one_hosts_tritonserver_loses_no_request(pair: Pair):
    _wait_for("both upstreams up", lambda: _upstream_up(pair) == {pair.b_upstream: 1.0, pair.a_upstream: 1.0})
    loads = [_Load(pair) for _ in range(4)]
    threads = [threading.Thread(target=load.run) for load in loads]
    a_host = pair.a.host
    try:
        for t in threads:
            t.start()
        time.sleep(5)
        stop_began = time.monotonic()
        a_host.exec(["systemctl", "stop", "tritonserver"], check=True, timeout=300)
        stopped = time.monotonic()
        _wait_for("the gateway sees A down", lambda: _upstream_up(pair).get(pair.a_upstream) == 0.0)
        b_at_down = _served(pair.b)
        time.sleep(10)  # A stays down while the load goes on
        b_served_while_a_down = _served(pair.b) - b_at_down
        for load in loads:
            load.stop.set()
        for t in threads:
            t.join(timeout=180)
    finally:
        for load in loads:
            load.stop.set()
        a_host.exec(["systemctl", "start", "tritonserver"], timeout=300)
        deadline = time.monotonic() + READY_TIMEOUT_S  # the next tests want A serving
        while not _triton_ready(pair.a) and time.monotonic() < deadline:
            time.sleep(2)
    results = [r for load in loads for r in load.results]
    after = [r for r in results if r[0] >= stop_began]
    failed = [r for r in after if r[1] != 200 or not r[2]]
    print(f"\nA's tritonserver stopped in {stopped - stop_began:.1f} s; {len(results)} requests through the gateway, "
          f"{len(after)} started after the stop began, {len(failed)} of those failed")
    assert len(after) >= 8, f"too few requests during the stop to show anything: {len(after)}"
    assert not failed, failed[:5]
    assert b_served_while_a_down >= 1, "B served nothing while A was down"
    # A comes back: the health checks put it in again.
    assert _triton_ready(pair.a), "A's tritonserver did not serve again after its start"
    _wait_for("the gateway sees A up again", lambda: _upstream_up(pair).get(pair.a_upstream) == 1.0)


def test_the_unit_on_the_gateway_host_names_both_upstreams(pair: Pair):
    unit = pair.b.host.exec(["systemctl", "cat", "llmhost-gateway"], check=True).stdout
    assert re.findall(r"--upstream (\S+)", unit) == [pair.b_upstream, pair.a_upstream], unit
