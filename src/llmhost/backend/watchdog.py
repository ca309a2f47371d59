"""Noticing that vLLM's engine died after start, and what the stub does about it.

vLLM's ``AsyncLLM`` runs the engine (EngineCore and its workers) in processes of
its own. When one of them dies (SIGKILL, OOM kill, a CUDA error that ends the
EngineCore), vLLM's client marks itself dead (``AsyncLLM.errored``: its monitor
thread watches the processes' sentinels, and an EngineCore that fails sends
ENGINE_CORE_DEAD) but nothing tells Triton: the model would keep answering ready
while every request failed. The engine loop polls ``errored`` about once a second
(``EngineWatch``); on death the runner fails every request in flight and every new
one with a clear message, then asks the parent tritonserver to shut down
(``stop_tritonserver``) so its supervisor (systemd, ``llmhost serve``) restarts it:
Triton 2.51's python backend has no way for a model to mark itself not ready, and
a process whose engine hit a CUDA error is usually unusable anyway.

A hung engine (a stuck GPU kernel or collective, a deadlocked or stopped EngineCore)
is not dead: vLLM's client waits for its outputs forever. ``StallWatch`` notices
it: while requests are with the engine, the engine must hand back something (an
output of any request, or a step's statistics) every ``engine_hang_timeout_s``;
when it does not, the runner treats the engine as dead (the same errors, the same
server stop and restart) and counts the hang (``llmhost:engine_hangs_total``).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

WATCH_INTERVAL_S = 1.0
TRITONSERVER_COMM = "tritonserver"


def engine_death_cause(engine: Any) -> str | None:
    """Why vLLM's engine is dead, or None while it is alive.

    ``errored`` is vLLM's own verdict; the exit codes of its engine processes,
    where vLLM's process manager knows them, make the cause readable."""
    try:
        if not engine.errored:
            return None
    except Exception as exc:  # noqa: BLE001 - a client torn down under us counts as dead
        return f"its state could not be read: {type(exc).__name__}"
    return _describe_exits(engine) or "vLLM reports its engine dead"


def _describe_exits(engine: Any) -> str | None:
    try:
        manager = engine.engine_core.resources.engine_manager
        exits: dict[str, int] = dict(manager.finished_procs())
    except Exception:  # noqa: BLE001 - internal API; only the wording depends on it
        return None
    parts = [f"{name} {describe_exit(code)}" for name, code in sorted(exits.items())]
    return ", ".join(parts) or None


def describe_exit(code: int) -> str:
    """A process exit code as people read it: 'was killed by SIGKILL', 'exited with 1'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with {code}"


def client_message(cause: str, restarting: bool) -> str:
    """What every request in flight and every new one gets once the engine died."""
    then = ("the server is restarting; retry shortly" if restarting
            else "the model stays unavailable until its server is restarted")
    return f"the model's engine stopped ({cause}); {then}"


class EngineWatch:
    """The decision part of the watchdog: fed the engine, tells once that it died."""

    def __init__(self, cause_of: Callable[[Any], str | None] = engine_death_cause) -> None:
        self._cause_of = cause_of
        self.cause: str | None = None

    def check(self, engine: Any) -> str | None:
        """The cause the first time the engine is seen dead; None before and after."""
        if self.cause is not None or engine is None:
            return None
        self.cause = self._cause_of(engine)
        return self.cause


def hang_cause(timeout_s: float, in_flight: int) -> str:
    """The cause a hung engine's clients read (inside client_message's parentheses)."""
    return (f"it made no progress for {timeout_s:g} s with {in_flight} request{'' if in_flight == 1 else 's'} "
            "in flight")


class StallWatch:
    """The decision part of hang detection: fed the engine's progress and the times
    its requests in flight were handed to it, tells once that it hung.

    The engine hung when it has had work for TIMEOUT_S (its oldest request in flight
    was handed to it that long ago) and produced nothing for as long: the clock
    starts at the later of its last progress and that request's hand-over, so an
    engine idle for hours is not judged by its first new request. 0 turns it off."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self.last_progress = clock()
        self.cause: str | None = None

    def progressed(self) -> None:
        """The engine handed back an output or a step's statistics (any thread)."""
        self.last_progress = self._clock()

    def check(self, handed_over: Iterable[float]) -> str | None:
        """The cause the first time the engine is seen hung; None before and after.
        HANDED_OVER: when each request now in flight was handed to the engine."""
        if self.cause is not None or self.timeout_s <= 0:
            return None
        times = list(handed_over)
        if not times:
            return None
        since = max(self.last_progress, min(times))
        if self._clock() - since < self.timeout_s:
            return None
        self.cause = hang_cause(self.timeout_s, len(times))
        return self.cause


def watch_outputs(engine: Any, on_output: Callable[[], None]) -> bool:
    """Call ON_OUTPUT each time vLLM's client takes a batch of outputs from its engine
    (``AsyncLLM``'s output loop awaits ``engine_core.get_output_async()`` for every
    engine step that had something to say). False when this vLLM has no such method
    (an internal API)."""
    core = getattr(engine, "engine_core", None)
    original = getattr(core, "get_output_async", None)
    if original is None or not callable(original):
        return False

    async def get_output_async() -> Any:
        outputs = await original()
        on_output()
        return outputs

    try:
        core.get_output_async = get_output_async  # type: ignore[union-attr]
    except (AttributeError, TypeError):
        return False
    return True


def parent_comm(ppid: int) -> str:
    try:
        with open(f"/proc/{ppid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def stop_tritonserver(log: Callable[[str], None], ppid: int | None = None,
                      kill: Callable[[int, int], None] = os.kill) -> bool:
    """SIGTERM the stub's parent if it is tritonserver: it shuts down cleanly (every
    model's finalize) and exits, and its supervisor restarts it. False (and why, in
    the log) when the parent is something else."""
    ppid = os.getppid() if ppid is None else ppid
    comm = parent_comm(ppid)
    if ppid <= 1 or comm != TRITONSERVER_COMM:
        log(f"not stopping the server: the stub's parent (pid {ppid}, '{comm or '?'}') is not tritonserver")
        return False
    try:
        kill(ppid, signal.SIGTERM)
    except OSError as exc:
        log(f"could not signal tritonserver (pid {ppid}): {exc}")
        return False
    return True


def follower_cause(follower: str, grace_s: float) -> str:
    """The cause clients and the log read when a follower host went away."""
    return (f"its follower {follower} has had no connection to it for {grace_s:g} s: the follower's "
            "llmhost-follower unit stopped, or that host or the network between them is down")


class Sighting:
    """When a peer was last seen: it is gone once unseen for GRACE_S, and never
    before it was first seen (SEEN: it counts as seen now)."""

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic, seen: bool = False) -> None:
        self.grace_s = grace_s
        self._clock = clock
        self.last_seen: float | None = clock() if seen else None

    def gone(self, present: bool) -> bool:
        """Note whether the peer is PRESENT now; True when it is gone."""
        now = self._clock()
        if present:
            self.last_seen = now
            return False
        return self.last_seen is not None and now - self.last_seen >= self.grace_s


class FollowerWatch:
    """The decision part of watching a model spread over several hosts: fed the
    addresses the engine's processes are connected to, tells once that a follower
    is gone.

    vLLM's engine on the head host does not notice a follower that died while no
    request runs (its /health stays ok); the next request fails, or hangs in a
    collective. Every follower's workers keep TCP connections to the head's engine
    (torch.distributed's store and process groups, vLLM's message queues) for as long
    as they live, so a follower with none for GRACE_S is gone. FOLLOWERS are the
    followers' addresses as the connections show them (IP addresses)."""

    def __init__(self, followers: Iterable[str], grace_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        # Each one's grace starts now: a follower that never joins is gone too.
        self._sightings = {normalize_ip(f): Sighting(grace_s, clock, seen=True) for f in followers}
        self.cause: str | None = None

    def check(self, peers: set[str]) -> str | None:
        """The cause the first time a follower is seen gone; None before and after.
        PEERS: the remote addresses of the engine processes' established connections."""
        if self.cause is not None:
            return None
        for follower, sighting in self._sightings.items():
            if sighting.gone(follower in peers):
                self.cause = follower_cause(follower, self.grace_s)
                return self.cause
        return None


def normalize_ip(address: str) -> str:
    """An address as a connection's peer is compared: IPv4 without the IPv6 mapping."""
    return address[len("::ffff:"):] if address.startswith("::ffff:") else address


def resolve_followers(names: str) -> list[str]:
    """The IP addresses of model.json's `followers` (names or addresses, by commas)."""
    from llmhost.backend.config import ConfigError

    found = []
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        try:
            found.append(normalize_ip(socket.gethostbyname(name)))
        except OSError as exc:
            raise ConfigError(f"model.json: llmhost.followers: cannot resolve {name!r}: {exc}") from None
    return found


def connected_peers(root_pid: int) -> set[str]:
    """Remote addresses of the established TCP connections of ROOT_PID's descendants
    (vLLM's EngineCore and its workers)."""
    return {ip for ip, _ in connected_endpoints(root_pid)}


def connected_endpoints(root_pid: int) -> set[tuple[str, int]]:
    """Remote (address, port) of the established TCP connections of ROOT_PID's
    descendants. Reads only their own sockets (/proc/PID/fd) and the kernel's TCP
    tables once, not every process's connections; processes that end meanwhile or
    deny access are skipped."""
    import psutil

    try:
        pids = [p.pid for p in psutil.Process(root_pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return set()
    inodes = set()
    for pid in pids:
        inodes |= socket_inodes(pid)
    if not inodes:
        return set()
    return established_remotes("/proc/net/tcp", inodes) | established_remotes("/proc/net/tcp6", inodes)


def socket_inodes(pid: int) -> set[str]:
    """The inodes of PID's open sockets (its /proc/PID/fd links 'socket:[INODE]')."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return set()
    found = set()
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:["):-1])
    return found


TCP_ESTABLISHED = "01"


def established_remotes(table: str, inodes: set[str]) -> set[tuple[str, int]]:
    """Remote (address, port) of TABLE's established connections (/proc/net/tcp or
    tcp6) whose socket is one of INODES. The kernel prints each 32-bit word of an
    address in the host's byte order."""
    try:
        with open(table) as f:
            lines = f.readlines()[1:]
    except OSError:
        return set()
    found = set()
    for line in lines:
        fields = line.split()
        if len(fields) < 10 or fields[3] != TCP_ESTABLISHED or fields[9] not in inodes:
            continue
        address, port = fields[2].split(":")
        packed = b"".join(int(address[i:i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(address), 8))
        family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
        found.add((normalize_ip(socket.inet_ntop(family, packed)), int(port, 16)))
    return found
