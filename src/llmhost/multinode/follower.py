"""`llmhost follow`: the worker side of a model spread over several hosts.

A model too big for one host runs on vLLM's own multi-node runtime: the head host
serves it (tritonserver, our backend, vLLM's engine with ``node_rank`` 0) and each
other host runs vLLM's headless workers, which join the head's engine through
torch.distributed (pipeline or tensor parallel across the hosts). This is vLLM's
``vllm serve --headless`` launcher for that case (its multiprocessing executor,
without an API server), fed by the same model.json as the head, so the layout, the
weights' path and every engine argument are the head's by construction.

What vLLM leaves out, and this adds: a follower whose head went away (stopped,
restarted, its host down) keeps its workers waiting forever, and the restarted head
then waits for workers that will never join. Once joined, the follower watches its
workers' connection to the head's torch.distributed store (master_addr:master_port);
when it has been gone for GRACE_S, the follower stops its workers and exits with
EXIT_HEAD_GONE, and its supervisor (the llmhost-follower unit) starts it again, to
join the head's next engine.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from llmhost.backend.config import ConfigError, load_model_config
from llmhost.backend.watchdog import Sighting, connected_endpoints, normalize_ip
from llmhost.server.reaping import end_processes, is_resource_tracker

# EX_TEMPFAIL: the head went away; starting again is the way back.
EXIT_HEAD_GONE = 75
WATCH_INTERVAL_S = 1.0
# The textfile's timestamp is refreshed at least this often while the follower runs.
TEXTFILE_REFRESH_S = 15.0


class FollowerTextfile:
    """The follower's state as node_exporter textfile-collector metrics (atomic
    writes): whether its workers are joined to the head's engine, and when it last
    looked, so that a follower that is not running shows as stale."""

    def __init__(self, path: str, model: str) -> None:
        self.path = path
        self.model = model
        self._written_at = 0.0
        self._joined: bool | None = None
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Write 'not joined' one last time; later updates (the watch thread's) are ignored."""
        with self._lock:
            if not self._closed:
                self._write(False)
                self._closed = True

    def update(self, joined: bool, force: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            if force or joined != self._joined or time.time() - self._written_at >= TEXTFILE_REFRESH_S:
                self._write(joined)

    def _write(self, joined: bool) -> None:
        now = time.time()
        from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

        reg = CollectorRegistry()
        Gauge("llmhost_follower_joined", "1 while this follower's workers are joined to the head's engine.",
              ["model"], registry=reg).labels(self.model).set(1 if joined else 0)
        Gauge("llmhost_follower_last_check_timestamp_seconds", "When the follower last checked its head.",
              ["model"], registry=reg).labels(self.model).set(now)
        write_to_textfile(self.path, reg)
        self._joined, self._written_at = joined, now


class HeadWatch:
    """The decision part: fed the (address, port) pairs the workers are connected
    to, tells once that the head's store connection is gone for GRACE_S after it
    was seen."""

    def __init__(self, head: tuple[str, int], grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.head = head
        self.grace_s = grace_s
        self._store = Sighting(grace_s, clock)
        self.cause: str | None = None

    @property
    def joined(self) -> bool:
        return self._store.last_seen is not None

    def check(self, endpoints: Iterable[tuple[str, int]]) -> str | None:
        if self.cause is not None:
            return None
        if self._store.gone(self.head in set(endpoints)):
            self.cause = (f"the head's engine at {self.head[0]}:{self.head[1]} has had no connection to this "
                          f"follower's workers for {self.grace_s:g} s (stopped, restarted, or its host is down)")
            return self.cause
        return None


def follower_engine_args(engine_args: dict[str, Any], node_rank: int) -> dict[str, Any]:
    """The head's engine arguments with this follower's node rank; ConfigError
    naming what makes them no multi-node layout."""
    nnodes = engine_args.get("nnodes", 1)
    if not isinstance(nnodes, int) or isinstance(nnodes, bool) or nnodes < 2:
        raise ConfigError(f"model.json: nnodes must be an integer >= 2 for a model spread over hosts, "
                          f"got {nnodes!r}")
    if not 1 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank must be 1..{nnodes - 1} (0 is the head), got {node_rank}")
    for key in ("master_addr", "master_port"):
        if not engine_args.get(key):
            raise ConfigError(f"model.json: {key} (the head's address and port) is required on a follower")
    if int(engine_args.get("data_parallel_size", 1) or 1) > 1:
        raise ConfigError("model.json: data_parallel_size > 1: `llmhost follow` runs tensor or pipeline "
                          "parallel layouts across hosts; serve data parallel replicas as separate models")
    return {**engine_args, "node_rank": node_rank}


def _stop_workers(grace_s: float = 10.0) -> None:
    """End this process's descendants (the workers), all but its own resource tracker:
    it tracks the executor's shared memory, which this process keeps open, and unlinks
    it once this process has exited too; ended now, it would leak it."""
    import psutil

    me = psutil.Process()
    own_trackers = [p for p in me.children() if is_resource_tracker(p)]
    end_processes([p for p in me.children(recursive=True) if p not in own_trackers], grace_s)


def _watch_head(watch: HeadWatch, log: Callable[[str], None], textfile: FollowerTextfile | None,
                stopping: threading.Event) -> None:
    pid = os.getpid()
    while not stopping.wait(WATCH_INTERVAL_S):
        endpoints = connected_endpoints(pid)
        cause = watch.check(endpoints)
        if textfile is not None:
            textfile.update(watch.head in endpoints)
        if cause is not None:
            log(f"llmhost follow: {cause}; stopping the workers and exiting ({EXIT_HEAD_GONE}) to join its next "
                "engine")
            _stop_workers()
            if textfile is not None:
                textfile.close()
            os._exit(EXIT_HEAD_GONE)


def follow(model_json: Path, node_rank: int, host_ip: str | None, grace_s: float,
           textfile_path: str | None = None) -> int:
    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        config = load_model_config(model_json)
        raw = follower_engine_args(config.engine_args, node_rank)
        head = (normalize_ip(socket.gethostbyname(str(raw["master_addr"]))), int(raw["master_port"]))
    except (ConfigError, OSError, ValueError) as exc:
        log(f"llmhost follow: {exc}")
        return 2
    if host_ip:
        os.environ["VLLM_HOST_IP"] = host_ip

    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from llmhost.backend.engine import build_engine_args

    vllm_config = build_engine_args(raw).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER, headless=True)

    # Set once the follower is asked to stop: its workers' connections then end by
    # design, not because the head went away.
    stopping = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.set()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log(f"llmhost follow: node {node_rank} of {raw['nnodes']}, joining the head at {head[0]}:{head[1]}"
        + (f" from {host_ip}" if host_ip else ""))
    watch = HeadWatch(head, grace_s)
    textfile = None
    if textfile_path:
        textfile = FollowerTextfile(textfile_path, str(raw.get("served_model_name") or Path(str(raw["model"])).name))
        textfile.update(False, force=True)
    threading.Thread(target=_watch_head, args=(watch, log, textfile, stopping), name="llmhost-head-watch",
                     daemon=True).start()
    try:
        # Waits for the head's engine (torch.distributed's store at master_addr:master_port).
        executor = MultiprocExecutor(vllm_config, monitor_workers=False)
    except BaseException:
        _stop_workers()
        if textfile is not None:
            textfile.close()
        raise
    try:
        # Returns when one of this host's workers dies.
        executor.start_worker_monitor(inline=True)
    finally:
        executor.shutdown()
        if textfile is not None:
            textfile.close()
    # A head that went away often ends the workers (their collectives fail) before
    # the watch's grace is over: its verdict decides how the follower exits.
    deadline = time.monotonic() + grace_s + 3 * WATCH_INTERVAL_S
    while watch.cause is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if watch.cause is not None:
        return EXIT_HEAD_GONE
    log("llmhost follow: a worker ended; exiting so that the unit starts the follower again")
    return 1
