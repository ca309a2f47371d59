"""A gateway (`llmhost gateway`) as the e2e tests start it: a process of its own."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.harness.net import CLIENT_TIMEOUT_S

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


def keyed_gateway(server: Any, work: Path, *flags: str) -> Gateway:
    """`llmhost gateway` in front of SERVER (tests/harness/server.py) on free ports, with
    a keys file in WORK that lets KEY in, and FLAGS; started and answering."""
    from llmhost.gateway.keys import hash_key
    from tests.harness.net import free_port

    keys = work / "keys.yml"
    keys.write_text(f"keys:\n  - name: tester\n    sha256: {hash_key(KEY)}\n")
    port, metrics_port = free_port(), free_port()
    log = work / "gateway.log"
    url = f"http://127.0.0.1:{port}/v1"
    cmd = [str(Path(sys.executable).parent / "llmhost"), "gateway", "--upstream", server.grpc,
           "--listen", f"127.0.0.1:{port}", "--keys-file", str(keys), "--model", server.name,
           "--metrics-listen", f"127.0.0.1:{metrics_port}", *flags]
    return Gateway(url, start_gateway(cmd, log, url), log, f"http://127.0.0.1:{metrics_port}/metrics")


def port_of(gateway: Gateway) -> int:
    return int(gateway.url.rsplit(":", 1)[1].split("/", 1)[0])


@contextmanager
def openai_client(server: Any, work: Path) -> Iterator[Any]:
    """The official `openai` client of a keyed gateway in front of SERVER that streams
    from its engine sockets, as `make demo` runs it; the gateway stops when the block ends."""
    import openai

    gateway = keyed_gateway(server, work, "--engine-sockets", f"{server.grpc}={server.engine_sockets}")
    try:
        yield openai.OpenAI(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S)
    finally:
        stop_gateway(gateway.proc, gateway.log)
