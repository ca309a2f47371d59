"""`llmhost smoke`: is this endpoint serving? Each check names what failed.

Checks, in order: server live, server ready, model ready, a non-streaming
/generate, a streaming /generate_stream (SSE), a gRPC stream, and the vllm:
metrics on Triton's /metrics. An embedding model (vLLM's pooling runner) answers
/generate with the prompt's embedding: its checks are that embedding and the
metrics every model has (it streams nothing). Used by operators after a deploy, by `make demo`,
by the system tests and (as a timer) by the monitoring stack.
"""

from __future__ import annotations

import json
import queue
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import requests

PROMPT = "def fibonacci(n):"
REQUIRED_METRICS = (
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "nv_inference_request_success",
)
# What an embedding model exports (it generates no tokens).
EMBEDDING_METRICS = ("vllm:num_requests_running", "nv_inference_request_success")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float


class OneChunkStream(RuntimeError):
    """Every token of a stream arrived, but in one chunk. vLLM hands over the steps its
    consumer has not taken yet as one output, so a busy host can answer one stream so."""


def again_if_one_chunk(check: Callable[[], str]) -> Callable[[], str]:
    """CHECK, and once more if it got its whole answer in one chunk: only two such
    answers in a row fail it (a stream that never streams)."""

    def checked() -> str:
        try:
            return check()
        except OneChunkStream as first:
            return f"{check()} (the try before: {first})"

    return checked


def _run(name: str, fn: Callable[[], str]) -> Check:
    t0 = time.perf_counter()
    try:
        detail = fn()
        ok = True
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row
        detail, ok = f"{type(exc).__name__}: {exc}", False
    return Check(name, ok, detail, time.perf_counter() - t0)


_SERIES = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s')


def series_for_model(exposition: str, model: str) -> set[str]:
    """Series names (as Prometheus stores them) whose model label is ``model``."""
    names = set()
    for line in exposition.splitlines():
        m = _SERIES.match(line)
        if m and f'model="{model}"' in (m.group(2) or ""):
            names.add(m.group(1))
    return names


def parse_sse(lines: list[str]) -> list[dict[str, Any]]:
    """Triton's /generate_stream events: 'data: {json}' lines."""
    events = []
    for line in lines:
        if line.startswith("data:"):
            payload = json.loads(line[5:].strip())
            if "error" in payload:
                raise RuntimeError(f"stream error: {payload['error']}")
            events.append(payload)
    return events


class Smoke:
    def __init__(self, url: str, metrics_url: str | None, grpc_url: str | None, model: str,
                 max_tokens: int = 16, timeout_s: float = 60) -> None:
        self.url = url.rstrip("/")
        self.metrics_url = metrics_url.rstrip("/") if metrics_url else None
        self.grpc_url = grpc_url
        self.model = model
        self.max_tokens = max_tokens
        self.timeout = timeout_s
        self.embedding = False  # the model answered with an embedding (a pooling model)

    def _get_ok(self, path: str) -> str:
        r = requests.get(f"{self.url}{path}", timeout=self.timeout)
        if r.status_code != 200:
            raise RuntimeError(f"GET {path} -> HTTP {r.status_code} {r.text[:200]}")
        return f"HTTP {r.status_code}"

    def generate(self) -> str:
        body = {"text_input": PROMPT, "max_tokens": self.max_tokens, "ignore_eos": True,
                "return_num_output_tokens": True, "exclude_input_in_output": True}
        r = requests.post(f"{self.url}/v2/models/{self.model}/generate", json=body, timeout=self.timeout)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        data = r.json()
        if "error" in data:
            raise RuntimeError(data["error"])
        if "embedding" in data and not data.get("text_output"):  # the backend also sends an empty text
            vector = data["embedding"]
            if not isinstance(vector, list) or not vector or not all(isinstance(v, float) for v in vector):
                raise RuntimeError(f"expected an embedding (a list of floats), got {data!r:.200}")
            self.embedding = True
            return f"an embedding of {len(vector)} floats"
        n = int(data["num_output_tokens"])
        if n != self.max_tokens or not data.get("text_output"):
            raise RuntimeError(f"expected {self.max_tokens} tokens and text, got {n} tokens, {data!r:.200}")
        return f"{n} tokens"

    def generate_stream(self) -> str:
        body = {"text_input": PROMPT, "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True,
                "return_num_output_tokens": True}
        with requests.post(f"{self.url}/v2/models/{self.model}/generate_stream", json=body,
                           timeout=self.timeout, stream=True) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            events = parse_sse([ln for ln in r.iter_lines(decode_unicode=True) if ln])
        if not events:
            raise RuntimeError("expected a stream of events, got none")
        total = sum(int(e["num_output_tokens"]) for e in events)  # each response counts its own tokens
        if total != self.max_tokens:
            raise RuntimeError(f"stream reported {total} tokens, expected {self.max_tokens}")
        if len(events) < 2:
            raise OneChunkStream(f"{total} tokens in one event")
        return f"{len(events)} events, {total} tokens"

    def grpc_stream(self) -> str:
        import numpy as np
        import tritonclient.grpc as grpcclient

        assert self.grpc_url is not None
        results: queue.Queue[Any] = queue.Queue()
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            inputs = []
            for name, value, dtype in (("text_input", PROMPT.encode(), "BYTES"), ("stream", True, "BOOL"),
                                       ("return_num_output_tokens", True, "BOOL")):
                t = grpcclient.InferInput(name, [1], dtype)
                t.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else np.bool_))
                inputs.append(t)
            params = json.dumps({"max_tokens": self.max_tokens, "ignore_eos": True})
            p = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
            p.set_data_from_numpy(np.array([params.encode()], dtype=np.object_))
            inputs.append(p)
            client.async_stream_infer(self.model, inputs, request_id="smoke", enable_empty_final_response=True)
            chunks, total = 0, 0
            deadline = time.monotonic() + self.timeout
            while True:
                result, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
                if error is not None:
                    raise RuntimeError(f"gRPC stream error: {error}")
                resp = result.get_response()
                if result.as_numpy("num_output_tokens") is not None:
                    total += int(result.as_numpy("num_output_tokens")[0])  # per response
                    chunks += 1
                if resp.parameters.get("triton_final_response") and resp.parameters["triton_final_response"].bool_param:
                    break
        finally:
            client.stop_stream()
            client.close()
        if total != self.max_tokens or chunks < 1:
            raise RuntimeError(f"gRPC stream gave {chunks} chunks, {total} tokens; expected {self.max_tokens}")
        if chunks < 2:
            raise OneChunkStream(f"gRPC stream gave its {total} tokens in one chunk")
        return f"{chunks} chunks, {total} tokens"

    def metrics(self) -> str:
        assert self.metrics_url is not None
        r = requests.get(f"{self.metrics_url}/metrics", timeout=self.timeout)
        r.raise_for_status()
        names = series_for_model(r.text, self.model)
        missing = [m for m in (EMBEDDING_METRICS if self.embedding else REQUIRED_METRICS) if m not in names]
        if missing:
            raise RuntimeError(f"missing on /metrics: {', '.join(missing)}")
        return f"{sum(1 for n in names if n.startswith('vllm:'))} vllm: series"

    def run(self) -> list[Check]:
        checks = [
            _run("server live", lambda: self._get_ok("/v2/health/live")),
            _run("server ready", lambda: self._get_ok("/v2/health/ready")),
            _run("model ready", lambda: self._get_ok(f"/v2/models/{self.model}/ready")),
        ]
        if not checks[-1].ok:
            return checks
        checks.append(_run("generate", self.generate))
        if not self.embedding:
            checks.append(_run("generate_stream (SSE)", again_if_one_chunk(self.generate_stream)))
        if self.grpc_url and not self.embedding:
            checks.append(_run("gRPC stream", again_if_one_chunk(self.grpc_stream)))
        if self.metrics_url:
            # Metrics are pushed to Triton about once a second.
            time.sleep(1.5)
            checks.append(_run("metrics", self.metrics))
        return checks


def write_textfile(checks: list[Check], path: str, model: str) -> None:
    """The probe's result as node_exporter textfile-collector metrics (atomic write)."""
    from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

    reg = CollectorRegistry()
    ok = Gauge("llmhost_smoke_success", "1 if every smoke check passed.", ["model"], registry=reg)
    per = Gauge("llmhost_smoke_check_success", "1 if this smoke check passed.", ["model", "check"], registry=reg)
    took = Gauge("llmhost_smoke_duration_seconds", "Time the whole smoke probe took.", ["model"], registry=reg)
    last = Gauge("llmhost_smoke_last_run_timestamp_seconds", "When the smoke probe last ran.", ["model"],
                 registry=reg)
    ok.labels(model).set(1 if checks and all(c.ok for c in checks) else 0)
    for c in checks:
        per.labels(model, c.name).set(1 if c.ok else 0)
    took.labels(model).set(sum(c.seconds for c in checks))
    last.labels(model).set(time.time())
    write_to_textfile(path, reg)


def render(checks: list[Check], as_json: bool) -> str:
    if as_json:
        return json.dumps({"ok": all(c.ok for c in checks), "checks": [asdict(c) for c in checks]}, indent=2)
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  result  time    detail"]
    for c in checks:
        lines.append(f"{c.name:<{width}}  {'ok' if c.ok else 'FAIL':<6}  {c.seconds:5.2f}s  {c.detail}")
    failed = [c.name for c in checks if not c.ok]
    lines.append("all checks passed" if not failed else f"FAILED: {', '.join(failed)}")
    return "\n".join(lines)
