"""Before the engine of a model spread over several hosts starts on its head: is the
port of its torch.distributed store free?

The head's engine listens on ``master_port`` on every address (torch's TCPStore,
with SO_REUSEADDR). When another process holds that port (a server, or a
connection whose local port it happens to be), the engine fails deep inside its
workers' start ("The server socket has failed to listen on any local network
address ... EADDRINUSE") and Triton's load error says only that the engine core did
not start. Checked the way the store binds, before the engine starts, the load
error names the port and what holds it.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping
from typing import Any

# At most this many holders are named.
NAMED_HOLDERS = 3


def head_store_port(engine_args: Mapping[str, Any]) -> int | None:
    """The store port this host's engine will listen on: set where model.json makes
    this host the head (node_rank 0) of a model across several hosts (nnodes > 1)
    and names master_port."""
    try:
        nnodes = int(engine_args.get("nnodes", 1) or 1)
        rank = int(engine_args.get("node_rank", 0) or 0)
        port = int(engine_args["master_port"])
    except (KeyError, TypeError, ValueError):
        return None
    return port if nnodes > 1 and rank == 0 and 0 < port < 65536 else None


def _bind_fails_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _holders(port: int) -> list[str]:
    """What holds local port PORT, as far as this process may see: the process (where
    its /proc entries are readable) and what its socket is."""
    import psutil

    try:
        connections = [c for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port]
    except (psutil.Error, OSError):
        return []
    named: list[str] = []
    for c in connections[:NAMED_HOLDERS]:
        what = "listening" if c.status == psutil.CONN_LISTEN else (
            f"a connection to {c.raddr.ip}:{c.raddr.port}" if c.raddr else c.status.lower())
        who = "a process of another user"
        if c.pid:
            try:
                who = f"pid {c.pid} ({psutil.Process(c.pid).name()})"
            except psutil.Error:
                who = f"pid {c.pid}"
        named.append(f"{who}, {what}")
    return named


def store_port_taken(engine_args: Mapping[str, Any]) -> str | None:
    """Why the head's engine cannot listen on its store port, or None where this host
    is no head or the port is free."""
    port = head_store_port(engine_args)
    if port is None or not _bind_fails_in_use(port):
        return None
    holders = _holders(port)
    by = f" ({'; '.join(holders)})" if holders else ""
    return (f"this host is the head of a model across {engine_args.get('nnodes')} hosts, and the port of its "
            f"engine's torch.distributed store (master_port {port}) is taken on this host{by}: the engine "
            "cannot listen there. Free the port, or give the model another one (its node_port in the "
            "inventory, master_port in model.json)")
