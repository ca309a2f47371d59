"""Cancellation, concurrency and metrics under real streaming traffic."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import tritonclient.grpc as grpcclient

from llmhost.backend.metrics import series_names
from tests.e2e._client import stream
from tests.harness.paths import ROOT


def _wait_metric(server, series: str, predicate, timeout_s: float = 20.0, **labels: str) -> float:
    deadline = time.monotonic() + timeout_s
    value = server.metric(series, **labels)
    while not predicate(value) and time.monotonic() < deadline:
        time.sleep(0.5)
        value = server.metric(series, **labels)
    return value


def _wait_log(server, pattern: str, timeout_s: float = 20.0) -> re.Match[str] | None:
    deadline = time.monotonic() + timeout_s
    while True:
        found = re.search(pattern, server.log.read_text(errors="replace"))
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(0.5)


def test_http_disconnect_aborts_engine_request(server):
    cancelled = server.metric("vllm:request_cancelled_total")
    body = {"text_input": "def main():", "max_tokens": 400, "ignore_eos": True, "stream": True}
    r = requests.post(f"{server.http}/v2/models/{server.name}/generate_stream", json=body, stream=True, timeout=60)
    lines = r.iter_lines()
    got = [next(lines) for _ in range(6)]
    assert any(ln.startswith(b"data:") for ln in got)
    # The client goes away a few tokens in, long before the 400th. (Waiting here for
    # the running gauge, pushed once a second, let a fast machine finish the stream
    # first.) The cancelled counter below is only counted for an engine request.
    r.close()
    assert _wait_metric(server, "vllm:num_requests_running", lambda v: v == 0) == 0
    assert _wait_metric(server, "vllm:request_cancelled_total", lambda v: v > cancelled) == cancelled + 1
    # The aborted request must not be counted as a length/stop success of 400 tokens.
    r2 = requests.post(f"{server.http}/v2/models/{server.name}/generate",
                       json={"text_input": "x", "max_tokens": 2}, timeout=60)
    assert r2.status_code == 200


def test_grpc_cancel_aborts_engine_request(server):
    cancelled = server.metric("vllm:request_cancelled_total")
    client = grpcclient.InferenceServerClient(server.grpc)
    got: list[object] = []
    client.start_stream(callback=lambda result, error: got.append(result or error))
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    import numpy as np

    t.set_data_from_numpy(np.array([b"def main():"], dtype=np.object_))
    s = grpcclient.InferInput("stream", [1], "BOOL")
    s.set_data_from_numpy(np.array([True]))
    client.async_stream_infer(server.name, [t, s], parameters={"max_tokens": 400, "ignore_eos": True},
                              request_id="cancel-me-7")
    deadline = time.monotonic() + 30
    while len(got) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(got) >= 5
    client.stop_stream(cancel_requests=True)
    client.close()
    assert _wait_metric(server, "vllm:num_requests_running", lambda v: v == 0) == 0
    assert _wait_metric(server, "vllm:request_cancelled_total", lambda v: v > cancelled) == cancelled + 1
    # The info log (tritonserver's default verbosity) names our id and the client's.
    line = _wait_log(server, r"\[llmhost\] request [0-9a-f]{32} \(client id 'cancel-me-7'\) cancelled: "
                             r"its client went away after (\d+) output token\(s\) sent to it")
    assert line is not None, server.log_tail()
    assert int(line.group(1)) >= 5  # each of the 5 responses seen carried a token at least


def test_32_concurrent_streams_complete_in_order(server):
    def one(i: int) -> list[int]:
        events = stream(server, text_input=f"def f{i}(x):", max_tokens=48, ignore_eos=True,
                        return_num_output_tokens=True)
        return [e["num_output_tokens"] for e in events]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    for counts in results:
        # Each response counts its own tokens: every one carried some, 48 in all.
        assert all(c >= 1 for c in counts[:-1]) and sum(counts) == 48, counts
    assert _wait_metric(server, "vllm:num_requests_running", lambda v: v == 0) == 0


def test_every_documented_metric_is_exported(server):
    stream(server, text_input="def g():", max_tokens=8, ignore_eos=True)
    time.sleep(1.5)
    text = requests.get(f"{server.metrics}/metrics", timeout=10).text
    for name in series_names():
        assert f"\n{name}{{" in text, name
    assert server.metric("vllm:generation_tokens_total") > 0
    assert server.metric("vllm:request_success_total", finished_reason="length") > 0
    assert server.metric("vllm:time_to_first_token_seconds_count") > 0
    readme = (ROOT / "docs" / "monitoring.md").read_text()
    for name in series_names():
        base = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        assert f"`{base}" in readme, f"{base} is not documented in docs/monitoring.md"


def test_smoke_cli_passes(server):
    port = server.http.rsplit(":", 1)[1]
    cmd = [str(Path(sys.executable).parent / "llmhost"), "smoke", "--url", f"http://127.0.0.1:{port}",
           "--metrics-url", server.metrics, "--grpc-url", server.grpc, "--model", server.name, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert [c["name"] for c in report["checks"]] == [
        "server live", "server ready", "model ready", "generate", "generate_stream (SSE)", "gRPC stream", "metrics"]


def test_smoke_cli_fails_naming_the_check(server):
    cmd = [str(Path(sys.executable).parent / "llmhost"), "smoke", "--url", server.http, "--no-grpc",
           "--model", "no-such-model"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "FAILED: model ready" in done.stdout
