"""tests.harness.net.free_port never hands out a port twice in one process, even
when the port it handed out earlier is free again (its service stopped for a while),
which is how two booted hosts' services once got the same port; and it hands out
ports the kernel never takes as a connection's local port, so a server started a
while later still finds its port free."""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import ClassVar

from tests.harness import net


def test_a_port_handed_out_is_never_handed_out_again(monkeypatch):
    first = net.free_port()
    # The same port comes up again (nothing listens on it any more).
    offered = [first, first, first]
    real_choice = random.choice
    monkeypatch.setattr(net.random, "choice", lambda seq: offered.pop(0) if offered else real_choice(seq))
    second = net.free_port()
    assert second != first and offered == []


def test_a_port_handed_out_is_never_handed_out_again_where_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(net, "_ports_outside_ephemeral_range", lambda: [])
    first = net.free_port()
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


def test_ports_are_outside_the_kernels_ephemeral_range():
    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [net.free_port() for _ in range(50)]
    assert not [p for p in ports if low <= p <= high]
    assert 29500 not in ports


def test_a_port_something_holds_is_not_handed_out(monkeypatch):
    monkeypatch.setattr(net, "_worker_share", lambda: (0, 1))
    with socket.socket() as held:
        held.bind(("127.0.0.3", 0))
        taken = held.getsockname()[1]
        offered = [taken, taken]
        real_choice = random.choice
        monkeypatch.setattr(net.random, "choice", lambda seq: offered.pop(0) if offered else real_choice(seq))
        assert net.free_port() != taken and offered == []
