"""The stopper's part that frees tritonserver's HTTP port (llmhost.server.httpconns,
llmhost.server.stopserver), against a real server process: a child that accepts TCP
connections and keeps them, as Triton keeps a client's idle keep-alive connection."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmhost.server import httpconns, stopserver
from llmhost.server.stopfile import announce_stop, mark_drained

BOUND_S = 20

# Accepts connections and keeps them open; prints its port, then one line per
# connection whose client went away (what Triton's HTTP wait counts down).
SERVER = r"""
import selectors, socket, sys
lsock = socket.socket(); lsock.bind(("127.0.0.1", 0)); lsock.listen()
print(lsock.getsockname()[1], flush=True)
sel = selectors.DefaultSelector(); sel.register(lsock, selectors.EVENT_READ)
while True:
    for key, _ in sel.select():
        if key.fileobj is lsock:
            conn, _ = lsock.accept(); sel.register(conn, selectors.EVENT_READ)
        elif not key.fileobj.recv(4096):
            sel.unregister(key.fileobj); print("ended", flush=True)
"""


@dataclass
class Server:
    proc: subprocess.Popen[str]
    port: int

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=BOUND_S)
        deadline = time.monotonic() + BOUND_S
        while len(httpconns.connection_fds(self.proc.pid, self.port)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        return s

    def wait_ended(self) -> None:
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ended"


@pytest.fixture
def server() -> Iterator[Server]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    yield Server(proc, port)
    proc.kill()
    proc.wait()


def _closed_by_server(client: socket.socket) -> bool:
    client.settimeout(BOUND_S)
    return client.recv(1) == b""


def test_finds_the_servers_connections_on_its_port_only(server: Server):
    first, second = server.connect(), server.connect()
    other = socket.socket()  # a connection of the server's own to elsewhere would not count
    fds = httpconns.connection_fds(server.proc.pid, server.port)
    assert len(fds) == 2, fds
    peers = sorted(fds.values())
    assert peers == sorted(f"127.0.0.1:{s.getsockname()[1]}" for s in (first, second))
    assert httpconns.connection_fds(server.proc.pid, server.port + 1 if server.port < 65535 else 1) == {}
    conns = httpconns.connections(server.proc.pid, server.port)
    assert [c.fd for c in conns] == sorted(fds) and all(c.unacked == 0 for c in conns)
    for s in (first, second, other):
        s.close()


def test_an_idle_connection_is_shut_down_and_the_server_sees_it_end(server: Server):
    client = server.connect()
    time.sleep(0.3)
    gone = httpconns.shut_down_idle(server.proc.pid, server.port, idle_s=0.2)
    assert [c.peer for c in gone] == [f"127.0.0.1:{client.getsockname()[1]}"]
    server.wait_ended()  # the server's own descriptor saw the end, as Triton's event loop does
    assert _closed_by_server(client)
    assert server.proc.poll() is None  # nothing else of the server was touched
    assert httpconns.connection_fds(server.proc.pid, server.port) == {}


def test_a_connection_that_carried_data_just_now_is_left_alone(server: Server):
    client = server.connect()
    client.sendall(b"GET / HTTP/1.1\r\n\r\n")
    time.sleep(0.1)
    assert httpconns.shut_down_idle(server.proc.pid, server.port, idle_s=30) == []
    client.settimeout(0.3)
    with pytest.raises(TimeoutError):
        client.recv(1)  # still open
    client.close()


# --- stopserver: when the port is freed ---------------------------------------------------


def _free(server: Server, stop_file: Path | None, drain_timeout_s: float,
          monkeypatch: pytest.MonkeyPatch, backends: list[int]) -> tuple[threading.Thread, list[str], list[int]]:
    monkeypatch.setattr(stopserver, "backend_pids", lambda pid: backends)
    monkeypatch.setattr(stopserver, "IDLE_S", 0.2)
    logs: list[str] = []
    result: list[int] = []
    done = threading.Event()

    def run() -> None:
        result.append(stopserver.free_http_port(server.proc.pid, server.port, stop_file, drain_timeout_s,
                                                logs.append, exited=done.is_set, idle_s=0.2, poll_s=0.05))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.done = done  # type: ignore[attr-defined]
    return t, logs, result


def test_idle_connections_are_closed_once_every_backend_is_drained(server: Server, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    stop_file = tmp_path / "stopping"
    announce_stop(stop_file, server.proc.pid)
    client = server.connect()
    t, logs, result = _free(server, stop_file, 600, monkeypatch, backends=[101, 102])
    time.sleep(1)
    mark_drained(stop_file, server.proc.pid, backend_pid=101)
    time.sleep(1)
    assert not logs, "closed while a backend still had requests in flight"
    mark_drained(stop_file, server.proc.pid, backend_pid=102)
    assert _closed_by_server(client)
    t.done.set()  # type: ignore[attr-defined]
    t.join(BOUND_S)
    assert result == [1]
    assert logs == [f"closed 1 idle HTTP connection(s) to port {server.port} (every model drained): "
                    f"127.0.0.1:{client.getsockname()[1]}"]


def test_after_the_drain_timeout_they_are_closed_even_without_the_marks(server: Server, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(stopserver, "AFTER_DRAIN_S", 0.0)
    client = server.connect()
    t, logs, result = _free(server, tmp_path / "stopping", 1.0, monkeypatch, backends=[101])
    assert _closed_by_server(client)
    t.done.set()  # type: ignore[attr-defined]
    t.join(BOUND_S)
    assert result == [1] and "(the drain timeout is over)" in logs[0]


def test_it_returns_when_the_server_exits(server: Server, tmp_path: Path):
    t0 = time.monotonic()
    threading.Timer(0.5, server.proc.kill).start()
    # A real pid, no marks, a drain timeout that never comes: only the exit ends it.
    assert stopserver.free_http_port(server.proc.pid, server.port, tmp_path / "stopping", 600, print,
                                     exited=lambda: server.proc.poll() is not None, poll_s=0.05) == 0
    assert time.monotonic() - t0 < BOUND_S


def test_alive_sees_a_zombie_as_gone():
    proc = subprocess.Popen(["true"])
    deadline = time.monotonic() + BOUND_S
    while stopserver.alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stopserver.alive(proc.pid)  # exited, not yet reaped
    proc.wait()
    assert stopserver.alive(os.getpid())


def test_backend_pids_are_the_servers_python_stubs():
    assert stopserver.backend_pids(os.getpid()) == []  # pytest has no stub children


def test_without_a_main_pid_there_is_nothing_to_stop(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("MAINPID", raising=False)
    assert stopserver.main(["--http-port", "8000", "--drain-timeout-s", "30"]) == 0


def test_the_stop_announces_signals_and_waits_for_the_exit(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])
    stop_file = tmp_path / "stopping"
    logs: list[str] = []
    done = threading.Event()

    def reap() -> None:
        proc.wait()
        done.set()

    threading.Thread(target=reap, daemon=True).start()
    assert stopserver.stop(proc.pid, 1, stop_file, 600, logs.append) == 0
    assert done.wait(BOUND_S) and proc.returncode == -15
    assert stop_file.read_text().strip() == str(proc.pid) and logs == []
