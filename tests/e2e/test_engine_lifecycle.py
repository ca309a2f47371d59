"""The engine's lifecycle with a real `llmhost serve`: an engine that cannot start
fails the load quickly, naming the cause (the ImportError case: tests/unit); a
vLLM EngineCore killed while a stream is in flight ends that stream with a clear
error, the model stops answering ready, new requests get an error or a refused
connection (never a hang), and `llmhost serve` restarts tritonserver, which
serves again, with nothing of the old generation left (processes, /dev/shm). A
stopped (SIGSTOP) EngineCore, a hung engine, is noticed after engine_hang_timeout_s
the same way, and counted on /metrics."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import requests

from llmhost.smoke import parse_sse
from tests.harness.repository import leftover_segments, mapped_segments
from tests.harness.server import READY_TIMEOUT_S, Server, process_name, start_server, wait_gone

# Bounds that tell an answer from a hang; not speed targets.
NOTICE_BOUND_S = 60
REQUEST_TIMEOUT_S = 60
STREAM_TOKENS = 450  # the e2e server's max_model_len is 512


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _serve_log(workdir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(workdir.rglob("serve.log")))


def _start_failing(model: Path, workdir: Path) -> tuple[str, float]:
    """Start a server that must fail; returns its log and how long it took."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="llmhost serve exited with"):
        srv = start_server(model, workdir, extra=["--max-restarts", "0"])
        srv.stop()  # it served: stopped the way that leaves nothing behind
    return _serve_log(workdir), time.monotonic() - t0


# -- a failing start ------------------------------------------------------------------


def test_config_that_vllm_rejects_fails_the_load_naming_it(tiny_model: Path, tmp_path: Path):
    model = tmp_path / "unsupported"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    before = _shm()
    log, took_s = _start_failing(model, tmp_path / "serve")
    # The load error Triton reports names the cause (the stub's log has the traceback).
    load_errors = [line for line in log.splitlines() if "failed to load 'tiny' version" in line]
    assert load_errors, log[-4000:]
    assert "vLLM's engine did not start: ValidationError" in load_errors[0], load_errors
    assert "Model architectures ['NoSuchModelForCausalLM'] are not supported" in load_errors[0], load_errors
    assert "Traceback (most recent call last)" in log
    assert "not restarting it" in log
    # Ours, or mapped by no live process: another worker's segments come and go meanwhile.
    assert not leftover_segments(before), "shared memory left after a failed start"
    print(f"\nunsupported architecture: the load failed after {took_s:.1f} s (serve started to exit)")


# -- the EngineCore killed mid-stream -------------------------------------------------------


@dataclass
class _Stream:
    events: list[dict] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    ended_at: float = 0.0


def _stream(srv: Server, out: _Stream) -> None:
    body = {"text_input": "def main():", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
    try:
        with requests.post(f"{srv.http}/v2/models/{srv.name}/generate_stream", json=body, stream=True,
                           timeout=REQUEST_TIMEOUT_S) as r:
            for line in r.iter_lines(chunk_size=1, decode_unicode=True):
                if line:
                    out.events.extend(parse_sse([line]))
                    out.started.set()
    except (requests.RequestException, RuntimeError) as exc:  # RuntimeError: an SSE error event
        out.error = str(exc)
    out.ended_at = time.monotonic()
    out.started.set()


def _generation(srv: Server) -> list[psutil.Process]:
    return [p for p in srv.descendants() if p.is_running()]


def _serves_again(srv: Server, old: list[psutil.Process]) -> float:
    """Wait until serve's new tritonserver is ready and answers, with no process of the
    OLD generation left; returns when it was first ready (time.monotonic())."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not srv.model_ready() and time.monotonic() < deadline:
        assert srv.proc.poll() is None, srv.log_tail()
        time.sleep(1)
    assert srv.model_ready(), srv.log_tail()
    ready_at = time.monotonic()
    r = requests.post(f"{srv.http}/v2/models/{srv.name}/generate", json={"text_input": "hi", "max_tokens": 4},
                      timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200 and "text_output" in r.json(), r.text
    left = wait_gone(old, timeout_s=30)
    assert not left, f"processes of the old generation left: {[process_name(p) for p in left]}"
    return ready_at


def test_engine_core_killed_mid_stream_fails_clearly_then_serve_restarts(tiny_model: Path, tmp_path: Path):
    shm_before_start = _shm()
    srv = start_server(tiny_model, tmp_path)
    try:
        old = _generation(srv)
        engine = [p for p in old if "EngineCore" in process_name(p)]
        assert len(engine) == 1, [process_name(p) for p in old]
        old_shm = _shm() - shm_before_start
        stream = _Stream()
        client = threading.Thread(target=_stream, args=(srv, stream))
        client.start()
        assert stream.started.wait(REQUEST_TIMEOUT_S) and stream.events, stream.error

        t0 = time.monotonic()
        engine[0].send_signal(signal.SIGKILL)
        client.join(NOTICE_BOUND_S)
        assert not client.is_alive(), "the stream in flight hung after the EngineCore died"
        notice_s = stream.ended_at - t0
        if stream.error is None or "the model's engine stopped" not in stream.error:
            time.sleep(5)  # then the server's log says how the old tritonserver ended
            pytest.fail(f"the stream ended {notice_s:.1f} s after the kill with {stream.error!r}, not the "
                        f"engine-stopped error; the server's log:\n{srv.log_tail(150)}")
        assert "killed by SIGKILL" in stream.error and "restarting" in stream.error, stream.error
        assert "Traceback" not in stream.error and "/" not in stream.error.split("stopped", 1)[1], stream.error

        # Not ready any more, and a new request is answered with an error or refused.
        deadline = time.monotonic() + NOTICE_BOUND_S
        while srv.model_ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not srv.model_ready(), "the model still answers ready after its engine died"
        not_ready_s = time.monotonic() - t0
        try:
            r = requests.post(f"{srv.http}/v2/models/{srv.name}/generate",
                              json={"text_input": "hi", "max_tokens": 4}, timeout=REQUEST_TIMEOUT_S)
            answer = f"HTTP {r.status_code}: {r.text}"
            assert r.status_code >= 400 and "error" in r.json(), answer
        except requests.ConnectionError as exc:
            answer = f"refused: {type(exc).__name__}"
        # (requests.Timeout, a hang, fails the test)

        # Serves again, with nothing of the old generation left.
        ready_s = _serves_again(srv, old) - t0
        # Still mapped by a live process: another server's (another test worker's), not a leak.
        leaked = (old_shm & _shm()) - mapped_segments()
        assert not leaked, f"/dev/shm segments of the old generation left: {leaked}"
        log = srv.log_tail(400)
        assert re.search(r"vLLM's engine died: EngineCore\S* was killed by SIGKILL", log), log
        assert "without being asked to stop" in log and "restarting it" in log, log
        print(f"\nEngineCore SIGKILL: stream failed after {notice_s:.1f} s ({stream.error!r}); not ready after "
              f"{not_ready_s:.1f} s; a new request got {answer[:200]!r}; ready again after {ready_s:.1f} s; "
              f"{len(old)} processes and {len(old_shm)} shm segments of the old generation, none left")
    finally:
        kids = srv.descendants()
        srv.stop()
        assert not wait_gone(kids), "processes left after SIGTERM"


# -- the EngineCore hung (stopped) mid-stream ----------------------------------------------

HANG_TIMEOUT_S = 5
HANGS = "llmhost:engine_hangs_total"


def test_engine_core_hung_mid_stream_fails_clearly_counts_it_then_serve_restarts(tiny_model: Path, tmp_path: Path):
    srv = start_server(tiny_model, tmp_path, extra=["--setting", f"engine_hang_timeout_s={HANG_TIMEOUT_S}"])
    engine: list[psutil.Process] = []
    try:
        old = _generation(srv)
        engine = [p for p in old if "EngineCore" in process_name(p)]
        assert len(engine) == 1, [process_name(p) for p in old]
        assert srv.metric(HANGS) == 0
        stream = _Stream()
        client = threading.Thread(target=_stream, args=(srv, stream))
        client.start()
        assert stream.started.wait(REQUEST_TIMEOUT_S) and stream.events, stream.error

        t0 = time.monotonic()
        engine[0].send_signal(signal.SIGSTOP)
        client.join(NOTICE_BOUND_S)
        assert not client.is_alive(), "the stream in flight hung with its engine"
        notice_s = stream.ended_at - t0
        hung = f"the model's engine stopped (it made no progress for {HANG_TIMEOUT_S} s with 1 request in flight)"
        if stream.error is None or hung not in stream.error:
            pytest.fail(f"the stream ended {notice_s:.1f} s after the SIGSTOP with {stream.error!r} (its last "
                        f"event: {stream.events[-1:]}), not the hung-engine error; the server's log:\n"
                        f"{srv.log_tail(150)}")
        assert "restarting" in stream.error, stream.error
        assert "Traceback" not in stream.error, stream.error

        deadline = time.monotonic() + NOTICE_BOUND_S
        while srv.model_ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not srv.model_ready(), "the model still answers ready after its engine hung"
        not_ready_s = time.monotonic() - t0

        ready_s = _serves_again(srv, old) - t0
        # The restarted server goes on counting from the hang kept in serve's state folder.
        assert srv.metric(HANGS) == 1, srv.log_tail(100)
        assert srv.engine_sockets is not None
        kept = [p.read_text() for p in (srv.engine_sockets.parent / "state").rglob("*.engine_hangs")]
        assert kept == ["1\n"], kept
        log = srv.log_tail(400)
        assert f"vLLM's engine hung: it made no progress for {HANG_TIMEOUT_S} s with 1 request in flight" in log, log
        print(f"\nEngineCore SIGSTOP: stream failed after {notice_s:.1f} s ({stream.error!r}); not ready after "
              f"{not_ready_s:.1f} s; ready again after {ready_s:.1f} s")
    finally:
        for p in engine:  # a stopped process ignores SIGTERM until it runs again
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        kids = srv.descendants()
        srv.stop()
        assert not wait_gone(kids), "processes left after SIGTERM"
