"""The backend's metrics against NVIDIA vllm_backend's contract, on one real server
(explicit model control, so that models with other config.pbtxt parameters can be
loaded beside the served one; the server tests/e2e/test_model_control.py uses after
this module, from tests/e2e/conftest.py):

- vllm_backend's series are there, named as it names them, with the labels
  ``model`` and ``version`` and its histogram boundaries;
- with the model setting ``fresh_metrics`` (off by default), they are current once
  a response has been sent: /metrics read right after a response counts that
  response's prompt and generated tokens (HTTP, SSE stream, and a request with n=2);
- REPORT_CUSTOM_METRICS absent, or model.json's disable_log_stats true, means no
  ``vllm:`` series for that model at all.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import psutil
import pytest
import requests

from tests.e2e._client import generate, stream
from tests.e2e._servers import ExplicitServers
from tests.harness import repository as repo
from tests.harness.server import Server, start_server, wait_gone

PROMPT = "The capital of France is"
# vllm_backend's metric families (src/utils/metrics.py) and, for histograms, its bucket boundaries.
VLLM_BACKEND_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
VLLM_BACKEND_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                         2.5, 5.0, 7.5, 10.0),
    "vllm:time_per_output_token_seconds": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
    "vllm:e2e_request_latency_seconds": (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    "vllm:request_prompt_tokens": (1, 2, 5, 10, 20, 50, 100, 200, 500),  # 1-2-5 up to max_model_len (512)
    "vllm:request_generation_tokens": (1, 2, 5, 10, 20, 50, 100, 200, 500),
    "vllm:request_params_n": (1, 2, 5, 10, 20),
}
LINE = re.compile(r"^(vllm:[^{ ]+)\{([^}]*)\} (\S+)$")


@pytest.fixture(scope="module")
def server(explicit_servers: ExplicitServers) -> Server:
    """The shared explicit-model-control server, with the model setting fresh_metrics
    (tests/e2e/conftest.py stops it, checking that nothing is left, unless
    tests/e2e/test_model_control.py's last test has)."""
    return explicit_servers.get().server


def series(server: Server) -> list[tuple[str, dict[str, str], float]]:
    """Every vllm: sample on /metrics: (name, labels, value)."""
    out = []
    for line in requests.get(f"{server.metrics}/metrics", timeout=10).text.splitlines():
        m = LINE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def snapshot(server: Server, model: str) -> dict[str, float]:
    """Counters and histogram _sum/_count of MODEL by name (buckets left out)."""
    out: dict[str, float] = {}
    for name, labels, value in series(server):
        if labels.get("model") == model and "le" not in labels and "finished_reason" not in labels \
                and "reason" not in labels:
            out[name] = out.get(name, 0.0) + value
    return out


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def test_vllm_backend_series_are_there_with_its_labels_and_buckets(server: Server):
    r = generate(server, text_input=PROMPT, max_tokens=4)
    assert r["_status"] == 200, r
    samples = [(n, lb) for n, lb, _ in series(server) if lb.get("model") == server.name]
    names = {n for n, _ in samples}
    for name in VLLM_BACKEND_COUNTERS:
        assert name in names, name
    for name, bounds in VLLM_BACKEND_HISTOGRAMS.items():
        assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= names, name
        les = {float(lb["le"]) for n, lb in samples if n == f"{name}_bucket" and lb["le"] != "+Inf"}
        assert set(bounds) <= les, (name, sorted(set(bounds) - les))
    assert all(lb.get("version") == "1" for _, lb in samples)


def test_a_response_is_counted_by_the_time_it_arrives(server: Server):
    """Read /metrics right after each response: no wait for a push interval."""
    before = snapshot(server, server.name)
    r = generate(server, text_input=PROMPT, max_tokens=9, ignore_eos=True, return_num_input_tokens=True,
                 return_num_output_tokens=True)
    after = snapshot(server, server.name)
    assert r["_status"] == 200, r
    prompt_len, out_len = r["num_input_tokens"], r["num_output_tokens"]
    assert out_len == 9
    d = grew(before, after)
    assert d["vllm:prompt_tokens_total"] == prompt_len
    assert d["vllm:generation_tokens_total"] == out_len
    assert d["vllm:request_prompt_tokens_sum"] == prompt_len and d["vllm:request_prompt_tokens_count"] == 1
    assert d["vllm:request_generation_tokens_sum"] == out_len
    assert d["vllm:e2e_request_latency_seconds_count"] == 1 and d["vllm:time_to_first_token_seconds_count"] == 1
    assert d["vllm:time_per_output_token_seconds_count"] == out_len - 1
    assert d["vllm:inter_token_latency_seconds_count"] == out_len - 1
    assert d["vllm:request_params_n_count"] == 1 and d["vllm:request_params_n_sum"] == 1

    before = after
    events = stream(server, text_input=PROMPT, max_tokens=11, ignore_eos=True)
    after = snapshot(server, server.name)
    assert events and "error" not in events[-1], events[-1:]
    d = grew(before, after)
    assert d["vllm:prompt_tokens_total"] == prompt_len and d["vllm:generation_tokens_total"] == 11

    before = after
    r = generate(server, text_input=PROMPT, max_tokens=5, ignore_eos=True, n=2, temperature=1.0)
    after = snapshot(server, server.name)
    assert r["_status"] == 200, r
    d = grew(before, after)
    assert d["vllm:generation_tokens_total"] == 10
    assert d["vllm:request_params_n_count"] == 1 and d["vllm:request_params_n_sum"] == 2

    # A stop string: vLLM aborts the request between handing out its last output and
    # recording that step's statistics; the response still leaves counted.
    body = {"text_input": PROMPT, "max_tokens": 40, "ignore_eos": True, "temperature": 1.0, "seed": 3,
            "exclude_input_in_output": True}
    full = generate(server, **body)["text_output"]
    # A piece of the output whose first occurrence is well inside it.
    stop = next(full[k:k + 3] for k in range(5, len(full) - 3) if full.index(full[k:k + 3]) == k)
    before = snapshot(server, server.name)
    r = generate(server, stop=stop, return_num_output_tokens=True, return_finish_reason=True, **body)
    after = snapshot(server, server.name)
    assert r["_status"] == 200, r
    assert r["finish_reason"] == "stop" and r["num_output_tokens"] < 40, (stop, r)
    assert grew(before, after)["vllm:generation_tokens_total"] == r["num_output_tokens"]
    assert "metrics lag" not in server.log.read_text(errors="replace")


def test_report_custom_metrics_and_disable_log_stats_gate_every_series(server: Server):
    """As vllm_backend: no REPORT_CUSTOM_METRICS parameter, or disable_log_stats true
    in model.json (with the parameter "true"), and the model exports no vllm: series."""
    models = {
        "tiny_unreported": {"params": {}, "engine_args": None},
        "tiny_nostats": {"params": {"REPORT_CUSTOM_METRICS": "true"}, "engine_args": {"disable_log_stats": True}},
    }
    for name, spec in models.items():
        repo.add_model(server, name, params=spec["params"], engine_args=spec["engine_args"])
        r = repo.load(server, name)
        assert r.status_code == 200, r.text
    try:
        for name in models:
            other = dataclasses.replace(server, name=name)
            out = generate(other, text_input=PROMPT, max_tokens=6, ignore_eos=True)
            assert out["_status"] == 200, out
            ours = [n for n, lb, _ in series(server) if lb.get("model") == name]
            assert ours == [], (name, sorted(set(ours))[:10])
        # The served model (REPORT_CUSTOM_METRICS "true" from our template) still reports.
        assert snapshot(server, server.name).get("vllm:generation_tokens_total", 0) > 0
        log = server.log.read_text(errors="replace")
        assert log.count("metrics off, health check off") >= 2, "the load log line should say metrics are off"
    finally:
        for name in models:
            repo.unload(server, name)


def _listening_ports(srv: Server) -> set[int]:
    ports = set()
    for proc in srv.descendants():
        try:
            ports |= {c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    return ports


def test_a_server_with_metrics_off_still_loads_and_serves(tiny_model: Path, tmp_path: Path):
    """tritonserver --allow-metrics=false: the model loads and answers (vllm_backend
    goes on without metrics too); nothing of the server listens on the metrics port. (Triton 2.51
    takes the metric calls and drops them; a Triton that refuses them gets the
    backend's "metrics off" path.)"""
    srv = start_server(tiny_model, tmp_path / "serve", extra=["--triton-arg=--allow-metrics=false"])
    try:
        r = generate(srv, text_input=PROMPT, max_tokens=4)
        assert r["_status"] == 200, r
        assert "pushing metrics failed" not in srv.log.read_text(errors="replace")
        # Nothing of this server listens on its metrics port (asked of the processes, not
        # by connecting: another process may have taken the free port meanwhile), while
        # its HTTP port is listened on.
        listening = _listening_ports(srv)
        assert int(srv.http.rsplit(":", 1)[1]) in listening, listening
        assert int(srv.metrics.rsplit(":", 1)[1]) not in listening, listening
    finally:
        kids = srv.descendants()
        srv.stop()
        assert not wait_gone(kids), "processes left after SIGTERM"
