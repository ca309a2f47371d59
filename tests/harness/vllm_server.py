"""vLLM's own OpenAI server (`vllm serve`), started for real on a model folder: what
the gateway's answers are compared with."""

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

import requests

from tests.harness.net import ENGINE_ENV, free_port

READY_TIMEOUT_S = 300


@dataclass
class VllmServer:
    url: str  # the OpenAI base URL, http://HOST:PORT/v1
    log: Path


@contextmanager
def vllm_server(model: Path, workdir: Path, name: str, engine_args: list[str]) -> Iterator[VllmServer]:
    """`vllm serve MODEL` as NAME on a free port with ENGINE_ARGS, until the block ends."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "vllm-serve.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1",
               VLLM_CACHE_ROOT=str(workdir / "vllm-cache"), TMPDIR=str(workdir), PYTHONUNBUFFERED="1",
               **ENGINE_ENV)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats",
           *engine_args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}/health", log)
        yield VllmServer(f"http://127.0.0.1:{port}/v1", log)
    finally:
        _stop_session(proc)


def _stop_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the whole session (the API server and its engine process); SIGKILL
    to what is left of it after a minute."""
    for sig, wait_s in ((signal.SIGTERM, 60.0), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)


def _wait_ready(proc: subprocess.Popen[bytes], health: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            if requests.get(health, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"vllm serve not ready after {READY_TIMEOUT_S} s:\n"
                               f"{log.read_text(errors='replace')[-4000:]}")
        time.sleep(1)
