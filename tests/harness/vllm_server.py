"""vLLM's own OpenAI server (`vllm serve`), started for real on a model folder: what
the gateway's answers are compared with.

A start that has not answered within START_TIMEOUT_S is taken as hung and started once
more: in one CI run (2 slow cores, the system tests' hosts beside it) `vllm serve`
wrote nothing for 300 s after its engine's OpenMP binding and never answered. Before
it is killed, each Python process of the hung start writes where its threads wait
(faulthandler, on SIGABRT) to the log, which the error quotes."""

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
START_TIMEOUT_S = 300
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
            if _wait_ready(proc, f"http://127.0.0.1:{port}/health", log):
                yield VllmServer(f"http://127.0.0.1:{port}/v1", log)
                return
            _dump_stacks(proc, log)
            hung.append(f"start {start}: not ready after {START_TIMEOUT_S} s ({log}):\n"
                        f"{log.read_text(errors='replace')[-6000:]}")
        finally:
            _stop_session(proc)
    raise RuntimeError(f"vllm serve did not answer in {STARTS} starts:\n" + "\n".join(hung))


def _start(model: Path, workdir: Path, name: str, engine_args: list[str], port: int,
           log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1",
               VLLM_CACHE_ROOT=str(workdir / "vllm-cache"), TMPDIR=str(workdir), PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1", **ENGINE_ENV)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats",
           *engine_args]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _session(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The processes of PROC's session (the API server, its engine and workers)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if os.getsid(p.pid) == proc.pid:
                found.append(p)
    return found


def _dump_stacks(proc: subprocess.Popen[bytes], log: Path) -> None:
    """Every Python process of PROC's session writes its threads' stacks to LOG and
    ends (PYTHONFAULTHANDLER: SIGABRT); the rest of the session is stopped after."""
    with log.open("ab") as out:
        out.write(f"\n--- not ready after {START_TIMEOUT_S} s: the stacks of every process ---\n".encode())
    for p in _session(proc):
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGABRT)
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


def _wait_ready(proc: subprocess.Popen[bytes], health: str, log: Path) -> bool:
    """Whether `vllm serve` answered its health check within START_TIMEOUT_S; an exit
    is an error at once."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            if requests.get(health, timeout=2).status_code == 200:
                return True
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(1)
