"""Ports on 127.0.0.1 for the servers the tests start."""

from __future__ import annotations

import os
import socket
import threading

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, that this process has
    not handed out before and that belongs to this test worker's share."""
    index, count = _worker_share()
    for _ in range(200 * count):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if (port // 2) % count != index:
            continue
        with _LOCK:
            if port not in _GIVEN:
                _GIVEN.add(port)
                return port
    raise RuntimeError("no port on 127.0.0.1 that was not handed out already (after 200 tries per worker)")


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
