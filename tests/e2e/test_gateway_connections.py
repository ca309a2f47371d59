"""Idle and slow clients against the real gateway: they cannot keep a keyed client from
being served, and the gateway closes their connections (llmhost.gateway.connections)."""

from __future__ import annotations

import resource
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.harness.gateway import KEY, Gateway, keyed_gateway, port_of, stop_gateway

IDLE, SLOW = 1000, 50
HEADER_TIMEOUT_S = 5
BODY_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def guarded(server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, int]]:
    gateway = keyed_gateway(server, tmp_path_factory.mktemp("guarded-gateway"),
                            "--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S),
                            "--max-connections", str(IDLE + SLOW + 100))
    yield gateway, port_of(gateway)
    stop_gateway(gateway.proc, gateway.log)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the gateway closed SOCK (EOF or reset), without waiting."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_idle_and_slow_header_clients_cannot_hold_the_gateway(guarded, server):
    gateway, port = guarded
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < IDLE + SLOW + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(IDLE)]
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(SLOW)]
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 100
    stop = threading.Event()

    def trickle() -> None:  # a byte a second on each slow connection, never a whole head
        for i in range(len(head)):
            for s in slow:
                try:
                    s.send(head[i:i + 1])
                except OSError:
                    pass
            if stop.wait(1):
                return

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    opened = time.monotonic()
    try:
        client = openai.OpenAI(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=5)
        r = client.completions.create(model=server.name, prompt="def f(x):", max_tokens=4)
        assert r.usage.completion_tokens == 4
        # Every idle and slow connection is closed by the gateway, within a minute.
        left = idle + slow
        while left and time.monotonic() - opened < 60:
            time.sleep(1)
            left = [s for s in left if not _closed_by_peer(s)]
        assert not left, f"{len(left)} of {IDLE + SLOW} connections still open after 60 s"
        # And it still serves.
        assert client.completions.create(model=server.name, prompt="x", max_tokens=2).usage.completion_tokens == 2
    finally:
        stop.set()
        for s in idle + slow:
            s.close()


def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_gateway_serves_on(guarded, server):
    gateway, port = guarded
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
        s.settimeout(BODY_TIMEOUT_S + 30)
        answer = s.recv(65536)
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(body) < length and (more := s.recv(65536)):
            body += more
        answer = head + b"\r\n\r\n" + body
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"request_timeout"' in answer and b"Traceback" not in answer
    r = httpx.post(f"{gateway.url}/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": server.name, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_connections_over_the_bound_are_closed_at_once(server, tmp_path):
    gateway = keyed_gateway(server, tmp_path, "--max-connections", "3")
    port = port_of(gateway)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(10)
        assert extra.recv(1) == b"", "the fourth connection was not closed"
        extra.close()
        for s in held:
            s.close()
        deadline = time.monotonic() + 10
        while True:  # room again once the held ones are gone
            try:
                r = httpx.get(f"{gateway.url}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "no room after the held connections closed"
                time.sleep(0.2)
        assert r.status_code == 200
    finally:
        for s in held:
            s.close()
        stop_gateway(gateway.proc, gateway.log)
