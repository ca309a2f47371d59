"""A gateway (`llmhost gateway`) as the e2e tests start it: a process of its own."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

# The key every e2e gateway's keys file lets in.
KEY = "test-key-0123456789abcdef"


@dataclass
class Gateway:
    url: str  # the OpenAI base URL, http://HOST:PORT/v1
    proc: subprocess.Popen[bytes]
    log: Path
    metrics: str  # http://HOST:PORT/metrics


def start_gateway(cmd: list[str], log: Path, url: str, verify: bool | ssl.SSLContext = True) -> subprocess.Popen[bytes]:
    """Start a gateway; return once GET /v1/models answers 200."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}, verify=verify).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.3)


def stop_gateway(proc: subprocess.Popen[bytes], log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then ends by the signal it got.
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM), log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()
