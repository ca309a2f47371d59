"""Clean shutdown: in-flight streams drain on SIGTERM, and no tritonserver, stub,
EngineCore or Worker process survives SIGTERM of `llmhost serve` or SIGKILL of
its tritonserver."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
from pathlib import Path

import psutil
import requests

from llmhost.gateway.upstreams.client import Upstream
from llmhost.gateway.upstreams.request import BackendRequest
from llmhost.smoke import parse_sse
from tests.harness.server import Server, start_server, wait_gone


def _names(procs: list[psutil.Process]) -> set[str]:
    out = set()
    for p in procs:
        try:
            out.add(p.name())
        except psutil.NoSuchProcess:
            pass
    return out


def _gateway_traffic(srv: Server) -> int:
    """160 requests over gRPC the way the gateway sends them (llmhost.gateway.upstreams.client),
    four at a time; the number answered in full."""
    request = BackendRequest(model=srv.name, text_input="def main():", messages=None,
                             sampling={"max_tokens": 8, "ignore_eos": True}, stream=False, n=1,
                             include_usage=False, chat=False)

    async def traffic() -> int:
        client = Upstream(srv.grpc)

        async def one() -> int:
            done = 0
            for _ in range(40):
                async for piece in client.generate(request):
                    done += piece.final
            return done

        try:
            return sum(await asyncio.gather(*(one() for _ in range(4))))
        finally:
            await client.close()

    return asyncio.run(traffic())


DRAIN_S = 60


def test_sigterm_drains_streams_and_leaves_nothing(tiny_model: Path, tmp_path: Path):
    """After the gateway's traffic, with a client holding an idle keep-alive HTTP
    connection, a stream in flight when SIGTERM comes completes, the model unloads
    (finalize runs), serve exits 0 and nothing is left. With the gateway cancelling
    each finished gRPC call, Triton 2.51 kept a reference to the model, spent its
    whole exit timeout waiting for it and exited 1; it did the same for the idle
    connection until serve closed it once the model had drained (llmhost.server.stopserver)."""
    # A drain of 60 s (the harness gives 20): 300 tokens on two loaded cores took over 20 s.
    srv = start_server(tiny_model, tmp_path, extra=["--drain-timeout", str(DRAIN_S)])
    assert _gateway_traffic(srv) == 160
    keep_alive = requests.Session()  # a pooled connection, idle through the stop
    assert keep_alive.get(f"{srv.http}/v2/health/ready", timeout=30).status_code == 200
    kids = srv.descendants()
    names = " ".join(_names(kids))
    assert "tritonserver" in names and "EngineCore" in names, names
    results: list[list[dict]] = []
    started = threading.Event()

    def client() -> None:
        body = {"text_input": "def main():", "max_tokens": 300, "ignore_eos": True, "stream": True,
                "return_num_output_tokens": True}
        lines = []
        with requests.post(f"{srv.http}/v2/models/{srv.name}/generate_stream", json=body, stream=True,
                           timeout=DRAIN_S + 120) as r:
            for line in r.iter_lines(chunk_size=1, decode_unicode=True):
                if line:
                    lines.append(line)
                    started.set()
        results.append(parse_sse(lines))

    t = threading.Thread(target=client)
    t.start()
    assert started.wait(timeout=120), "the stream never started"
    rc = srv.stop(signal.SIGTERM, timeout_s=DRAIN_S + 120)
    t.join(timeout=60)
    assert rc == 0, srv.log_tail()
    log = srv.log.read_text(errors="replace")
    assert "Exit timeout expired" not in log and "[llmhost] unloaded in" in log, srv.log_tail()
    assert re.search(r"llmhost serve: closed 1 idle HTTP connection\(s\) to port \d+ \(every model drained\)",
                     log), srv.log_tail()
    # Each response counts its own tokens.
    assert results and sum(e["num_output_tokens"] for e in results[0]) == 300, "the in-flight stream was cut short"
    keep_alive.close()
    left = wait_gone(kids, timeout_s=30)
    assert not left, f"left behind: {_names(left)}"


def test_sigkill_of_tritonserver_leaves_nothing(tiny_model: Path, tmp_path: Path):
    # No restart (serve would restart it, like systemd: tests/e2e/test_engine_lifecycle.py covers that).
    srv = start_server(tiny_model, tmp_path, extra=["--max-restarts", "0"])
    kids = srv.descendants()
    triton = next(p for p in kids if p.name() == "tritonserver")
    triton.send_signal(signal.SIGKILL)
    rc = srv.proc.wait(timeout=60)
    assert rc != 0  # serve reports the crash
    left = wait_gone(kids, timeout_s=30)
    assert not left, f"left behind: {_names(left)}"
    tail = srv.log_tail(5)
    assert "reaped" in tail and "was killed by SIGKILL; not restarting it" in tail, tail


def test_sigterm_ends_a_stream_that_outlives_the_drain_with_an_error(tiny_model: Path, tmp_path: Path):
    """A stream that cannot finish within drain_timeout_s (vLLM's engine frozen with
    SIGSTOP) gets the shutting-down error once the drain is over; the server then
    stops cleanly (status 0) and leaves nothing."""
    srv = start_server(tiny_model, tmp_path, extra=["--drain-timeout", "2"])
    kids = srv.descendants()
    engine = [p for p in kids if p.name().startswith("VLLM::")]
    assert engine, _names(kids)
    outcome: dict[str, object] = {}

    def client() -> None:
        body = {"text_input": "def main():", "max_tokens": 300, "ignore_eos": True, "stream": True}
        lines = []
        try:
            with requests.post(f"{srv.http}/v2/models/{srv.name}/generate_stream", json=body, stream=True,
                               timeout=120) as r:
                lines = [line for line in r.iter_lines(decode_unicode=True) if line]
            outcome["events"] = parse_sse(lines)
        except (requests.RequestException, RuntimeError) as exc:  # RuntimeError: an SSE error event
            outcome["error"] = str(exc)

    for p in engine:
        p.send_signal(signal.SIGSTOP)
    t = threading.Thread(target=client)
    try:
        t.start()
        t.join(timeout=3)  # the request reaches the backend; no token can come
        assert t.is_alive(), outcome
        srv.proc.send_signal(signal.SIGTERM)
        t.join(timeout=60)
        assert not t.is_alive(), "the stream outlived the drain"
    finally:
        for p in engine:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
    rc = srv.proc.wait(timeout=120)
    error = str(outcome.get("error"))
    assert "the model is shutting down: the request was aborted after the drain timeout of 2 s" in error, outcome
    assert rc == 0, srv.log_tail()
    assert "draining (tritonserver is stopping)" in srv.log.read_text(errors="replace"), srv.log_tail()
    left = wait_gone(kids, timeout_s=30)
    assert not left, f"left behind: {_names(left)}"

