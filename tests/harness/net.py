"""Ports for the servers the tests start."""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

# Every port handed out in this process. A port is free only while nothing binds it:
# a service that is stopped for a while (a test restarting a unit on the session's
# host) leaves its port free to the kernel, and two calls in a row may get the same
# one. Never handing a port out twice keeps one test's servers off another's.
_GIVEN: set[int] = set()
_LOCK = threading.Lock()


def _worker_share() -> tuple[int, int]:
    """(index, count) of this pytest-xdist worker, (0, 1) outside xdist. Each worker
    takes only the ports with (port // 2) % count == index, so that two workers never
    hand out the same port (the kernel may offer a port again once it is closed).
    Halved first: Linux's bind() to port 0 prefers odd ports, leaving even ones to connect()."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return 0, 1
    return int(worker[2:]) % count, count


def _ports_outside_ephemeral_range() -> list[int]:
    """Ports that the kernel never picks as an outgoing connection's local port: from
    20000 to the start of net.ipv4.ip_local_port_range (or above its end, where that
    leaves more room). A port from the ephemeral range, free when chosen, may become a
    connection's source port (any test's client, a follower's retries to the head)
    before the server binds it; torch.distributed's store then fails with EADDRINUSE.
    Below 20000 lie well-known services and `make demo`'s fixed ports (18000-19100)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    below = range(20000, low)
    above = range(high + 1, 65536)
    chosen = max(below, above, key=len)
    if len(chosen) < 1000:
        return []
    # torch.distributed's default store port, which any other program may take.
    return [p for p in chosen if p != 29500]


def port_free(port: int) -> bool:
    """Nothing on any address holds ``port`` (a listener, a connection, TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port that nothing holds right now, outside the kernel's ephemeral range
    where that range leaves room (else one the kernel offers), that this process has
    not handed out before and that belongs to this test worker's share."""
    index, count = _worker_share()
    candidates = _ports_outside_ephemeral_range()
    for _ in range(200 * count):
        if candidates:
            port = random.choice(candidates)
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
        if (port // 2) % count != index or not port_free(port):
            continue
        with _LOCK:
            if port not in _GIVEN:
                _GIVEN.add(port)
                return port
    raise RuntimeError("no free port that was not handed out already (after 200 tries per worker)")


# How long a test's OpenAI client waits for an answer. Not a bound on speed: with both
# workers busy (load 25-40 on 2 cores) a CPU engine step has taken over 60 s ("No available
# shared memory broadcast block found in 60 seconds"), and a 120 s client then gave up on
# a request that was answered.
CLIENT_TIMEOUT_S = 600


# The environment of the engines the tests start (ours and `vllm serve` alike): tool
# calls forced by tool_choice are held to the tools' JSON schema, which the servers'
# structured output makes without free whitespace, not to the tool parser's structural
# tag, whose free whitespace a random model fills until max_tokens (vLLM's own switch).
ENGINE_ENV = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}
