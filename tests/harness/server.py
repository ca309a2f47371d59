"""Start and stop a real `llmhost serve` (tritonserver + our backend + vLLM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.harness.endpoint import Endpoint
from tests.harness.net import ENGINE_ENV, free_port

# One start may take START_TIMEOUT_S until tritonserver answers; `llmhost serve` kills one
# that has not (a start that hangs: docs/testing.md) and starts it again, so the tests wait
# for that second start too.
START_TIMEOUT_S = 600
READY_TIMEOUT_S = 2 * START_TIMEOUT_S + 30
# What `llmhost serve` prints once it has seen the model ready.
SERVE_READY = "llmhost serve: ready."


def process_name(p: psutil.Process) -> str:
    """A process's command line (vLLM's EngineCore shows there), or its name; "?" once gone."""
    try:
        return " ".join(p.cmdline()) or p.name()
    except psutil.NoSuchProcess:
        return "?"


@dataclass
class Server(Endpoint):
    proc: subprocess.Popen[bytes]
    log: Path
    engine_sockets: Path | None = None  # the folder of its engine sockets (llmhost.backend.stream_socket)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def engine_cores(self) -> list[psutil.Process]:
        """vLLM's EngineCore processes among its descendants."""
        return [p for p in self.descendants() if "EngineCore" in process_name(p)]

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)


def start_server(model: Path, workdir: Path, name: str = "tiny", extra: list[str] | None = None) -> Server:
    """Start a server on free ports; a port taken between choosing and binding it
    (another process's ephemeral port) means another try on new ports, and so does an
    engine that found too little free memory for its KV cache (other tests' engines
    and booted hosts share this machine's memory), once memory is free again."""
    why = ""
    for attempt in range(3):
        try:
            return _start_once(model, workdir / f"try{attempt}" if attempt else workdir, name, extra)
        except PortTaken as exc:
            why = f"ports taken: {exc}"
        except NoMemory as exc:
            why = f"too little memory: {exc}"
            print(f"start_server: vLLM's engine found too little free memory for its KV cache; waiting up to "
                  f"{MEMORY_WAIT_S} s for {FREE_MEMORY_GIB} GiB free, then starting again", file=sys.stderr)
            deadline = time.monotonic() + MEMORY_WAIT_S
            while time.monotonic() < deadline and psutil.virtual_memory().available < FREE_MEMORY_GIB * 2**30:
                time.sleep(2)
    raise RuntimeError(f"the server did not start in 3 tries; the last: {why}")


class PortTaken(RuntimeError):
    pass


class NoMemory(RuntimeError):
    pass


# vLLM's CPU engine refuses to start where less memory is free than its KV cache asks.
NO_MEMORY_SIGN = "on kv cache allocation is less than requested memory for kv"
MEMORY_WAIT_S = 300
FREE_MEMORY_GIB = 4


def _start_once(model: Path, workdir: Path, name: str, extra: list[str] | None) -> Server:
    http, grpc, metrics = free_port(), free_port(), free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "serve.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(workdir), **ENGINE_ENV)
    cmd = [
        str(Path(sys.executable).parent / "llmhost"), "serve", "--model", str(model), "--name", name,
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
        # Relative, from WORKDIR: the server runs beside a folder named `triton`, which
        # must not shadow the `triton` package for vLLM's processes.
        "--workdir", "triton", "--device", "cpu", "--max-model-len", "512",
        "--drain-timeout", "20", "--start-timeout", str(START_TIMEOUT_S),
        # Structured output without free whitespace, so a random model finishes JSON.
        "--engine-arg", 'structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": true}',
        *(extra or []),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    server = Server(name=name, http=f"http://127.0.0.1:{http}", grpc=f"127.0.0.1:{grpc}",
                    metrics=f"http://127.0.0.1:{metrics}", proc=proc, log=log,
                    engine_sockets=workdir / "triton" / "engine")
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = server.log_tail()
            if "already in use" in tail:
                raise PortTaken(tail)
            if NO_MEMORY_SIGN in log.read_text(errors="replace"):
                raise NoMemory(tail)
            raise RuntimeError(f"llmhost serve exited with {proc.returncode}:\n{tail}")
        # Ready for the tests once `llmhost serve` has seen it ready too: serve takes a
        # first start that fails for a configuration that fails again (no restart).
        if server.model_ready(timeout_s=2) and SERVE_READY in log.read_text(errors="replace"):
            return server
        time.sleep(1)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server not ready after {READY_TIMEOUT_S}s:\n{server.log_tail()}")


def wait_gone(procs: list[psutil.Process], timeout_s: float = 30) -> list[psutil.Process]:
    """Processes (of those given) still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    alive = procs
    while time.monotonic() < deadline:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return []
        time.sleep(0.5)
    return alive
