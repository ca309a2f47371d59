"""The TCP connections of a server's port, seen and shut down from outside.

On SIGTERM, Triton 2.51 waits up to ``--exit-timeout-secs`` until every connection
to its HTTP port has closed, and only then unloads the models. A client that keeps
an idle keep-alive connection open (a ``requests.Session``, any connection pool, a
proxy) holds that wait to its end: tritonserver then exits 1 without unloading
anything. The stopper (``llmhost.server.stopserver``) closes such connections: it finds the
server's sockets on the port in ``/proc``, takes a duplicate of each with
pidfd_getfd(2) (which needs the right to ptrace the server: root, or its parent),
and calls shutdown(2) on it. Triton's event loop then sees the connection end, and
its wait ends. Only the sockets of an established (or half-closed) connection are
touched, never the listening one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

# /proc/net/tcp states (include/net/tcp_states.h)
_ESTABLISHED, _CLOSE_WAIT = "01", "08"
# pidfd_getfd(2) has this number on every architecture (Linux 5.6+).
_SYS_PIDFD_GETFD = 438
# struct tcp_info: 8 one-byte fields, then 32-bit fields; the 5th is tcpi_unacked,
# the 10th tcpi_last_data_sent and the 12th tcpi_last_data_recv (milliseconds ago).
_TCP_INFO = struct.Struct("8B12I")


@dataclass(frozen=True)
class Connection:
    fd: int  # the server's file descriptor
    peer: str  # host:port of the client
    idle_ms: int  # since data last went either way
    unacked: int  # segments sent and not yet acknowledged


def _hex_addr(text: str) -> tuple[str, int]:
    addr, port = text.rsplit(":", 1)
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        host = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # four 32-bit words, each in host (little-endian) order
        host = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return host, int(port, 16)


def socket_inodes(pid: int, port: int) -> dict[int, str]:
    """Inode -> peer of every established or half-closed TCP connection in PID's
    network namespace whose local port is PORT."""
    found: dict[int, str] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/{pid}/net/{table}", encoding="ascii").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] not in (_ESTABLISHED, _CLOSE_WAIT):
                continue
            if _hex_addr(fields[1])[1] == port and fields[9] != "0":
                host, peer_port = _hex_addr(fields[2])
                found[int(fields[9])] = f"[{host}]:{peer_port}" if ":" in host else f"{host}:{peer_port}"
    return found


def connection_fds(pid: int, port: int) -> dict[int, str]:
    """The file descriptors of PID that are connections to its port PORT -> peer."""
    inodes = socket_inodes(pid, port)
    fds: dict[int, str] = {}
    if not inodes:
        return fds
    try:
        entries = list(os.scandir(f"/proc/{pid}/fd"))
    except OSError:
        return fds
    for entry in entries:
        with contextlib.suppress(OSError, ValueError):
            target = os.readlink(entry.path)
            if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                fds[int(entry.name)] = inodes[int(target[8:-1])]
    return fds


class Borrowed:
    """Duplicates of another process's sockets (pidfd_getfd), closed on exit."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._pidfd = os.pidfd_open(pid)

    def __enter__(self) -> Borrowed:
        return self

    def __exit__(self, *_: object) -> None:
        os.close(self._pidfd)

    def get(self, fd: int) -> socket.socket | None:
        """A socket object on the same connection as the server's FD (None if that
        descriptor is gone); PermissionError without the right to ptrace the server."""
        dup = self._libc.syscall(_SYS_PIDFD_GETFD, self._pidfd, fd, 0)
        if dup < 0:
            err = ctypes.get_errno()
            if err == errno.EBADF:
                return None
            raise OSError(err, f"pidfd_getfd of fd {fd} of pid {self.pid}: {os.strerror(err)}")
        try:
            return socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            return None


def inspect(sock: socket.socket, fd: int, peer: str) -> Connection:
    info = _TCP_INFO.unpack_from(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size))
    u32 = info[8:]
    return Connection(fd=fd, peer=peer, idle_ms=min(u32[9], u32[11]), unacked=u32[4])


def _borrowed(pid: int, port: int) -> Iterator[tuple[socket.socket, Connection]]:
    """Each of PID's connections to its port PORT, as a duplicate socket (closed after
    its turn) and what it is."""
    fds = connection_fds(pid, port)
    if not fds:
        return
    with Borrowed(pid) as borrowed:
        for fd, peer in sorted(fds.items()):
            sock = borrowed.get(fd)
            if sock is None:
                continue
            with sock:
                yield sock, inspect(sock, fd, peer)


def connections(pid: int, port: int) -> list[Connection]:
    """PID's connections to its port PORT, with how long each has been idle."""
    return [conn for _, conn in _borrowed(pid, port)]


def shut_down_idle(pid: int, port: int, idle_s: float) -> list[Connection]:
    """Shut down (both ways) every connection of PID to its port PORT on which no
    data has gone either way for IDLE_S and nothing sent awaits its acknowledgement;
    returns those. The server keeps its descriptors; it sees each connection end."""
    closed = []
    for sock, conn in _borrowed(pid, port):
        if conn.idle_ms >= idle_s * 1000 and conn.unacked == 0:
            with contextlib.suppress(OSError):  # already shut down by the client
                sock.shutdown(socket.SHUT_RDWR)
            closed.append(conn)
    return closed
