from __future__ import annotations

import pytest

from llmhost.smoke import Check, parse_sse, render, series_for_model


def test_parse_sse_events_and_errors():
    lines = ['data: {"text_output": "a"}', "", 'data: {"text_output": "b", "num_output_tokens": 2}']
    assert [e["text_output"] for e in parse_sse(lines)] == ["a", "b"]
    with pytest.raises(RuntimeError, match="stream error: boom"):
        parse_sse(['data: {"error": "boom"}'])


def test_series_for_model_reads_raw_names():
    text = (
        "# TYPE vllm:x_bucket counter\n"
        'vllm:x_bucket{le="+Inf",model="tiny",version="1"} 3\n'
        'nv_inference_request_success{model="tiny",version="1"} 7\n'
        'vllm:y{model="other",version="1"} 1\n'
        "nv_cpu_utilization 0.5\n"
    )
    assert series_for_model(text, "tiny") == {"vllm:x_bucket", "nv_inference_request_success"}


def test_render_names_failures():
    out = render([Check("generate", True, "16 tokens", 0.1), Check("metrics", False, "missing", 0.0)], False)
    assert "FAILED: metrics" in out
    assert '"ok": false' in render([Check("x", False, "d", 0.0)], True)


def test_textfile_metrics(tmp_path):
    from llmhost.smoke import write_textfile

    path = tmp_path / "llmhost_smoke.prom"
    write_textfile([Check("generate", True, "ok", 0.5), Check("metrics", False, "missing", 0.25)], str(path), "tiny")
    text = path.read_text()
    assert 'llmhost_smoke_success{model="tiny"} 0.0' in text
    assert 'llmhost_smoke_check_success{check="generate",model="tiny"} 1.0' in text
    assert 'llmhost_smoke_check_success{check="metrics",model="tiny"} 0.0' in text
    assert 'llmhost_smoke_duration_seconds{model="tiny"} 0.75' in text
    assert "llmhost_smoke_last_run_timestamp_seconds" in text


def test_smoke_cli_against_nothing_fails_and_writes_textfile(tmp_path):
    from llmhost.cli import main
    from tests.harness.net import free_port

    path = tmp_path / "s.prom"
    rc = main(["smoke", "--url", f"http://127.0.0.1:{free_port()}", "--no-grpc", "--model", "m",
               "--timeout", "2", "--textfile", str(path)])
    assert rc == 1
    assert 'llmhost_smoke_check_success{check="server live",model="m"} 0.0' in path.read_text()


def _fake_triton(answer: dict[str, object], metrics: str):  # type: ignore[no-untyped-def]
    """A server answering Triton's health, /generate with ANSWER and /metrics with METRICS."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._send(200, metrics.encode() if self.path == "/metrics" else b"")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.paths.append(self.path)
            self._send(200, json.dumps(answer).encode())

        def log_message(self, *args: object) -> None:
            pass

    Handler.paths = []  # type: ignore[attr-defined]
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, Handler


@pytest.mark.parametrize(("answer", "ok"), [({"embedding": [0.5, -0.25]}, True),
                                            ({"embedding": [0.5, -0.25], "text_output": ""}, True),
                                            ({"embedding": []}, False), ({"embedding": ["x"]}, False)])
def test_an_embedding_model_is_checked_by_its_embedding(answer, ok):
    from llmhost.smoke import Smoke

    metrics = ('vllm:num_requests_running{model="embed",version="1"} 0\n'
               'nv_inference_request_success{model="embed",version="1"} 1\n')
    srv, handler = _fake_triton(answer, metrics)
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        checks = Smoke(url, url, None, "embed", timeout_s=5).run()
    finally:
        srv.shutdown()
    by_name = {c.name: c for c in checks}
    assert by_name["generate"].ok is ok, by_name["generate"]
    if ok:
        assert by_name["generate"].detail == "an embedding of 2 floats"
        # Nothing streamed: an embedding model answers once, and has no token metrics.
        assert list(by_name) == ["server live", "server ready", "model ready", "generate", "metrics"]
        assert by_name["metrics"].ok, by_name["metrics"]
        assert handler.paths == ["/v2/models/embed/generate"]
    else:
        assert "expected an embedding" in by_name["generate"].detail


def test_a_stream_in_one_chunk_is_tried_again_and_fails_only_twice_in_a_row():
    from llmhost.smoke import OneChunkStream, _run, again_if_one_chunk

    answers = iter([OneChunkStream("16 tokens in one event"), "16 events, 16 tokens"])

    def busy_once() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    check = _run("stream", again_if_one_chunk(busy_once))
    assert check.ok and check.detail == "16 events, 16 tokens (the try before: 16 tokens in one event)", check

    def never_streams() -> str:
        raise OneChunkStream("16 tokens in one event")

    check = _run("stream", again_if_one_chunk(never_streams))
    assert not check.ok and check.detail == "OneChunkStream: 16 tokens in one event", check

    def wrong() -> str:
        raise RuntimeError("stream reported 3 tokens, expected 16")

    calls = []
    check = _run("stream", again_if_one_chunk(lambda: calls.append(1) or wrong()))
    assert not check.ok and len(calls) == 1, (check, calls)  # other failures are not tried again
