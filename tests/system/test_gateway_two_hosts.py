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

Last, playbooks/rolling.yml rolls changes over A and B while clients send requests
through C's gateway (see the section at the end).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.conftest import FIGURE
from tests.harness.booted import NAME_PREFIX, BootedHost
from tests.harness.net import free_port
from tests.harness.paths import ROOT
from tests.harness.repository import wait_until
from tests.system._converge import (
    HOST_MODELS,
    METRICS_ADDRESS,
    Converged,
    changed_tasks,
    converge,
    recap,
    run_playbook,
)
from tests.system._unit import PLAY_WAIT_S

MODEL = "tiny"
READY_TIMEOUT_S = PLAY_WAIT_S
# How long a gateway may take to put an upstream that is ready in service again.
GATEWAY_TAKES_IN_S = 180

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
        # vLLM's CPU engine binds its worker to every core but the last one it sees: on a
        # machine of two cores, core 0, for A's engine and B's alike. B's goes on core 1,
        # so that the two hosts do not take turns on one core while both serve.
        demo_environment = yaml.safe_load((ROOT / "inventory" / "demo.yml").read_text())["triton_service_environment"]
        b = converge(host_b, work, groups=("inference",), ports={"grpc": b_grpc},
                     overrides={"gateway_upstreams": [b_upstream, a_upstream],
                                "triton_service_environment": {**demo_environment, "VLLM_CPU_OMP_THREADS_BIND": "1"}})
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
    assert wait_until(check, timeout_s, every_s=1), f"not within {timeout_s:.0f} s: {what}"


def _triton_ready(c: Converged) -> bool:
    try:
        return requests.get(f"{c.triton_http}/v2/health/ready", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def test_requests_through_one_gateway_are_served_by_both_hosts(pair: Pair):
    _wait_for("both upstreams up", lambda: _upstream_up(pair) == {pair.b_upstream: 1.0, pair.a_upstream: 1.0})
    before = {"a": _served(pair.a), "b": _served(pair.b)}
    # 24 prompts of their own: cache-aware routing (the default) spreads their keys over both hosts.
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
        a_host.exec(["systemctl", "start", "--no-block", "tritonserver"], timeout=300)
        wait_until(lambda: _triton_ready(pair.a), READY_TIMEOUT_S, every_s=2)  # the next tests want A serving
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
        port, metrics_port, node_port, grpc_door_port = free_port(), free_port(), free_port(), free_port()
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
            "gateway_port": port, "gateway_metrics_port": metrics_port, "gateway_grpc_port": grpc_door_port,
            "gateway_demo_key_file": str(key_file),
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


# -- a rolling change behind the gateways (playbooks/rolling.yml) -----------------------
#
# A and B are the inference hosts, C's gateway is in front of both. Two clients (one
# streaming, one not) send requests through C for the whole test while rolling.yml runs:
# 1. a change that breaks the first host (an engine argument vLLM does not know): the
#    roll stops at A, which stays held on the gateways; B is neither restarted nor
#    rewritten, and serves alone;
# 2. the change that works, a new engine argument and a newer llmhost build (this
#    source tree with a higher version), over A then B;
# 3. the same roll once more, on B: nothing to change, so changed=0 and nobody is held.
# No request through C fails and no stream ends early. A and B keep the change: this
# module runs last among the system tests (tests/conftest.py), so no later test
# expects A as the session converged it.

# A build newer than the one in this tree: pyproject's version, then .post1.
NEW_VERSION = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1] + ".post1"  # type: ignore[index]
ADMIN_KEY_FILE = "/etc/llmhost/llmhost-gateway-admin-key"
LOAD_MAX_TOKENS = 8
LOAD_PAUSE_S = 3.0  # between one client's requests: the rolls share this machine's two cores


@dataclass
class _Outcome:
    start: float
    end: float
    streamed: bool
    ok: bool
    truncated: bool = False
    detail: str = ""


@dataclass
class _Traffic:
    """Two clients sending requests through a gateway, one after another each, until
    stopped: one streams, one does not. The `openai` client with retries off, so every
    failure counts; a stream counts as whole only with its finish_reason."""

    url: str
    key: str
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list[_Outcome] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def _one(self, client: Any, streamed: bool, i: int) -> _Outcome:
        start = time.monotonic()
        args = {"model": MODEL, "prompt": f"roll {i}:", "max_tokens": LOAD_MAX_TOKENS,
                "extra_body": {"ignore_eos": True}}
        chunks, finish = 0, None
        try:
            if streamed:
                for chunk in client.completions.create(stream=True, **args):
                    if chunk.choices:
                        chunks += 1
                        finish = chunk.choices[0].finish_reason or finish
                ok = finish == "length"
                return _Outcome(start, time.monotonic(), True, ok, truncated=not ok,
                                detail=f"{chunks} chunks, finish_reason {finish}")
            r = client.completions.create(**args)
            ok = r.usage is not None and r.usage.completion_tokens == LOAD_MAX_TOKENS
            return _Outcome(start, time.monotonic(), False, ok, detail=f"usage {r.usage}")
        except Exception as exc:  # noqa: BLE001 - every failure of a request is an outcome to count
            # A stream that broke after its first chunk is a truncated stream.
            return _Outcome(start, time.monotonic(), streamed, False, truncated=streamed and chunks > 0,
                            detail=f"{type(exc).__name__}: {exc}"[:400])

    def _run(self, client: Any, streamed: bool) -> None:
        i = 0
        while not self.stop.is_set():
            self.outcomes.append(self._one(client, streamed, i))
            i += 1
            self.stop.wait(LOAD_PAUSE_S)

    def start(self) -> None:
        from openai import OpenAI

        def client() -> Any:
            return OpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0, timeout=120)

        self.threads = [threading.Thread(target=self._run, args=(client(), streamed), daemon=True)
                        for streamed in (True, False)]
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)

    def between(self, t0: float, t1: float) -> list[_Outcome]:
        return [o for o in list(self.outcomes) if o.start < t1 and o.end > t0]


def _pool_changes(host: BootedHost) -> list[str]:
    """The changes of its upstreams' states that the gateway on HOST wrote to its journal
    (llmhost.gateway.routing.pool), each with its time."""
    log = host.exec(["journalctl", "-u", "llmhost-gateway", "--no-pager", "-o", "short-precise"]).stdout
    return [f"{line.split()[2]} {line[line.index(': upstream ') + 2:]}" for line in log.splitlines()
            if ": upstream " in line][-60:]


# What a start of tritonserver leaves in its unit's journal: systemd's lines about the unit,
# the start check's verdict (llmhost.server.startcheck), Triton's model loads.
_START_LINES = re.compile(r"tritonserver\.service: |(Started|Stopped|Stopping) tritonserver|tritonserver answers at "
                          r"|taken as a start that hangs|successfully loaded|failed to load|not healthy")


def _starts(host: BootedHost, since_epoch: float) -> list[str]:
    """The lines of HOST's tritonserver journal since SINCE_EPOCH that tell how its starts went."""
    log = host.exec(["journalctl", "-u", "tritonserver", "--no-pager", "-o", "short-precise",
                     f"--since=@{since_epoch:.0f}"]).stdout
    return [f"{line.split()[2]} {line.split(': ', 1)[-1][:160]}" for line in log.splitlines()
            if _START_LINES.search(line)][-40:]


def _counts(outcomes: list[_Outcome]) -> str:
    failed = [o for o in outcomes if not o.ok]
    return (f"failed requests: {len(failed)} of {len(outcomes)} "
            f"({sum(o.streamed for o in outcomes)} streamed, {sum(not o.streamed for o in outcomes)} not), "
            f"truncated streams: {sum(o.truncated for o in outcomes)}")


def _newer_build(work: Path) -> Path:
    """This llmhost source tree as python_env copies it (pyproject.toml, src/), with a
    higher version: a newer build."""
    tree = work / "llmhost-newer"
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, tree / name)
    for path, name in ((tree / "pyproject.toml", "version"), (tree / "src" / "llmhost" / "__init__.py", "__version__")):
        text, n = re.subn(rf'^{name} = "[^"]+"', f'{name} = "{NEW_VERSION}"', path.read_text(), count=1, flags=re.M)
        assert n == 1, path
        path.write_text(text)
    return tree


def _models(tiny_engine_args: dict[str, Any]) -> list[dict[str, Any]]:
    """The session's models, with TINY_ENGINE_ARGS added to the engine arguments of MODEL."""
    return [{**m, "engine_args": {**(m.get("engine_args") or {}), **tiny_engine_args}} if m["name"] == MODEL else m
            for m in HOST_MODELS]


def _inventory(pair: Pair, c: GatewayOnly, work: Path, name: str, models: list[dict[str, Any]],
               source_dir: Path = ROOT, host_vars: dict[str, dict[str, Any]] | None = None) -> tuple[Path, Path]:
    """(inventory, extra vars) of A and B in `inference` and C in `gateway`: each inference
    host with the variables of its converge and HOST_VARS[its name] as host variables,
    MODELS and SOURCE_DIR for both."""
    # inventory/demo.yml comes as extra vars (run_playbook), which beat host variables: a
    # key it sets too (gateway_api_keys, B's triton_service_environment) goes to each host
    # under a name of its own, and the extra vars read it back from there, so that every
    # host keeps the value of its converge (or demo.yml's, where its converge had none).
    demo = yaml.safe_load((ROOT / "inventory" / "demo.yml").read_text())
    converged = {conv.host.name: json.loads(conv.extra_vars.read_text()) for conv in (pair.a, pair.b)}
    shadowed = sorted((set(demo) & {k for own in converged.values() for k in own}) - {"llmhost_models"})

    def own_names(values: dict[str, Any]) -> dict[str, Any]:
        return {**{k: v for k, v in values.items() if k not in shadowed},
                **{f"rolling_test_{k}": values.get(k, demo[k]) for k in shadowed}}

    inference = {conv.host.name: {**conv.host.host_vars(), **own_names(converged[conv.host.name]),
                                  **(host_vars or {}).get(conv.host.name, {})}
                 for conv in (pair.a, pair.b)}
    inventory = work / f"{name}-inventory.json"
    inventory.write_text(json.dumps({"all": {"children": {
        "inference": {"hosts": inference},
        "gateway": {"hosts": {c.host.name: {**c.host.host_vars(), **own_names({})}}}}}}))
    extra_file = work / f"{name}-vars.json"
    extra_file.write_text(json.dumps({**{k: f"{{{{ rolling_test_{k} }}}}" for k in shadowed},
                                      "llmhost_models": models, "llmhost_source_dir": str(source_dir)}))
    return inventory, extra_file


def _roll(pair: Pair, c: GatewayOnly, work: Path, record: Any, name: str, *args: str, models: list[dict[str, Any]],
          source_dir: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """playbooks/rolling.yml over A then B (C in the group `gateway`), each inference host
    with the variables of its converge as host variables, MODELS and SOURCE_DIR for both."""
    inventory, extra_file = _inventory(pair, c, work, name, models, source_dir)
    began = time.monotonic()
    log = work / f"{name}.log"  # Ansible's log: each line with its time, so how long each task took
    r = run_playbook(inventory, extra_file, pair.a.host.pip_vars_file, "playbooks/rolling.yml", *args,
                     env={"ANSIBLE_LOG_PATH": str(log)})
    (work / f"{name}.out").write_text(r.stdout + r.stderr)
    record(FIGURE, f"rolling.yml ({name}): rc {r.returncode} in {time.monotonic() - began:.0f} s ({work / name}.out); "
                   f"slowest tasks: {_slowest_tasks(log.read_text(errors='replace') if log.exists() else '')}")
    return r


_LOGGED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) p=\d+ u=\S+ n=\S+ \w+\| (.*)$", re.M)
_BANNER = re.compile(r"^(TASK|RUNNING HANDLER|PLAY RECAP|PLAY) ?(?:\[(.*)\])?")
_RESULT_HOST = re.compile(r"^\w+: \[([^]]+)\]")


def _slowest_tasks(log: str, n: int = 8) -> str:
    """The N slowest tasks (and handlers) of an ansible-playbook run, from its log
    (ANSIBLE_LOG_PATH): each one from its banner to the next banner, with the host of
    its first result."""
    spans: list[list[Any]] = []  # [name, host, start, end]
    for m in _LOGGED.finditer(log):
        when = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
        banner, result = _BANNER.match(m.group(3)), _RESULT_HOST.match(m.group(3))
        if banner:
            if spans and spans[-1][3] is None:
                spans[-1][3] = when
            if banner.group(1) in ("TASK", "RUNNING HANDLER"):
                spans.append([banner.group(2) or "?", "", when, None])
        elif result and spans and not spans[-1][1]:
            spans[-1][1] = result.group(1)
    done = sorted(((end - start, f"[{host}] {name}") for name, host, start, end in spans if end is not None),
                  reverse=True)
    slowest = "; ".join(f"{what[:100]} {seconds:.0f} s" for seconds, what in done[:n])
    return f"{len(done)} tasks, {sum(t for t, _ in done):.0f} s in all: {slowest}"


def _upstreams_on_c(c: GatewayOnly, key: str) -> dict[str, dict[str, Any]]:
    r = requests.get(f"http://127.0.0.1:{c.port}/admin/upstreams", headers={"Authorization": f"Bearer {key}"},
                     timeout=10)
    assert r.status_code == 200, r.text
    return {u["target"]: u for u in r.json()["upstreams"]}


def _invocation(conv: Converged) -> str:
    show = ["systemctl", "show", "-p", "InvocationID", "--value", "tritonserver"]
    return conv.host.exec(show, check=True).stdout.strip()


def _model_json(conv: Converged) -> str:
    return conv.host.exec(["cat", f"/opt/llmhost/models/{MODEL}/model.json"], check=True).stdout


def _version(conv: Converged) -> str:
    return conv.host.exec(["/opt/llmhost/venv/bin/llmhost", "--version"], check=True).stdout.strip()


def _recap_of(out: str, host: str) -> dict[str, int]:
    m = re.search(rf"^{re.escape(host)}\s*:\s*(ok=\d+.*)$", out.split("PLAY RECAP", 1)[-1], re.M)
    assert m, out[-3000:]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}


HOLD_TASK = "Hold this host out of every gateway's pool]"


def _admin_key_with_both_in_service(p: Pair, c: GatewayOnly) -> str:
    """C's admin key, once C's gateway has A and B in service."""
    admin_key = c.host.exec(["cat", ADMIN_KEY_FILE], check=True).stdout.strip()
    _wait_for("A and B in service on C", lambda: {t: u["state"] for t, u in _upstreams_on_c(c, admin_key).items()}
              == {p.a_upstream: "in_service", p.b_upstream: "in_service"})
    return admin_key


def _state(conv: Converged) -> tuple[str, str, str]:
    """What a restart or a rewrite of a host changes: tritonserver's invocation, MODEL's
    model.json, the llmhost version."""
    return _invocation(conv), _model_json(conv), _version(conv)


def _assert_rolled_no_change(r: subprocess.CompletedProcess[str], host: BootedHost, c: GatewayOnly,
                             admin_key: str) -> None:
    assert r.returncode == 0, r.stdout[-6000:]
    assert _recap_of(r.stdout, host.name)["changed"] == 0, changed_tasks(r.stdout)
    assert HOLD_TASK not in r.stdout, f"a roll without a change held {host.name}"
    assert not any(u["held"] for u in _upstreams_on_c(c, admin_key).values())


def test_rolling_a_change_over_both_hosts_fails_no_request(pair: Pair, gateway_only: GatewayOnly, tmp_path: Path,
                                                         record_property: Any):
    """The counts of each phase are figures of the run (tests/conftest.py prints them)."""
    a, b, c = pair.a, pair.b, gateway_only
    admin_key = _admin_key_with_both_in_service(pair, c)
    newer = _newer_build(tmp_path)
    good_models = _models({"max_num_seqs": 16})
    before_b = _state(b)
    traffic = _Traffic(f"http://127.0.0.1:{c.port}", c.key)
    marks: list[tuple[str, float]] = []  # (what ran up to then, when it ended)

    traffic.start()
    began_epoch = time.time()
    try:
        time.sleep(3)
        began = time.monotonic()
        # 1. A change that breaks the first host: the roll stops there, B is not touched.
        broken = _roll(pair, c, tmp_path, record_property, "broken", models=_models({"no_such_engine_argument": 1}))
        marks.append(("while the broken change stopped at A", time.monotonic()))
        out = broken.stdout
        assert broken.returncode != 0, out[-6000:]
        assert f"The roll stopped at {a.host.name}" in out, out[-6000:]
        assert "no_such_engine_argument" in out, out[-6000:]
        assert HOLD_TASK in out, out[-6000:]
        # B got no task at all (the roll stopped before its turn): nothing changed or failed there.
        assert not re.search(rf"^(changed|fatal|failed): \[{re.escape(b.host.name)}\b", out, re.M), out[-6000:]
        assert _state(b) == before_b, (
            "a roll that stopped at A changed B (restarted it or rewrote its files)")
        upstreams = _upstreams_on_c(c, admin_key)
        assert upstreams[pair.a_upstream]["held"], upstreams
        b_entry = upstreams[pair.b_upstream]
        assert (b_entry["state"], b_entry["held"]) == ("in_service", False), upstreams

        # 2. The change that works, with a newer llmhost build: repairs A, then changes B.
        # Nothing rolls on after it fails: A would stay held and B be held too.
        good = _roll(pair, c, tmp_path, record_property, "good", models=good_models, source_dir=newer)
        marks.append(("while the change rolled over A and B", time.monotonic()))
        assert good.returncode == 0, good.stdout[-8000:]
        versions = {"a": _version(a), "b": _version(b)}
        assert all(NEW_VERSION in v for v in versions.values()), versions
        model_json = {"a": _model_json(a), "b": _model_json(b)}
        assert all(json.loads(j).get("max_num_seqs") == 16 for j in model_json.values()), model_json
        upstreams = _upstreams_on_c(c, admin_key)
        assert {t: (u["state"], u["held"]) for t, u in upstreams.items()} == {
            pair.a_upstream: ("in_service", False), pair.b_upstream: ("in_service", False)}, upstreams

        # 3. The same again, on B: nothing to change, nobody held, nothing restarted.
        before_again = _state(b)
        again = _roll(pair, c, tmp_path, record_property, "again", "--limit", b.host.name, models=good_models,
                      source_dir=newer)
        marks.append(("while the roll without a change ran on B", time.monotonic()))
        _assert_rolled_no_change(again, b.host, c, admin_key)
        assert _state(b) == before_again, "a roll without a change restarted B"
    finally:
        traffic.finish()
        start = began if marks else time.monotonic()
        for what, end in marks:
            record_property(FIGURE, f"{what}: {_counts(traffic.between(start, end))}")
            start = end
        everything = traffic.between(began, marks[-1][1]) if marks else []
        record_property(FIGURE, f"all through C during the rolls: {_counts(everything)}")
        record_property(FIGURE, "what C's gateway saw of its upstreams: " + "; ".join(_pool_changes(c.host)))
        for name, host in (("A", a.host), ("B", b.host)):
            record_property(FIGURE, f"tritonserver's starts on {name} during the rolls: "
                            + "; ".join(_starts(host, began_epoch)))

    ends = [end for _, end in marks]
    assert all(len(traffic.between(t0, t1)) >= 4 for t0, t1 in zip([began, *ends], ends, strict=False)), marks
    failed = [o for o in everything if not o.ok]
    assert not failed, [(o.streamed, o.detail) for o in failed[:10]]


# -- one model across A and B (playbooks/serving.yml) -----------------------------------
#
# Last, a model bigger than one host, as the inventory gives one: ACROSS with nodes
# [A, B] and pipeline parallel 2. serving.yml over A and B together: A serves it in its
# Triton (the head, node 0 at 127.0.0.1), B runs its second stage in the unit
# llmhost-follow@ACROSS (node 1 at 127.0.0.2; the hosts share this machine's network, and
# all of 127/8 reaches lo). The hosts keep serving MODEL. vllm-cpu runs pipeline parallel
# only compiled (tests/e2e/test_multinode.py says why), hence enforce_eager false, and
# torch.compile on (triton_service_cpu_torch_compile: the triton role installs g++ and
# Python's headers for it).

ACROSS = "tiny-pp"
FOLLOWER_UNIT = f"llmhost-follow@{ACROSS}"
B_NODE_ADDRESS = "127.0.0.2"
# The bound: a stopped follower makes the model not ready within this.
NOT_READY_WITHIN_S = 30.0


@dataclass
class Across:
    first: subprocess.CompletedProcess[str]
    second: subprocess.CompletedProcess[str]
    checked: subprocess.CompletedProcess[str]  # --check --diff


def _across_models(node_port: int, a: BootedHost, b: BootedHost) -> list[dict[str, Any]]:
    return [*HOST_MODELS, {"name": ACROSS, "source": "tiny", "max_model_len": 512, "nodes": [a.name, b.name],
                           "node_port": node_port,
                           "engine_args": {"pipeline_parallel_size": 2, "enforce_eager": False}}]


@pytest.fixture(scope="module")
def across(pair: Pair, gateway_only: GatewayOnly, tmp_path_factory: pytest.TempPathFactory) -> Across:
    work = tmp_path_factory.mktemp("across")
    models = _across_models(free_port(), pair.a.host, pair.b.host)
    # B's gateway (upstreams B and A) serves ACROSS too: only A, its head, has it.
    compiled = {"triton_service_cpu_torch_compile": True}
    inventory, extra = _inventory(pair, gateway_only, work, "across", models, host_vars={
        pair.a.host.name: {**compiled, "llmhost_node_address": "127.0.0.1"},
        pair.b.host.name: {**compiled, "llmhost_node_address": B_NODE_ADDRESS, "gateway_models": [MODEL, ACROSS]}})
    limit = ("--limit", f"{pair.a.host.name},{pair.b.host.name}")
    first = run_playbook(inventory, extra, pair.a.host.pip_vars_file, "playbooks/serving.yml", *limit)
    (work / "first.out").write_text(first.stdout + first.stderr)
    assert first.returncode == 0, f"serving.yml failed:\n{first.stdout[-8000:]}\n{first.stderr[-3000:]}"
    second = run_playbook(inventory, extra, pair.a.host.pip_vars_file, "playbooks/serving.yml", *limit)
    checked = run_playbook(inventory, extra, pair.a.host.pip_vars_file, "playbooks/serving.yml", *limit,
                           "--check", "--diff")
    return Across(first, second, checked)


def _model_ready(c: Converged, model: str) -> bool:
    try:
        return requests.get(f"{c.triton_http}/v2/models/{model}/ready", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def _follower_processes(host: BootedHost) -> list[str]:
    """The processes of HOST in a follower unit's control group (PID and command line)."""
    script = ("for f in /proc/[0-9]*/cgroup; do grep -q 'llmhost-follow@' \"$f\" 2>/dev/null && "
              "{ p=${f%/cgroup}; echo \"${p#/proc/} $(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\"; }; done; true")
    return [line for line in host.exec(["sh", "-c", script], check=True).stdout.splitlines() if line.strip()]


def test_a_model_across_two_hosts_serves_from_its_head(pair: Pair, across: Across):
    a, b = pair.a, pair.b
    assert _model_ready(a, ACROSS), "the head does not serve the model across hosts"
    # B does not serve it in its Triton: it runs the model's second stage for A.
    index = b.host.exec(["cat", f"/opt/llmhost/models/{ACROSS}/config.pbtxt"])
    assert index.returncode != 0, "B's model repository holds the model it follows"
    assert b.host.exec(["systemctl", "is-active", FOLLOWER_UNIT]).stdout.strip() == "active"
    assert any("VLLM" in p or "llmhost follow" in p for p in _follower_processes(b.host)), _follower_processes(b.host)
    head_json = json.loads(a.host.exec(["cat", f"/opt/llmhost/models/{ACROSS}/model.json"], check=True).stdout)
    follow_json = json.loads(b.host.exec(["cat", f"/opt/llmhost/follow/{ACROSS}/model.json"], check=True).stdout)
    assert head_json == follow_json, (head_json, follow_json)
    assert {k: head_json[k] for k in ("nnodes", "node_rank", "master_addr", "pipeline_parallel_size")} == {
        "nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "pipeline_parallel_size": 2}, head_json
    assert (head_json["llmhost"]["followers"], head_json["llmhost"]["host_ip"]) == (B_NODE_ADDRESS, "127.0.0.1")
    env = b.host.exec(["cat", f"/opt/llmhost/follow/{ACROSS}/follow.env"], check=True).stdout
    assert env.split() == ["LLMHOST_NODE_RANK=1", f"LLMHOST_HOST_IP={B_NODE_ADDRESS}"], env
    # Through B's gateway (upstreams B and A): ACROSS only from A, MODEL from both.
    for model in (ACROSS, MODEL, ACROSS):
        r = requests.post(f"{pair.gateway}/v1/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {pair.key}"},
                          json={"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, (model, r.text)
        assert r.json()["usage"]["completion_tokens"] >= 1
    # The play's check of TCP between the hosts ran: B reached A's node_port and A's
    # other port, A reached B's one; no listener is left.
    for run in (across.first, across.second):
        assert f"[{b.host.name}] => (item={ACROSS}: 2 port(s) of its other hosts)" in run.stdout, run.stdout[-4000:]
        assert f"[{a.host.name}] => (item={ACROSS}: 1 port(s) of its other hosts)" in run.stdout, run.stdout[-4000:]
    for host in (a.host, b.host):
        script = ("for f in /proc/[0-9]*/cmdline; do { tr '\\0' ' ' < $f; } 2>/dev/null | grep -q 'nodecheck [l]isten' "
                  "&& echo $f; done; true")
        assert host.exec(["sh", "-c", script], check=True).stdout.strip() == "", f"a nodecheck listener on {host.name}"
    # The follower reports itself joined for node_exporter, through the link in its directory.
    prom = b.host.exec(["cat", f"/var/lib/prometheus/node-exporter/llmhost_follower_{ACROSS}.prom"], check=True).stdout
    assert f'llmhost_follower_joined{{model="{ACROSS}"}} 1.0' in prom, prom


def test_the_hosts_of_a_model_across_hosts_converge_to_no_change(pair: Pair, across: Across):
    for run in (across.second, across.checked):  # again, then again with --check --diff
        out = run.stdout
        assert run.returncode == 0, out[-6000:]
        for host in (pair.a.host, pair.b.host):
            assert _recap_of(out, host.name)["changed"] == 0, changed_tasks(out)


def test_a_stopped_follower_makes_the_model_across_hosts_not_ready_then_ready_again(pair: Pair, across: Across,
                                                                             record_property: Any):
    a, b = pair.a, pair.b
    _wait_for("the model across hosts ready", lambda: _model_ready(a, ACROSS), timeout_s=READY_TIMEOUT_S)
    stopped = time.monotonic()
    b.host.exec(["systemctl", "stop", FOLLOWER_UNIT], check=True, timeout=120)
    gone = wait_until(lambda: not _model_ready(a, ACROSS), 120, every_s=0.5)
    not_ready_after = time.monotonic() - stopped
    # Nothing of the follower is left on B once its unit stopped.
    assert _follower_processes(b.host) == []
    b.host.exec(["systemctl", "start", FOLLOWER_UNIT], check=True, timeout=120)
    restarted = time.monotonic()
    back = wait_until(lambda: _model_ready(a, ACROSS), READY_TIMEOUT_S, every_s=2)
    record_property(FIGURE, f"{ACROSS}: not ready {not_ready_after:.1f} s after its follower's unit stopped; "
                            f"ready again {time.monotonic() - restarted:.0f} s after it started")
    assert gone and not_ready_after <= NOT_READY_WITHIN_S, f"still ready {not_ready_after:.1f} s after the stop"
    assert back, "the model did not come back after its follower's unit started again"
    _wait_for("MODEL ready on A again", lambda: _model_ready(a, MODEL), timeout_s=READY_TIMEOUT_S)
    # A's tritonserver restarted (its engine lost the follower): B's gateway takes A in
    # again after its health checks pass in a row (one answered late, under the load of
    # the other workers, starts the count again: once it took over 60 s).
    assert wait_until(lambda: _upstream_up(pair).get(pair.a_upstream) == 1.0, GATEWAY_TAKES_IN_S, every_s=1), (
        f"not within {GATEWAY_TAKES_IN_S} s: B's gateway sees A up again; what it saw: {_pool_changes(b.host)}")
    r = requests.post(f"{pair.gateway}/v1/completions", timeout=120, headers={"Authorization": f"Bearer {pair.key}"},
                      json={"model": ACROSS, "prompt": "back", "max_tokens": 4})
    assert r.status_code == 200, r.text
