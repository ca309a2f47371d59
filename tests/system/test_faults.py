"""Faults on the booted host, for real: SIGKILL of tritonserver or of vLLM's
EngineCore alone, `systemctl stop` with streams in flight, models whose weights
are corrupt or missing, and weights staging cut off by a dropped download or a
full disk.

The host is shared by every system test: each test here leaves it serving the
tiny model as the converge left it (restoring in `finally`), so the tests after
it (a second converge must report changed=0) see the converged state.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import os
import re
import shlex
import signal
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from llmhost.smoke import parse_sse
from tests.harness.booted import BootedHost
from tests.harness.paths import ROOT
from tests.system._converge import HOST_MODELS, Converged, run_playbook
from tests.system._unit import (
    MODEL,
    PLAY_WAIT_S,
    USER,
    endpoint,
    processes,
    props,
    shm_segments,
    unit_pids,
    wait_active,
    wait_ready,
)

# Generous bounds that define the behaviour, not performance targets.
RECOVERY_TIMEOUT_S = PLAY_WAIT_S
STREAM_TOKENS = 450  # the tiny model's max_model_len is 512
# 16 streams of 300 tokens took about 13 s on 2 cores alone; 200 keep them well within
# the drain timeout (30 s) while another test worker shares the cores.
DRAIN_STREAM_TOKENS = 200
FAULTS_DIR = "/srv/llmhost-faults"  # scratch space in the host


def _demo_models() -> list[dict[str, Any]]:
    return [dict(m) for m in HOST_MODELS]


def _vars(c: Converged, path: Path, **extra: Any) -> Path:
    """The converge's extra vars plus EXTRA, as a file for `-e @file`."""
    path.write_text(json.dumps({**json.loads(c.extra_vars.read_text()), **extra}))
    return path


def _failed_msgs(out: str) -> str:
    """The `msg` of every failed task in ansible-playbook's output (one string)."""
    # YAML output folds a long msg over lines: compare with whitespace collapsed.
    return " ".join(" ".join(m.group(0).split()) for m in re.finditer(r"fatal: \[.*?(?=\n\S|\Z)", out, re.S))


# -- SIGKILL ---------------------------------------------------------------------------


def test_sigkill_of_tritonserver_restarts_it_without_orphans_or_shm(converged: Converged):
    host = converged.host
    assert wait_ready(converged.triton_http, timeout_s=RECOVERY_TIMEOUT_S)
    before = props(host, "MainPID", "NRestarts")
    old_pids = unit_pids(host)
    old_procs = processes(host, USER)
    assert any("EngineCore" in a for a in old_procs.values()), old_procs  # the engine runs in its own process
    assert set(old_procs) <= old_pids, "a process of the service user outside the unit's control group"
    old_shm = shm_segments(host)

    t0 = time.monotonic()
    host.exec(["kill", "-KILL", before["MainPID"]], check=True)
    assert wait_ready(converged.triton_http, timeout_s=RECOVERY_TIMEOUT_S), host.exec(
        "journalctl -u tritonserver -n 60 --no-pager").stdout
    recovery_s = time.monotonic() - t0

    assert wait_active(host) == "active"
    after = props(host, "MainPID", "NRestarts", "ActiveState")
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1, (before, after)
    assert after["MainPID"] != before["MainPID"]
    # No process of the killed instance is left, anywhere in the host.
    survivors = {pid: args for pid, args in processes(host).items() if pid in old_pids}
    assert not survivors, f"orphaned processes of the killed instance: {survivors}"
    # Every process of the service user is in the new instance's control group.
    assert set(processes(host, USER)) <= unit_pids(host)
    # No shared memory segment of the killed instance is left (RemoveIPC=, KillMode=control-group).
    left = old_shm & shm_segments(host)
    assert not left, f"/dev/shm segments of the killed instance: {left}"
    log = host.exec("journalctl -u tritonserver --no-pager -o cat -n 400").stdout
    assert "status=9/KILL" in log
    print(f"\nSIGKILL -> ready again in {recovery_s:.1f} s (RestartSec "
          f"{props(host, 'RestartUSec')['RestartUSec']}); {len(old_pids)} processes and "
          f"{len(old_shm)} shm segments of the killed instance, none left")


# A start bound short enough for a test, for the one stuck start only: a normal start
# of the tiny model takes longer. The unit's is triton_service_ready_timeout_s.
HUNG_START_BOUND_S = 30
HUNG_DROPIN = "/run/systemd/system/tritonserver.service.d"


def _drop_short_start_bound(host: BootedHost) -> None:
    host.exec(["rm", "-rf", HUNG_DROPIN], check=True)
    host.exec(["systemctl", "daemon-reload"], check=True)


def test_a_start_that_never_answers_is_failed_and_started_again(converged: Converged):
    """A tritonserver stuck in its start (here: stopped with SIGSTOP before it answers,
    as a load wedged in Triton's python backend leaves it: alive, never answering) is
    failed by the unit's start check, killed, and started again by systemd; the next
    start serves. The check's bound is shortened by a runtime drop-in for the stuck
    start, and put back as soon as the check has failed it, before systemd's restart."""
    host = converged.host
    assert wait_ready(converged.triton_http, timeout_s=RECOVERY_TIMEOUT_S)
    unit = host.exec(["cat", "/etc/systemd/system/tritonserver.service"], check=True).stdout
    (post,) = [ln for ln in unit.splitlines() if ln.startswith("ExecStartPost=")]
    assert "-m llmhost.server.startcheck" in post, post
    short = re.sub(r"--timeout-s \d+", f"--timeout-s {HUNG_START_BOUND_S}", post)
    conf = f"[Service]\nExecStartPost=\n{short}\nTimeoutStartSec={HUNG_START_BOUND_S + 30}\n"
    before = props(host, "MainPID", "NRestarts")
    since = host.exec(["date", "+%Y-%m-%d %H:%M:%S"], check=True).stdout.strip()
    host.exec(["mkdir", "-p", HUNG_DROPIN], check=True)
    host.exec(f"printf %s {shlex.quote(conf)} > {HUNG_DROPIN}/zz-test-start-bound.conf", check=True)
    failed_line, stuck = "", ""
    try:
        host.exec(["systemctl", "daemon-reload"], check=True)
        host.exec(["systemctl", "restart", "--no-block", "tritonserver"], check=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and stuck in ("", "0", before["MainPID"]):
            stuck = props(host, "MainPID")["MainPID"]
            time.sleep(0.2)
        host.exec(["kill", "-STOP", stuck], check=True)
        t0 = time.monotonic()
        assert props(host, "ActiveState")["ActiveState"] == "activating"
        # The check gives up after its bound; from then on the normal bound holds again.
        deadline = time.monotonic() + HUNG_START_BOUND_S + 60
        while time.monotonic() < deadline and not failed_line:
            log = host.exec(["journalctl", "-u", "tritonserver", "--no-pager", "-o", "cat", "--since", since]).stdout
            failed_line = next((ln for ln in log.splitlines() if "did not answer at" in ln), "")
            time.sleep(0.5)
    finally:
        _drop_short_start_bound(host)
    try:
        assert failed_line, host.exec("journalctl -u tritonserver -n 60 --no-pager").stdout
        assert f"within {HUNG_START_BOUND_S} s" in failed_line, failed_line
        # systemd kills the stopped server and starts it again after RestartSec.
        assert wait_ready(converged.triton_http, timeout_s=RECOVERY_TIMEOUT_S), host.exec(
            "journalctl -u tritonserver -n 60 --no-pager").stdout
        recovered_s = time.monotonic() - t0
        assert wait_active(host) == "active"
        after = props(host, "MainPID", "NRestarts", "ActiveState")
        assert after["MainPID"] not in (stuck, before["MainPID"]), (after, stuck)
        # The manual restart set systemd's restart counter to 0; its own restart made it 1.
        assert int(after["NRestarts"]) == 1, (before, after)
        assert int(stuck) not in unit_pids(host)
    finally:
        # Whatever happened, leave the host serving for the tests after this one.
        if props(host, "ActiveState")["ActiveState"] == "failed":
            host.exec(["systemctl", "reset-failed", "tritonserver"])
            host.exec(["systemctl", "start", "--no-block", "tritonserver"])
            wait_ready(converged.triton_http, timeout_s=RECOVERY_TIMEOUT_S)
    print(f"\nstart stuck (SIGSTOP) -> failed after its {HUNG_START_BOUND_S} s bound and serving again "
          f"{recovered_s:.1f} s after the stop")


# Acceptance bound: the unit serves again within 2 minutes of its EngineCore's death.
ENGINE_RECOVERY_BOUND_S = 120


def test_sigkill_of_engine_core_fails_requests_then_the_unit_restarts_without_orphans_or_shm(
        converged: Converged):
    """vLLM's EngineCore dies alone (SIGKILL) while a stream is in flight: the stream
    ends with the engine-dead error, the model stops answering ready, and the unit
    (the backend stops tritonserver, Restart=always) serves again within 2 minutes,
    with nothing of the old instance left."""
    host = converged.host
    assert wait_ready(converged.triton_http, timeout_s=RECOVERY_TIMEOUT_S)
    before = props(host, "MainPID", "NRestarts")
    old_pids = unit_pids(host)
    engine = [p for p, args in processes(host, USER).items() if p in old_pids and args.startswith("VLLM::EngineCore")]
    assert len(engine) == 1, processes(host, USER)
    old_shm = shm_segments(host)
    stream, client, t0 = _stream_then_kill_engine(host, converged.triton_http, engine[0])
    client.join(ENGINE_RECOVERY_BOUND_S)
    assert not client.is_alive(), "the stream in flight hung after the EngineCore died"
    notice_s = time.monotonic() - t0
    assert stream.error is not None and "the model's engine stopped" in stream.error, (stream.error, stream.events[-3:])
    assert "the server is restarting" in stream.error, stream.error
    ep = endpoint(converged)
    while ep.model_ready() and time.monotonic() - t0 < ENGINE_RECOVERY_BOUND_S:
        time.sleep(0.2)
    not_ready_s = time.monotonic() - t0
    assert not_ready_s < ENGINE_RECOVERY_BOUND_S, "the model kept answering ready after its engine died"
    assert wait_ready(converged.triton_http, timeout_s=max(1.0, ENGINE_RECOVERY_BOUND_S - (time.monotonic() - t0))), \
        host.exec("journalctl -u tritonserver -n 80 --no-pager").stdout
    ready_s = time.monotonic() - t0
    out = requests.post(f"{converged.triton_http}/v2/models/{MODEL}/generate",
                        json={"text_input": "ok", "max_tokens": 4}, timeout=60)
    assert out.status_code == 200 and "text_output" in out.json(), out.text

    assert wait_active(host) == "active"
    after = props(host, "MainPID", "NRestarts", "ActiveState")
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1, (before, after)
    assert after["MainPID"] != before["MainPID"]
    survivors = {pid: args for pid, args in processes(host).items() if pid in old_pids}
    assert not survivors, f"orphaned processes of the old instance: {survivors}"
    assert set(processes(host, USER)) <= unit_pids(host)
    left = old_shm & shm_segments(host)
    assert not left, f"/dev/shm segments of the old instance: {left}"
    log = host.exec("journalctl -u tritonserver --no-pager -o cat -n 600").stdout
    assert re.search(r"vLLM's engine died: EngineCore\S* was killed by SIGKILL", log), log[-6000:]
    print(f"\nEngineCore SIGKILL on the host: the stream failed after {notice_s:.1f} s ({stream.error!r}); "
          f"not ready after {not_ready_s:.1f} s; serving again after {ready_s:.1f} s (RestartSec "
          f"{props(host, 'RestartUSec')['RestartUSec']}); {len(old_pids)} processes and {len(old_shm)} shm "
          "segments of the old instance, none left")


def _outer_pid(host: BootedHost, inner: int) -> int:
    """This machine's PID of the host's process INNER (the host has a PID namespace of its own)."""
    namespace = os.readlink(f"/proc/{host.leader}/ns/pid")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "pid") != namespace:
                continue
            nspid = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        if int(nspid.split()[-1]) == inner:
            return int(entry.name)
    raise AssertionError(f"no process of the host has the PID {inner} there")


def _stream_then_kill_engine(host: BootedHost, url: str, pid: int) -> tuple[_Stream, threading.Thread, float]:
    """Start a stream and SIGKILL the EngineCore PID while it is surely in flight.

    The tiny model writes a whole stream in about a second, less than a command in the
    host takes to start while vLLM keeps both cores busy. So the client thread itself
    freezes the engine (SIGSTOP, from this machine, which sees the host's processes)
    the moment the stream's first event arrives; if the stream still ended before the
    freeze, the engine is thawed and another stream tried, else the frozen engine is
    killed. Returns the stream, its client thread and when the kill was sent."""
    engine = _outer_pid(host, pid)
    for _ in range(3):
        stream = _Stream()
        client = threading.Thread(target=_stream, args=(url, stream),
                                  kwargs={"on_first_event": lambda: os.kill(engine, signal.SIGSTOP)})
        client.start()
        assert stream.started.wait(120) and stream.events, stream.error
        time.sleep(1)  # what the engine sent before the freeze reaches the client
        ended = not client.is_alive() or stream.events[-1].get("finish_reason") == "length"
        t0 = time.monotonic()
        os.kill(engine, signal.SIGCONT if ended else signal.SIGKILL)
        if not ended:
            return stream, client, t0
        client.join(60)
    pytest.fail("in 3 tries every stream ended before the EngineCore could be frozen")


# -- stop with streams in flight -------------------------------------------------------


@dataclass
class _Stream:
    events: list[dict[str, Any]] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    first_event_at: float = 0.0
    last_event_at: float = 0.0
    error: str | None = None


def _stream(url: str, out: _Stream, tokens: int = STREAM_TOKENS,
            on_first_event: Callable[[], None] | None = None) -> None:
    body = {"text_input": "def main():", "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "return_num_output_tokens": True, "return_finish_reason": True}
    try:
        with requests.post(f"{url}/v2/models/{MODEL}/generate_stream", json=body, stream=True, timeout=120) as r:
            for line in r.iter_lines(chunk_size=1, decode_unicode=True):
                if line:
                    if on_first_event is not None and not out.events:
                        on_first_event()
                    out.events.extend(parse_sse([line]))
                    out.last_event_at = time.monotonic()
                    out.first_event_at = out.first_event_at or out.last_event_at
                    out.started.set()
    except (requests.RequestException, RuntimeError) as exc:  # RuntimeError: an SSE error event
        out.error = str(exc)
    out.started.set()


class _SocketWatch:
    """Samples the TCP connections of a port (both ends: the host shares this
    machine's network namespace) once a second while a stop runs; ``late`` holds the
    last sample taken 10 s or more after the start that still showed one, with the
    owning processes: what Triton's exit wait is waiting for, if it waits."""

    def __init__(self, port: int) -> None:
        self.port, self.late = port, "(none 10 s after the stop began)"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._done.wait(1):
            r = subprocess.run(["ss", "-tanpH", f"( sport = :{self.port} or dport = :{self.port} )"],
                               capture_output=True, text=True, check=False)
            rows = [line for line in r.stdout.splitlines() if "LISTEN" not in line]
            if rows and time.monotonic() - self._t0 >= 10:
                self.late = f"{time.monotonic() - self._t0:.0f} s after the stop began:\n" + "\n".join(rows)


def test_stop_drains_streams_in_flight_then_stops(converged: Converged):
    """Streams are in flight for sure: vLLM's engine processes are frozen (SIGSTOP)
    while the requests arrive and until systemd has begun the stop, then thawed; every
    stream must still end complete, and the unit stop cleanly within its time. The
    backend learnt of the stop from the unit's ExecStop (llmhost.server.stopfile) and drained
    at once: before that, Triton's wait for HTTP connections could use up its whole
    exit timeout, and tritonserver exited 1 without unloading. A client keeps an idle
    keep-alive connection through the stop: the unit's ExecStop (llmhost.server.stopserver)
    must close it once the model has drained, else the same happens."""
    host = converged.host
    assert wait_ready(converged.triton_http, timeout_s=RECOVERY_TIMEOUT_S)
    assert wait_active(host) == "active"  # the stop below watches it leave "active"
    keep_alive = http.client.HTTPConnection("127.0.0.1", converged.ports["http"], timeout=30)
    keep_alive.request("GET", "/v2/health/live")
    assert keep_alive.getresponse().read() is not None  # answered; the connection stays open, idle
    idle_peer = f"127.0.0.1:{keep_alive.sock.getsockname()[1]}"
    unit = host.exec(["systemctl", "cat", "tritonserver"], check=True).stdout
    timeout_stop_s = int(re.findall(r"^TimeoutStopSec=(\d+)$", unit, re.M)[-1])
    drain_s = int(re.findall(r"--exit-timeout-secs=(\d+)", unit)[-1]) - 30  # llmhost_drain_timeout_s
    old_pids = unit_pids(host)
    engine = " ".join(str(p) for p, args in processes(host, USER).items()
                      if p in old_pids and args.startswith("VLLM::"))  # EngineCore, Worker
    assert engine, processes(host, USER)
    streams = [_Stream() for _ in range(16)]
    threads = [threading.Thread(target=_stream, args=(converged.triton_http, s, DRAIN_STREAM_TOKENS))
               for s in streams]
    # In the host, on a line on stdin (starting a process there takes seconds while
    # vLLM keeps both cores busy): begin the stop, thaw the engine once systemd is
    # stopping the unit, and wait for the stop to end.
    stopper = host.popen("read go || exit 1\n"
                         "systemctl stop tritonserver & stop=$!\n"
                         "while [ \"$(systemctl show -p ActiveState --value tritonserver)\" = active ]; do\n"
                         "  sleep 0.05\n"
                         "done\n"
                         f"kill -CONT {engine}\n"
                         "wait $stop\n")
    sockets = _SocketWatch(converged.ports["http"])
    try:
        host.exec(f"kill -STOP {engine}", check=True)
        for t in threads:
            t.start()
        time.sleep(3)  # every request reaches tritonserver; none can produce a token
        assert not any(s.events or s.error for s in streams), "the engine was not frozen"
        t0 = time.monotonic()
        sockets.start()
        try:
            out, err = stopper.communicate("go\n", timeout=600)
        finally:
            sockets.stop()
        stop_s = time.monotonic() - t0
        assert stopper.returncode == 0, out + err
        for t in threads:
            t.join(timeout=120)
        state = props(host, "ActiveState", "Result", "ActiveExitTimestampMonotonic")
        stop_began = int(state.pop("ActiveExitTimestampMonotonic")) / 1e6  # one kernel, one monotonic clock
        for s in streams:
            assert s.started.is_set() and s.error is None, s.error
            assert s.events and s.first_event_at > stop_began, "a stream sent tokens before the stop began"
            final = s.events[-1]
            total = sum(e.get("num_output_tokens", 0) for e in s.events)  # each response counts its own tokens
            assert total == DRAIN_STREAM_TOKENS, f"a stream was cut short: {total} tokens, last {final}"
            assert final.get("finish_reason") == "length", final
        if state != {"ActiveState": "inactive", "Result": "success"}:  # no exit 1, no SIGKILL on timeout
            journal = host.exec("journalctl -u tritonserver --no-pager -o short-precise -n 400").stdout
            keep = re.compile(r"Timeout \d+|draining|drain time|exit|Exit|error|Error|failed|Stopp|signal|Killing")
            (ROOT / ".cache" / "drain-stop-journal.txt").write_text(journal)
            raise AssertionError(f"{state}; the TCP connections of Triton's HTTP port {sockets.late}\n"
                                 "the stop's journal (all of it in .cache/drain-stop-journal.txt):\n"
                                 + "\n".join(line[-300:] for line in journal.splitlines() if keep.search(line))[-6000:])
        assert stop_s < timeout_stop_s, f"stop took {stop_s:.0f} s; TimeoutStopSec {timeout_stop_s}"
        log = host.exec("journalctl -u tritonserver --no-pager -o cat -n 300").stdout
        assert "draining (tritonserver is stopping)" in log, log[-4000:]
        closed = re.findall(r"llmhost stop: closed \d+ idle HTTP connection\(s\) to port \d+ \(every model drained\): "
                            r"(.*)", log)
        assert any(idle_peer in line.split(", ") for line in closed), (idle_peer, closed, log[-4000:])
        assert not set(processes(host)) & old_pids, "processes left after the stop"
        assert not shm_segments(host), "shared memory left after the stop"
        last_s = max(s.last_event_at for s in streams) - stop_began
    finally:
        keep_alive.close()
        host.exec(f"kill -CONT {engine}")
        if stopper.poll() is None:
            stopper.kill()
        t1 = time.monotonic()
        host.exec(["systemctl", "start", "--no-block", "tritonserver"], check=True)
        ready = wait_ready(converged.triton_http, timeout_s=RECOVERY_TIMEOUT_S)
        start_s = time.monotonic() - t1
    assert ready, host.exec("journalctl -u tritonserver -n 60 --no-pager").stdout
    print(f"\nstop with {len(streams)} streams x {DRAIN_STREAM_TOKENS} tokens in flight (engine frozen until the stop "
          f"began): all complete, the last {last_s:.1f} s after the stop began; unit stopped in {stop_s:.1f} s "
          f"(drain timeout {drain_s} s, TimeoutStopSec {timeout_stop_s}); start -> ready in {start_s:.1f} s")


# -- corrupt or missing weights --------------------------------------------------------


def test_bad_weights_fail_the_play_naming_the_models_while_the_others_serve(converged: Converged,
                                                                         tmp_path: Path):
    """A model whose safetensors are corrupt and one whose weight files are missing:
    the play fails naming both, with the unit's journal; Triton (--exit-on-error=false)
    keeps serving the good model. Restored afterwards with state: absent."""
    host = converged.host
    staged = host.exec("ls -d /opt/llmhost/weights/tiny/*/ | head -1", check=True).stdout.strip().rstrip("/")
    host.exec(f"rm -rf {FAULTS_DIR}/bad && mkdir -p {FAULTS_DIR}/bad && "
              f"cp -a {staged} {FAULTS_DIR}/bad/corrupt && cp -a {staged} {FAULTS_DIR}/bad/noweights && "
              # Keep the size, overwrite the header and the first tensors with junk.
              f"dd if=/dev/urandom of={FAULTS_DIR}/bad/corrupt/model.safetensors bs=4096 count=64 "
              f"conv=notrunc status=none && rm -f {FAULTS_DIR}/bad/noweights/*.safetensors", check=True)
    good = _demo_models()
    bad = [{"name": n, "source": "local", "path": f"{FAULTS_DIR}/bad/{n}", "max_model_len": 512}
           for n in ("corrupt", "noweights")]
    try:
        t0 = time.monotonic()
        # The serving play alone: models are its business (site.yml adds the driver and monitoring plays).
        r = run_playbook(converged.inventory, _vars(converged, tmp_path / "bad.json", llmhost_models=good + bad),
                         converged.host.pip_vars_file, "playbooks/serving.yml")
        fail_s = time.monotonic() - t0
        assert r.returncode != 0, r.stdout[-4000:]
        msg = _failed_msgs(r.stdout)
        assert "Model(s) corrupt, noweights did not load" in msg, msg[-6000:]
        print(f"\nbad weights: {msg[:1500]}")
        assert "Error lines of the unit's journal" in msg and "tritonserver[" in msg, msg[-6000:]
        assert "the other models still serve" in msg
        # What Triton allows: the good model still serves; the bad ones are unavailable.
        assert requests.get(f"{converged.triton_http}/v2/models/{MODEL}/ready", timeout=10).status_code == 200
        out = requests.post(f"{converged.triton_http}/v2/models/{MODEL}/generate",
                            json={"text_input": "ok", "max_tokens": 4}, timeout=60)
        assert out.status_code == 200 and "text_output" in out.json(), out.text
        for name in ("corrupt", "noweights"):
            assert requests.get(f"{converged.triton_http}/v2/models/{name}/ready", timeout=10).status_code == 400
        # Strict readiness: the server as a whole is not ready, so a load balancer drains it.
        assert requests.get(f"{converged.triton_http}/v2/health/ready", timeout=10).status_code == 400
        assert wait_active(host) == "active"
    finally:
        gone = [{**m, "state": "absent"} for m in bad]
        restore = run_playbook(converged.inventory, _vars(converged, tmp_path / "restore.json",
                                                          llmhost_models=good + gone),
                               converged.host.pip_vars_file, "playbooks/serving.yml")
        host.exec(f"rm -rf {FAULTS_DIR}/bad")
    assert restore.returncode == 0, restore.stdout[-6000:]
    assert requests.get(f"{converged.triton_http}/v2/health/ready", timeout=10).status_code == 200
    assert host.exec("ls /opt/llmhost/models").stdout.split() == [MODEL]
    print(f"\ncorrupt + missing weights: the play failed after {fail_s:.0f} s naming both models; "
          f"{MODEL} kept serving")


def test_missing_local_weights_fail_before_anything_changes(converged: Converged, tmp_path: Path):
    playbook = _staging_playbook(tmp_path)
    model = {"name": "nowhere", "source": "local", "path": f"{FAULTS_DIR}/does-not-exist"}
    r = run_playbook(converged.inventory, _vars(converged, tmp_path / "v.json", llmhost_models=[model]),
                     converged.host.pip_vars_file, str(playbook), "--tags", "preflight,install")
    assert r.returncode != 0
    assert "the path of local model(s) or LoRA adapter(s) nowhere does not exist" in _failed_msgs(r.stdout), \
        r.stdout[-4000:]


# -- staging: interrupted download, full disk --------------------------------------------


def _staging_playbook(tmp_path: Path) -> Path:
    """Only the model_repository role: staging without touching the running service."""
    path = tmp_path / "stage.yml"
    path.write_text(yaml.safe_dump([{"name": "Stage weights", "hosts": "inference", "become": True,
                                     "gather_facts": False, "roles": [{"role": "model_repository"}]}]))
    return path


class _Archive(http.server.ThreadingHTTPServer):
    """Serves one file on 127.0.0.1 (the host shares this machine's network); the
    first ``drop_first`` GETs send the full Content-Length, half the body, and hang up."""

    def __init__(self, payload: bytes, drop_first: int) -> None:
        self.payload, self.drop_first, self.gets = payload, drop_first, 0
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/tiny.tar.gz"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Archive

    def do_GET(self) -> None:
        srv = self.server
        srv.gets += 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(srv.payload)))
        self.end_headers()
        if srv.gets <= srv.drop_first:
            self.wfile.write(srv.payload[: len(srv.payload) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(srv.payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def archive(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[_Archive, str]]:
    """The tiny model as a .tar.gz on a local HTTP server, and its sha256."""
    tgz = tmp_path / "tiny.tar.gz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(tiny_model, arcname="tiny")
    payload = tgz.read_bytes()
    srv = _Archive(payload, drop_first=0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv, hashlib.sha256(payload).hexdigest()
    finally:
        srv.shutdown()
        srv.server_close()


def _stage(c: Converged, tmp_path: Path, name: str, weights_dir: str, url: str, sha: str) -> tuple[int, str]:
    model = {"name": name, "source": "url", "url": url, "sha256": sha, "archive_root": "tiny"}
    r = run_playbook(c.inventory, _vars(c, tmp_path / f"{name}.json", llmhost_models=[model],
                                        model_repository_weights_dir=weights_dir),
                     c.host.pip_vars_file, str(_staging_playbook(tmp_path)), "--tags", "preflight,install")
    return r.returncode, r.stdout


def _staged(host: BootedHost, weights_dir: str, name: str) -> list[str]:
    return host.exec(f"cd {weights_dir}/{name} 2>/dev/null && ls -1A").stdout.split()


def test_interrupted_download_fails_naming_the_model_and_a_rerun_completes(
        converged: Converged, archive: tuple[_Archive, str], tmp_path: Path):
    host, (srv, sha) = converged.host, archive
    weights = f"{FAULTS_DIR}/dropped"
    srv.drop_first = 1
    try:
        rc, out = _stage(converged, tmp_path, "dropped", weights, srv.url, sha)
        assert rc != 0 and srv.gets == 1, out[-4000:]
        msg = _failed_msgs(out)
        assert "Staging the weights of dropped failed" in msg, msg or out[-4000:]
        print(f"\ninterrupted download: {msg}")
        assert "download was interrupted or corrupt" in msg and "run the play again to resume" in msg, msg
        assert _staged(host, weights, "dropped") == [], "something was marked staged"
        assert host.exec(f"ls -A {weights}/.downloads").stdout.split() == [], "a partial archive was kept"

        rc, out = _stage(converged, tmp_path, "dropped", weights, srv.url, sha)
        assert rc == 0, out[-6000:]
        staged = _staged(host, weights, "dropped")
        assert len(staged) == 1 and not staged[0].endswith(".partial"), staged
        assert host.exec(f"test -s {weights}/dropped/{staged[0]}/tiny/model.safetensors").returncode == 0
    finally:
        host.exec(f"rm -rf {weights}")


def test_disk_full_while_staging_fails_clearly_and_a_rerun_after_freeing_space_succeeds(
        converged: Converged, archive: tuple[_Archive, str], tiny_model: Path, tmp_path: Path):
    host, (srv, sha) = converged.host, archive
    weights = f"{FAULTS_DIR}/full"
    # Room for the archive but not for the extracted weights next to it.
    size_kib = (len(srv.payload) + sum(f.stat().st_size for f in tiny_model.rglob("*")) // 3) // 1024
    host.exec(f"mkdir -p {weights} && mount -t tmpfs -o size={size_kib}k llmhost-full {weights}", check=True)
    try:
        rc, out = _stage(converged, tmp_path, "full", weights, srv.url, sha)
        assert rc != 0, out[-4000:]
        msg = _failed_msgs(out)
        assert "Staging the weights of full failed" in msg, msg or out[-4000:]
        print(f"\ndisk full: {msg}")
        assert "is full: free space" in msg and "run the play again to resume" in msg, msg
        assert not [d for d in _staged(host, weights, "full") if not d.endswith(".partial")], "marked complete"

        host.exec(f"mount -o remount,size=256m {weights}", check=True)  # free space
        rc, out = _stage(converged, tmp_path, "full", weights, srv.url, sha)
        assert rc == 0, out[-6000:]
        staged = _staged(host, weights, "full")
        assert len(staged) == 1 and not staged[0].endswith(".partial"), staged
        assert host.exec(f"test -s {weights}/full/{staged[0]}/tiny/model.safetensors").returncode == 0
        assert srv.gets == 1, "the verified archive was downloaded again"
    finally:
        host.exec(f"umount {weights}; rm -rf {weights}")
