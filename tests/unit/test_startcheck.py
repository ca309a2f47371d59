"""A start that never answers is failed (llmhost.server.startcheck, the unit's
ExecStartPost) and restarted by `llmhost serve`; one that answers, or answers with a
model that failed to load, is not. Against real processes on loopback ports: a
server that answers like Triton's health API, and one that accepts connections and
never answers (what a tritonserver stuck in a model's load looks like: its port is
not even open; a silent one is the harder case)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmhost.server import startcheck
from tests.harness.net import free_port

# Answers GET /v2/health/live with 200 and /v2/models/<name>/ready with MODEL_STATUS.
ANSWERING = r"""
import http.server, sys
port, model_status = int(sys.argv[1]), int(sys.argv[2])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code = 200 if self.path == "/v2/health/live" else model_status if self.path.endswith("/ready") else 404
        self.send_response(code); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""

# Accepts connections and never answers.
SILENT = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(64)
kept = []
while True:
    kept.append(s.accept()[0])
"""


def _spawn(script: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", script, *args])


def _listening(port: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_an_answering_server_passes_at_once(procs):
    port = free_port()
    procs.append(_spawn(ANSWERING, str(port), "200"))
    _listening(port)
    t0 = time.monotonic()
    assert startcheck.main(["--url", f"http://127.0.0.1:{port}", "--timeout-s", "30"]) == 0
    assert time.monotonic() - t0 < 25


def test_a_server_that_answers_only_later_passes_once_it_answers(procs):
    port = free_port()
    calls = []

    def probe(url: str) -> bool:
        """Nothing listens for the first two polls; the server starts at the third."""
        calls.append(url)
        if len(calls) == 3:
            procs.append(_spawn(ANSWERING, str(port), "200"))
            _listening(port)
        return startcheck.answers(url)

    assert startcheck.wait_until_answering(f"http://127.0.0.1:{port}", 60, poll_s=0.2, probe=probe)
    assert len(calls) >= 3


@pytest.mark.parametrize("kind", ["silent", "closed"])
def test_a_server_that_never_answers_fails_naming_the_bound(procs, capsys, kind):
    port = free_port()
    if kind == "silent":
        procs.append(_spawn(SILENT, str(port)))
        _listening(port)
    assert startcheck.main(["--url", f"http://127.0.0.1:{port}", "--timeout-s", "3"]) == 1
    err = capsys.readouterr().err
    assert "did not answer" in err and "within 3 s" in err and "triton_service_ready_timeout_s" in err, err


def test_the_bound_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exc:
        startcheck.main(["--url", "http://127.0.0.1:9", "--timeout-s", "0"])
    assert exc.value.code == 2 and "--timeout-s must be > 0" in capsys.readouterr().err


# -- a start whose model instances all initialised, and that still does not answer ------

def _repository(root: Path, **models: dict) -> Path:
    """A model repository with each model's config.pbtxt from the package's template."""
    from llmhost.server.layout import render

    for name, entry in models.items():
        (root / "models" / name).mkdir(parents=True)
        (root / "models" / name / "config.pbtxt").write_text(render("config.pbtxt.j2", model={"name": name, **entry}))
    return root / "models"


def _open_socket(directory: Path, model: str, instance: str) -> socket.socket:
    """An engine socket as the backend opens one (llmhost.backend.stream_socket.socket_path)."""
    (directory / model).mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(directory / model / f"1-{instance}.sock"))
    s.listen(1)
    return s


def test_the_instances_each_model_asks_for_come_from_its_config(tmp_path):
    repo = _repository(tmp_path, cpu={}, two={"instance_count": 2},
                       gpus={"instance_count": 2, "kind": "KIND_GPU", "gpus": [0, 1, 2]})
    assert startcheck.expected_instances(repo) == {"cpu": 1, "gpus": 6, "two": 2}
    # What is not one instance group read so gives no expectation: only the bound applies.
    (repo / "two" / "config.pbtxt").write_text('name: "two"\nbackend: "vllm"\n')
    assert startcheck.expected_instances(repo) is None
    (repo / "two" / "config.pbtxt").write_text('instance_group [ { count: 1 kind: KIND_CPU } ]\n')
    assert startcheck.expected_instances(repo) is None  # on one line: not read so
    assert startcheck.expected_instances(tmp_path / "empty") is None


def test_initialised_once_every_instance_opened_its_socket_in_this_start(tmp_path):
    repo = _repository(tmp_path, a={"instance_count": 2}, b={})
    expected = startcheck.expected_instances(repo)
    engine = tmp_path / "engine"
    kept = [_open_socket(engine, "b", "b_0")]  # left from an earlier start
    since = time.time() + 0.05
    time.sleep(0.1)
    try:
        assert startcheck.initialised_at(engine, expected, since) is None
        kept.append(_open_socket(engine, "a", "a_0"))
        kept.append(_open_socket(engine, "a", "a_1"))
        assert startcheck.initialised_at(engine, expected, since) is None  # b's socket is older than the start
        (engine / "b" / "1-b_0.sock").unlink()
        kept.append(_open_socket(engine, "b", "b_0"))
        done = startcheck.initialised_at(engine, expected, since)
        assert done is not None and since <= done <= time.time()
    finally:
        for k in kept:
            k.close()


def test_a_silent_server_whose_instances_all_initialised_fails_before_the_bound(procs, capsys, tmp_path,
                                                                                monkeypatch):
    port = free_port()
    procs.append(_spawn(SILENT, str(port)))
    _listening(port)
    repo = _repository(tmp_path, tiny={})
    engine = tmp_path / "engine"
    monkeypatch.setenv(startcheck.SOCKET_DIR_ENV, str(engine))
    opened: list[socket.socket] = []
    timer = threading.Timer(1.0, lambda: opened.append(_open_socket(engine, "tiny", "tiny_0")))
    timer.start()
    try:
        rc = startcheck.main(["--url", f"http://127.0.0.1:{port}", "--timeout-s", "120", "--repository", str(repo),
                              "--stuck-after-s", "2"])
    finally:
        timer.cancel()
        for s in opened:
            s.close()
    assert rc == 1
    err = capsys.readouterr().err
    assert "every model instance initialised" in err and "taken as a start that hangs" in err, err


def test_a_server_still_initialising_waits_for_the_bound(procs, capsys, tmp_path, monkeypatch):
    """One instance of two opened its socket: nothing says the start is stuck yet."""
    port = free_port()
    procs.append(_spawn(SILENT, str(port)))
    _listening(port)
    repo = _repository(tmp_path, tiny={"instance_count": 2})
    engine = tmp_path / "engine"
    monkeypatch.setenv(startcheck.SOCKET_DIR_ENV, str(engine))
    since = time.time()
    opened = _open_socket(engine, "tiny", "tiny_0")
    try:
        assert startcheck.initialised_at(engine, startcheck.expected_instances(repo), since) is None
        rc = startcheck.main(["--url", f"http://127.0.0.1:{port}", "--timeout-s", "4", "--repository", str(repo),
                              "--stuck-after-s", "1"])
    finally:
        opened.close()
    assert rc == 1
    err = capsys.readouterr().err
    assert "within 4 s" in err and "every model instance initialised" not in err, err


# `llmhost serve`'s loop with a stand-in for tritonserver: the first start never answers
# (it only sleeps), the next answers like a served model. The real run() (its signal
# handling, restart limit, leftovers reaping), only prepare() replaced.
SERVE = r"""
import sys
from pathlib import Path
from llmhost.server import serve

work, port, first = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
fake = work / "fake_tritonserver.py"
fake.write_text('''
import sys
from pathlib import Path
marker, port, first, answering = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
if first == "hang" and not marker.exists():
    marker.write_text("started once")
    import time
    time.sleep(3600)
if first == "stuck" and not marker.exists():  # the model initialised, the server never opens its port
    marker.write_text("started once")
    import socket, time
    (marker.parent / "engine" / "tiny").mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(marker.parent / "engine" / "tiny" / "1-tiny_0.sock"))
    time.sleep(3600)
if first == "dies-then-aborts":  # served, killed; the next start aborts before it answers; the third serves
    starts = int(marker.read_text()) + 1 if marker.exists() else 1
    marker.write_text(str(starts))
    import os, signal, threading, time
    if starts == 1:
        threading.Thread(target=lambda: (time.sleep(3), os.kill(os.getpid(), signal.SIGKILL)), daemon=True).start()
    elif starts == 2:
        os.abort()
model_status = "400" if first == "model-fails" else "200"
sys.argv = ["answering", port, model_status]
exec(Path(answering).read_text())
''')
answering = work / "answering.py"
answering.write_text(sys.argv[4])
if first == "stuck":  # the repository, as prepare() makes it: one model of one instance
    (work / "models" / "tiny").mkdir(parents=True, exist_ok=True)
    (work / "models" / "tiny" / "config.pbtxt").write_text("instance_group [\n  {\n    count: 1\n  }\n]\n")
serve.prepare = lambda opts: ([sys.executable, str(fake), str(work / "marker"), str(port), first, str(answering)],
                              dict(__import__("os").environ), work)
opts = serve.ServeOptions(model=work, name="tiny", http_port=port)
sys.exit(serve.run(opts, start_timeout_s=120 if first == "stuck" else 3, max_restarts=2, stuck_after_s=2))
"""


def _serve(tmp_path: Path, first: str) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(tmp_path), str(port), first, ANSWERING],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc, port


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return out


def test_serve_kills_a_start_that_never_answers_and_starts_it_again(tmp_path):
    proc, port = _serve(tmp_path, "hang")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not startcheck.answers(f"http://127.0.0.1:{port}"):
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.2)
        assert startcheck.answers(f"http://127.0.0.1:{port}")
        time.sleep(1.5)  # serve's readiness poll is once a second
    finally:
        out = _stop(proc)
    assert (tmp_path / "marker").exists()
    assert "taken as a start that hangs" in out and "did not answer within 3 s; restarting it" in out, out
    assert "llmhost serve: ready." in out, out
    assert proc.returncode == 0, out


def test_serve_kills_a_start_whose_model_initialised_but_that_never_answers(tmp_path):
    proc, port = _serve(tmp_path, "stuck")
    try:
        deadline = time.monotonic() + 100  # under the start's bound (120 s)
        while time.monotonic() < deadline and not startcheck.answers(f"http://127.0.0.1:{port}"):
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.2)
        assert startcheck.answers(f"http://127.0.0.1:{port}")
        time.sleep(1.5)
    finally:
        out = _stop(proc)
    assert "every model instance initialised" in out and "taken as a start that hangs" in out, out
    assert "within 120 s" not in out and "llmhost serve: ready." in out, out
    assert proc.returncode == 0, out


def test_serve_restarts_a_start_that_fails_before_it_is_ready_once_the_server_has_served(tmp_path):
    """Served, killed; its next start aborts before it answers (as Triton's python backend
    can, on a lock a killed stub held): a transient failure, restarted within the limit."""
    proc, port = _serve(tmp_path, "dies-then-aborts")
    marker = tmp_path / "marker"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (
                marker.exists() and marker.read_text() == "3" and startcheck.answers(f"http://127.0.0.1:{port}")):
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.2)
        assert marker.read_text() == "3"
        time.sleep(1.5)  # serve's readiness poll is once a second
    finally:
        out = _stop(proc)
    assert "was killed by SIGKILL; restarting it" in out, out
    assert "was killed by SIGABRT before it was ready (it had served before); restarting it" in out, out
    assert out.count("llmhost serve: ready.") == 2 and "not restarting" not in out, out
    assert proc.returncode == 0, out


def test_serve_does_not_restart_a_server_that_answers_with_a_model_that_failed(tmp_path):
    proc, port = _serve(tmp_path, "model-fails")
    try:
        _listening(port)
        time.sleep(6)  # twice the start timeout
        assert proc.poll() is None, proc.communicate()[0]
    finally:
        out = _stop(proc)
    assert "hangs" not in out and "restarting" not in out and "ready." not in out, out
    assert out.count("starting tritonserver") == 1, out


def test_serve_kills_a_hung_start_and_stops_at_its_restart_limit(tmp_path):
    """Every start hangs (the marker is removed before each): after max_restarts, serve gives up."""
    port = free_port()
    script = SERVE.replace('if first == "hang" and not marker.exists():', 'if first == "hang":')
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(port), "hang", ANSWERING],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    assert out.count("taken as a start that hangs") == 3, out
    assert "not restarting it: 2 restart(s)" in out, out

