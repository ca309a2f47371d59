"""tests.harness.net.free_port never hands out a port twice in one process, even
when the port it handed out earlier is free again (its service stopped for a while),
which is how two booted hosts' services once got the same port."""

from __future__ import annotations

import socket
from typing import ClassVar

from tests.harness import net


def test_a_port_handed_out_is_never_handed_out_again(monkeypatch):
    first = net.free_port()
    # The kernel offers the same port again (nothing listens on it any more).
    real_socket = socket.socket

    class Again(real_socket):
        offered: ClassVar[list[int]] = [first, first, first]

        def getsockname(self):
            return ("127.0.0.1", self.offered.pop(0)) if self.offered else super().getsockname()

    monkeypatch.setattr(net.socket, "socket", Again)
    second = net.free_port()
    assert second != first and Again.offered == []


def test_many_ports_are_all_different():
    ports = [net.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
