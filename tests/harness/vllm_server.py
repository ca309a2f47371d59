"""vLLM's own OpenAI server (`vllm serve`), started for real on a model folder: what
the gateway's answers are compared with.

A start may take long on two cores shared with the system tests' hosts: in one CI run
`vllm serve` wrote nothing for 300 s after its engine's OpenMP binding, and here one
was still importing its worker's modules after 300 s (the two-host roll beside it). So
a start gets up to START_TIMEOUT_S while its processes keep using the CPU, and is taken
as hung (and started once more) when they used less than STALL_CPU_S of it in the last
STALL_S. Before a start that did not answer is stopped, each of its Python processes
writes where its threads are (faulthandler, on SIGABRT) to the log, which the error
quotes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests

from tests.harness.net import ENGINE_ENV, free_port

# The e2e server's engine arguments (tests/harness/server.py), for vLLM's server too.
ENGINE_ARGS = ["--max-model-len", "512", "--enforce-eager", "--dtype", "bfloat16",
               "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
START_TIMEOUT_S = 900
STALL_S = 120
STALL_CPU_S = 2.0
STARTS = 2


@dataclass
class VllmServer:
    url: str  # the OpenAI base URL, http://HOST:PORT/v1
    log: Path


@contextmanager
def vllm_server(model: Path, workdir: Path, name: str, engine_args: list[str]) -> Iterator[VllmServer]:
    """`vllm serve MODEL` as NAME on a free port with ENGINE_ARGS, until the block ends."""
    workdir.mkdir(parents=True, exist_ok=True)
    hung: list[str] = []
    for start in range(1, STARTS + 1):
        port = free_port()
        log = workdir / f"vllm-serve-{start}.log"
        proc = _start(model, workdir, name, engine_args, port, log)
        try:
            why = _not_ready(proc, f"http://127.0.0.1:{port}/health", log)
            if why is None:
                yield VllmServer(f"http://127.0.0.1:{port}/v1", log)
                return
            if proc.poll() is None:
                _dump_stacks(proc, log)
            hung.append(f"start {start}: {why} ({log}):\n{log.read_text(errors='replace')[-6000:]}")
        finally:
            _stop_session(proc)
    raise RuntimeError(f"vllm serve did not answer in {STARTS} starts:\n" + "\n".join(hung))


def _start(model: Path, workdir: Path, name: str, engine_args: list[str], port: int,
           log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1",
               VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT") or str(workdir / "vllm-cache"),
               TMPDIR=str(workdir), PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1", **ENGINE_ENV)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats",
           *engine_args]
    with log.open("ab") as out:  # appending: the lines the harness adds are not written over
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _session(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The processes of PROC's session (the API server, its engine and workers). A
    process that ended while they were listed is not one (os.getsid raises
    ProcessLookupError for it)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(p.pid) == proc.pid:
                found.append(p)
    return found


def _dump_stacks(proc: subprocess.Popen[bytes], log: Path) -> None:
    """Every Python process of PROC's session writes its threads' stacks to LOG and
    ends (PYTHONFAULTHANDLER: SIGABRT); the rest of the session is stopped after."""
    with log.open("ab") as out:
        out.write(b"--- the stacks of every process ---\n")
    for p in _session(proc):
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGABRT)
            p.send_signal(signal.SIGCONT)  # a stopped process writes its stacks too
    time.sleep(3)


def _stop_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the whole session (the API server and its engine process); SIGKILL
    to what is left of it after a minute."""
    for sig, wait_s in ((signal.SIGTERM, 60.0), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)


def _cpu_s(proc: subprocess.Popen[bytes]) -> float:
    """CPU seconds used so far by the processes of PROC's session that are alive."""
    total = 0.0
    for p in _session(proc):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _not_ready(proc: subprocess.Popen[bytes], health: str, log: Path) -> str | None:
    """None once `vllm serve` answers its health check; why not, after START_TIMEOUT_S
    or once its processes used less than STALL_CPU_S of CPU in STALL_S (stalled), or at
    once when it exited (seen once: its Worker died in its start, leaving no trace)."""
    start = time.monotonic()
    marks: list[tuple[float, float]] = []  # (when, CPU seconds used by then)
    while True:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            if requests.get(health, timeout=2).status_code == 200:
                return None
        except requests.RequestException:
            pass
        now = time.monotonic()
        marks.append((now, _cpu_s(proc)))
        earlier = [m for m in marks if m[0] <= now - STALL_S]
        if earlier and marks[-1][1] - earlier[-1][1] < STALL_CPU_S:
            return f"stalled: less than {STALL_CPU_S:g} s of CPU in the last {STALL_S} s ({now - start:.0f} s in)"
        if now - start > START_TIMEOUT_S:
            return f"not ready after {START_TIMEOUT_S} s"
        time.sleep(1)
