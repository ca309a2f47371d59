"""Ports on 127.0.0.1 for the servers the tests start."""

from __future__ import annotations

import socket
import threading

# Every port handed out in this process. A port is free only while nothing binds it:
# a service that is stopped for a while (a test restarting a unit on the session's
# host) leaves its port free to the kernel, and two calls in a row may get the same
# one. Never handing a port out twice keeps one test's servers off another's.
_GIVEN: set[int] = set()
_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now and that this process
    has not handed out before."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        with _LOCK:
            if port not in _GIVEN:
                _GIVEN.add(port)
                return port
    raise RuntimeError("no port on 127.0.0.1 that was not handed out already (200 tries)")
