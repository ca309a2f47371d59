"""Several gateway processes on one port, so that a host streaming tens of thousands of
engine steps a second is not held to one Python event loop.

With more than one worker (``--workers``; 0, the default: one per 4 of the cores this
process may run on, at most 8), ``llmhost gateway`` is a supervisor:

- It binds the API's address once per worker with ``SO_REUSEPORT`` (the kernel spreads
  new connections over the sockets) and starts each worker, ``python -m
  llmhost.gateway.cli`` with the same arguments and its socket inherited. A worker that
  dies is started again on the same socket, so connections queued on it wait for the new
  one instead of being refused.
- It keeps what must be one for all workers, over a Unix socket that each worker holds
  open (JSON lines, calls both ways): the keys' limits (each admission and its end go
  through it, so a key's ``rpm``, ``tpm`` and ``max_concurrent`` hold across workers,
  and a worker that dies gives its requests' slots back), and the upstreams an operator
  holds out (the admin API's hold and return reach every worker, and its list adds up
  every worker's requests in flight).
- It creates the table where every worker counts its requests in flight per upstream and
  engine socket (``llmhost.gateway.routing.inflight``), so that each worker routes by the
  host's load rather than its own share of it; a worker's row is zeroed when it ends.
- It serves /metrics: the workers' counters and histograms (prometheus_client's
  multiprocess mode) and the upstream gauges, every worker's view combined (``up`` and
  ``state`` as the share of workers that see the upstream so, requests in flight summed).
- SIGTERM and SIGINT reach every worker (each drains as a single gateway does); it exits
  when they have. SIGHUP reaches every worker (each loads its TLS certificate again).

Each worker runs its own health checks and takes its share of the per-upstream and
connection bounds (``max_concurrent_upstream``, ``max_queue``, ``max_connections``
divided by the number of workers, rounded up).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.errors import ApiError
from llmhost.gateway.keys import ApiKey
from llmhost.gateway.limits import KeyLimiter, Lease, RateLimited
from llmhost.gateway.routing.inflight import SharedInFlight, clear_row, create_table
from llmhost.gateway.routing.pool import DRAINING, IN_SERVICE, OUT, STATES, UpstreamPool

# The requests in flight of every worker (routing.inflight), in the supervisor's folder.
IN_FLIGHT_TABLE = "in-flight"
# Set in a worker's environment: "INDEX COUNT FD CONTROL_SOCKET".
WORKER_ENV = "LLMHOST_GATEWAY_WORKER"
CORES_PER_WORKER = 4
MAX_AUTO_WORKERS = 8
# A worker that lived this long before it died is started again at once.
STEADY_S = 60.0
MAX_RESTART_DELAY_S = 30.0
_CALL_TIMEOUT_S = 5.0


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worker_count(configured: int, cores: int | None = None) -> int:
    """CONFIGURED workers, or for 0 one per CORES_PER_WORKER cores (1 to MAX_AUTO_WORKERS)."""
    if configured > 0:
        return configured
    cores = usable_cores() if cores is None else cores
    return max(1, min(MAX_AUTO_WORKERS, cores // CORES_PER_WORKER))


def _share(total: int, workers: int) -> int:
    return -(-total // workers)


def worker_config(config: GatewayConfig, workers: int) -> GatewayConfig:
    """CONFIG as one of WORKERS workers applies it: its share of the bounds that each
    worker keeps on its own."""
    return dataclasses.replace(config, max_concurrent_upstream=_share(config.max_concurrent_upstream, workers),
                               max_queue=_share(config.max_queue, workers),
                               max_connections=_share(config.max_connections, workers))


@dataclasses.dataclass(frozen=True)
class WorkerPlace:
    """Where a worker stands: its index of COUNT, its listening socket's file descriptor
    and the supervisor's control socket."""

    index: int
    count: int
    fd: int
    control: str

    def env(self) -> str:
        return f"{self.index} {self.count} {self.fd} {self.control}"

    @classmethod
    def parse(cls, text: str) -> WorkerPlace:
        index, count, fd, control = text.split(" ", 3)
        return cls(int(index), int(count), int(fd), control)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to HOST:PORT with SO_REUSEPORT, listening, inheritable."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


# --- the control connection -----------------------------------------------------------

class ChannelClosed(ConnectionError):
    """The other end of a control connection is gone."""


Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class Channel:
    """Calls both ways over one stream connection, one JSON object a line: a call
    ``{"id": N, "op": ...}`` is answered ``{"re": N, ...}``; a note (no id) is not."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler) -> None:
        self.reader, self.writer, self.handler = reader, writer, handler
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = asyncio.Event()

    def _write(self, msg: dict[str, Any]) -> None:
        if self.closed.is_set():
            raise ChannelClosed("the control connection is closed")
        self.writer.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")

    async def call(self, op: str, timeout_s: float = _CALL_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        """OP's answer from the other end (ChannelClosed if the connection ends first,
        TimeoutError after TIMEOUT_S)."""
        n = next(self._ids)
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[n] = waiter
        try:
            self._write({"id": n, "op": op, **args})
            return await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._waiting.pop(n, None)

    def note(self, op: str, **args: Any) -> None:
        """OP to the other end, no answer awaited; nothing if the connection is closed."""
        with contextlib.suppress(ChannelClosed):
            self._write({"op": op, **args})

    async def run(self) -> None:
        """Read until the connection ends: answers to our calls, and the other end's calls
        and notes, each handled in order of arrival."""
        try:
            while line := await self.reader.readline():
                msg = json.loads(line)
                if "re" in msg:
                    waiter = self._waiting.get(msg["re"])
                    if waiter is not None and not waiter.done():
                        waiter.set_result(msg)
                    continue
                task = asyncio.ensure_future(self._answer(msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (ConnectionError, ValueError):
            pass
        finally:
            self.closed.set()
            for waiter in self._waiting.values():
                if not waiter.done():
                    waiter.set_exception(ChannelClosed("the control connection closed"))
            self.writer.close()

    async def _answer(self, msg: dict[str, Any]) -> None:
        result = await self.handler(msg)
        if "id" in msg:
            with contextlib.suppress(ChannelClosed):
                self._write({"re": msg["id"], **result})


# --- what the workers share, kept by the supervisor ------------------------------------

def merge_upstreams(views: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One list of upstreams from every worker's (``pool.view()``): requests in flight
    summed, held if held anywhere, the state most workers see (on a tie, the less
    available one), and ``up`` as the share of workers that route to it."""
    order = {OUT: 0, DRAINING: 1, IN_SERVICE: 2}
    merged: dict[str, dict[str, Any]] = {}
    states: dict[str, Counter[str]] = {}
    for view in views:
        for row in view:
            target = row["target"]
            into = merged.setdefault(target, {"target": target, "state": OUT, "held": False, "outstanding": 0,
                                              "up": 0.0})
            into["held"] = into["held"] or bool(row["held"])
            into["outstanding"] += int(row["outstanding"])
            into["up"] += 1.0 if row["up"] else 0.0
            states.setdefault(target, Counter())[row["state"]] += 1
    for target, into in merged.items():
        counts = states[target]
        into["state"] = max(counts, key=lambda s: (counts[s], -order[s]))
        into["states"] = {s: counts[s] / len(views) for s in STATES}
        into["up"] /= len(views)
    return list(merged.values())


class Supervisor:
    """The shared state of the workers, answering their calls (``handle``)."""

    def __init__(self, config: GatewayConfig, keys: list[ApiKey]) -> None:
        self.config = config
        self.keys = {k.name: k for k in keys}
        self.limiter = KeyLimiter(default_max_concurrent=config.key_max_concurrent or None)
        self._lease_ids = itertools.count(1)
        self.leases: dict[int, tuple[Channel, Lease]] = {}
        self.channels: dict[int, Channel] = {}
        self.held: set[str] = set()

    def admit(self, channel: Channel, key_name: str, tokens: int) -> dict[str, Any]:
        key = self.keys.get(key_name)
        if key is None:
            return {"error": f"no key named {key_name!r}"}
        try:
            lease = self.limiter.admit(key, tokens)
        except RateLimited as exc:
            return {"limited": exc.limit, "status": exc.status, "message": exc.message, "type": exc.type,
                    "param": exc.param, "code": exc.code, "headers": exc.headers}
        n = next(self._lease_ids)
        self.leases[n] = (channel, lease)
        return {"lease": n}

    def finish(self, lease: int, used: int | None) -> None:
        entry = self.leases.pop(lease, None)
        if entry is not None:
            entry[1].finish(used)

    def gone(self, channel: Channel) -> None:
        """CHANNEL's worker is gone: its requests' slots are free."""
        for n in [n for n, (c, _) in self.leases.items() if c is channel]:
            self.finish(n, None)
        for index in [i for i, c in self.channels.items() if c is channel]:
            del self.channels[index]

    async def views(self) -> list[dict[str, Any]]:
        """Every live worker's pool view (``pool`` call); a worker that does not answer
        in time is left out."""
        answers = await asyncio.gather(*(c.call("pool", timeout_s=2.0) for c in list(self.channels.values())),
                                       return_exceptions=True)
        return [a for a in answers if isinstance(a, dict) and "upstreams" in a]

    async def upstreams(self) -> dict[str, Any]:
        views = await self.views()
        return {"upstreams": merge_upstreams([v["upstreams"] for v in views]) if views else []}

    async def hold(self, target: str, held: bool) -> dict[str, Any]:
        (self.held.add if held else self.held.discard)(target)
        await asyncio.gather(*(c.call("hold", target=target, held=held) for c in list(self.channels.values())),
                             return_exceptions=True)
        return await self.upstreams()

    def handler(self, channel: Channel) -> Handler:
        async def handle(msg: dict[str, Any]) -> dict[str, Any]:
            op = msg.get("op")
            if op == "admit":
                return self.admit(channel, str(msg["key"]), int(msg["tokens"]))
            if op == "finish":
                used = msg.get("used")
                self.finish(int(msg["lease"]), int(used) if used is not None else None)
                return {}
            if op == "hello":
                self.channels[int(msg["index"])] = channel
                return {"held": sorted(self.held)}
            if op == "upstreams":
                return await self.upstreams()
            if op == "hold":
                return await self.hold(str(msg["target"]), bool(msg["held"]))
            return {"error": f"unknown call {op!r}"}

        return handle

    async def connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = Channel(reader, writer, _unanswered)
        channel.handler = self.handler(channel)
        try:
            await channel.run()
        finally:
            self.gone(channel)


async def _unanswered(msg: dict[str, Any]) -> dict[str, Any]:
    return {"error": "not ready"}


# --- a worker's side -------------------------------------------------------------------

class RemoteLease:
    """A request admitted by the supervisor; ``finish`` (once) tells it the tokens used."""

    def __init__(self, channel: Channel, lease: int) -> None:
        self.channel, self.lease, self.done = channel, lease, False

    def finish(self, used_tokens: int | None) -> None:
        if not self.done:
            self.done = True
            self.channel.note("finish", lease=self.lease, used=used_tokens)


class SharedState:
    """A worker's view of what the workers share: the supervisor's answers to its calls."""

    def __init__(self, channel: Channel, reading: asyncio.Task[None]) -> None:
        self.channel = channel
        self.reading = reading  # Channel.run: ends when the supervisor is gone

    async def admit(self, key: ApiKey, estimated_tokens: int) -> RemoteLease:
        """A lease for one request of KEY, or RateLimited (as KeyLimiter.admit)."""
        try:
            answer = await self.channel.call("admit", key=key.name, tokens=estimated_tokens)
        except (ChannelClosed, TimeoutError):
            raise ApiError(503, "the gateway is restarting; retry shortly", "service_unavailable_error", None,
                           "gateway_restarting", {"Retry-After": "1"}) from None
        if "limited" in answer:
            err = ApiError(answer["status"], answer["message"], answer["type"], answer["param"], answer["code"],
                           answer["headers"])
            raise RateLimited.of(answer["limited"], err)
        if "lease" not in answer:
            raise ApiError(500, f"the gateway's key limits failed: {answer.get('error')}", "server_error", None,
                           "internal_error")
        return RemoteLease(self.channel, int(answer["lease"]))

    async def upstreams(self) -> dict[str, Any]:
        return await self.channel.call("upstreams")

    async def hold(self, target: str, held: bool) -> dict[str, Any]:
        return await self.channel.call("hold", target=target, held=held)


def worker_handler(pool: UpstreamPool) -> Handler:
    """A worker's answers to the supervisor: its pool's view, and hold/return."""

    async def handle(msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "pool":
            return {"upstreams": pool.view(), "panic_routed": pool.panic_routed}
        if op == "hold":
            member = pool.member(str(msg["target"]))
            if member is not None:
                await pool.hold(member, bool(msg["held"]))
            return {}
        return {"error": f"unknown call {op!r}"}

    return handle


def in_flight_table(control: Path | str) -> Path:
    """The table of requests in flight, in the supervisor's folder beside its control socket."""
    return Path(control).parent / IN_FLIGHT_TABLE


def share_in_flight(place: WorkerPlace, pool: UpstreamPool) -> SharedInFlight:
    """Route by the requests in flight of every worker: POOL's upstreams and their engine
    sockets counted in the supervisor's table, this worker's in its row."""
    shared = SharedInFlight(in_flight_table(place.control), place.index)
    pool.in_flight = shared
    for member in pool.members:
        if hasattr(member.client, "in_flight"):
            member.client.in_flight = shared
    return shared


async def join(place: WorkerPlace, pool: UpstreamPool) -> SharedState:
    """Connect to the supervisor as worker PLACE, counting requests in flight in its table;
    the upstreams it holds are held here too."""
    share_in_flight(place, pool)
    reader, writer = await asyncio.open_unix_connection(place.control)
    channel = Channel(reader, writer, worker_handler(pool))
    reading = asyncio.ensure_future(channel.run())
    hello = await channel.call("hello", index=place.index)
    for target in hello.get("held", []):
        member = pool.member(target)
        if member is not None:
            await pool.hold(member, True)
    return SharedState(channel, reading)


# --- the supervisor process -------------------------------------------------------------

def _say(msg: str) -> None:
    print(f"llmhost gateway: {msg}", file=sys.stderr, flush=True)


class Workers:
    """The worker processes: each started on its socket, again when it dies, until stop."""

    def __init__(self, argv: list[str], sockets: list[socket.socket], control: Path, metrics_dir: Path) -> None:
        self.argv, self.sockets, self.control, self.metrics_dir = argv, sockets, control, metrics_dir
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.stopping = asyncio.Event()

    def signal_all(self, sig: int) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    def stop(self, sig: int) -> None:
        self.stopping.set()
        self.signal_all(sig)

    async def keep(self, index: int) -> None:
        from prometheus_client import multiprocess

        sock = self.sockets[index]
        place = WorkerPlace(index, len(self.sockets), sock.fileno(), str(self.control))
        env = {**os.environ, WORKER_ENV: place.env(), "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)}
        delay = 1.0
        while not self.stopping.is_set():
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "llmhost.gateway.cli", *self.argv,
                                                        env=env, pass_fds=(sock.fileno(),))
            self.procs[index] = proc
            code = await proc.wait()
            multiprocess.mark_process_dead(proc.pid, str(self.metrics_dir))
            clear_row(in_flight_table(self.control), index)  # its requests ended with it
            if self.stopping.is_set():
                return
            if time.monotonic() - started > STEADY_S:
                delay = 1.0
            _say(f"worker {index} (pid {proc.pid}) ended with {code}; starting it again in {delay:g} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)
            delay = min(delay * 2, MAX_RESTART_DELAY_S)


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or None
    path = Path(tempfile.mkdtemp(prefix="llmhost-gateway-", dir=runtime))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def supervise(config: GatewayConfig, keys: list[ApiKey], argv: list[str], sockets: list[socket.socket],
                    metrics_server: Callable[[Callable[[], Awaitable[bytes]]], Any],
                    on_sighup: Callable[[], None] | None = None) -> None:
    """Run the workers on SOCKETS (one each) until SIGTERM/SIGINT and they have drained.
    METRICS_SERVER makes the /metrics server (a uvicorn.Server) from a scrape function.
    SIGHUP reaches every worker, then ON_SIGHUP (the /metrics server's certificate)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    from llmhost.gateway.metrics import PoolCollector

    loop = asyncio.get_running_loop()
    with _workdir() as work:
        control, metrics_dir = work / "control.sock", work / "metrics"
        metrics_dir.mkdir()
        create_table(in_flight_table(control), len(sockets))
        state = Supervisor(config, keys)
        server = await asyncio.start_unix_server(state.connected, path=str(control))
        os.chmod(control, 0o600)
        workers = Workers(argv, sockets, control, metrics_dir)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, workers.stop, sig)

        def hangup() -> None:
            workers.signal_all(signal.SIGHUP)
            if on_sighup is not None:
                on_sighup()

        loop.add_signal_handler(signal.SIGHUP, hangup)

        async def scrape() -> bytes:
            views = await state.views()
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=str(metrics_dir))
            registry.register(PoolCollector(lambda: combined_rows(views)))
            return bytes(generate_latest(registry))

        side = metrics_server(scrape)
        metrics = asyncio.ensure_future(side.serve())
        try:
            await asyncio.gather(*(workers.keep(i) for i in range(len(sockets))))
        finally:
            side.should_exit = True
            await metrics
            server.close()
            for sock in sockets:
                sock.close()


def combined_rows(views: list[dict[str, Any]]) -> tuple[list[tuple[str, float, float, dict[str, float]]], float]:
    """The upstream gauges' rows (see metrics.PoolCollector) from every worker's view."""
    merged = merge_upstreams([v["upstreams"] for v in views]) if views else []
    rows = [(m["target"], float(m["up"]), float(m["outstanding"]), m["states"]) for m in merged]
    return rows, float(sum(v.get("panic_routed", 0) for v in views))
