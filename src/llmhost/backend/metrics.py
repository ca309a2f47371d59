"""vLLM-style serving metrics, aggregated in the backend and pushed to Triton's /metrics.

Names follow vLLM's own (``vllm:`` prefix) with labels ``model`` and ``version``,
so a vLLM dashboard's queries carry over with ``model_name`` -> ``model``.

Every metric update to Triton is a round trip from the Python stub to the server,
so nothing is sent per token: observations are aggregated here and pushed every
``metrics_interval_s`` as deltas. Histograms are exported in Prometheus' histogram
layout (``_bucket{le=...}``, ``_sum``, ``_count``) as counter families, which is
what ``histogram_quantile()`` reads.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
# vllm:e2e_request_latency_seconds: ours and NVIDIA vllm_backend's boundaries together.
E2E_BUCKETS = tuple(sorted(set(LATENCY_BUCKETS) | {15.0, 30.0, 50.0, 60.0}))
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# The two series vllm_backend exports that vLLM's own server named otherwise, with its boundaries.
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
FAILURE_REASONS = ("invalid_request", "engine_error", "shutting_down", "engine_dead")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # counter | gauge | histogram
    help: str
    buckets: tuple[float, ...] = ()
    label: str | None = None  # one extra label name
    label_values: tuple[str, ...] = ()
    # Labelled with the model instance too (INSTANCE_LABEL): a series of each engine.
    per_instance: bool = False


SPECS: tuple[MetricSpec, ...] = (
    MetricSpec("vllm:prompt_tokens_total", "counter", "Prompt tokens processed."),
    MetricSpec("vllm:generation_tokens_total", "counter", "Generation tokens produced."),
    MetricSpec("vllm:request_success_total", "counter", "Finished requests by finish reason.",
               label="finished_reason", label_values=FINISH_REASONS),
    MetricSpec("vllm:request_cancelled_total", "counter",
               "Requests aborted because the client cancelled or disconnected."),
    MetricSpec("vllm:request_failed_total", "counter", "Requests answered with an error, by reason.",
               label="reason", label_values=FAILURE_REASONS),
    MetricSpec("vllm:num_preemptions_total", "counter", "Requests preempted by the scheduler."),
    MetricSpec("vllm:num_requests_running", "gauge", "Requests in the engine's running batch."),
    MetricSpec("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    MetricSpec("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage, 0 to 1."),
    MetricSpec("vllm:time_to_first_token_seconds", "histogram", "Time to first token.", LATENCY_BUCKETS),
    MetricSpec("vllm:inter_token_latency_seconds", "histogram", "Time between output tokens.", ITL_BUCKETS),
    MetricSpec("vllm:time_per_output_token_seconds", "histogram",
               "Time per output token (vllm_backend's name for the inter-token latency).", TPOT_BUCKETS),
    MetricSpec("vllm:e2e_request_latency_seconds", "histogram", "End-to-end request latency in the engine.",
               E2E_BUCKETS),
    MetricSpec("vllm:request_queue_time_seconds", "histogram", "Time requests spent waiting.", LATENCY_BUCKETS),
    MetricSpec("vllm:request_prefill_time_seconds", "histogram", "Time spent in prefill.", LATENCY_BUCKETS),
    MetricSpec("vllm:request_decode_time_seconds", "histogram", "Time spent in decode.", LATENCY_BUCKETS),
    MetricSpec("vllm:request_prompt_tokens", "histogram", "Prompt length of finished requests.", TOKEN_BUCKETS),
    MetricSpec("vllm:request_generation_tokens", "histogram", "Output length of finished requests.",
               TOKEN_BUCKETS),
    MetricSpec("vllm:request_params_n", "histogram", "The n sampling parameter of requests.", N_BUCKETS),
)
# The label naming the model instance (one engine) of a per-instance series: not
# ``instance``, which Prometheus sets to the scraped target.
INSTANCE_LABEL = "model_instance"
# vLLM's prefix-cache counters, per engine: a fleet's hit rate is the sum of hits over
# the sum of queries; a replica's, its own (what cache-aware routing raises).
SPECS += (
    MetricSpec("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
               per_instance=True),
    MetricSpec("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
               per_instance=True),
)
# The backend's own: how long an engine output waits before its response leaves
# the backend (handed to tritonserver, or written to the engine socket).
RESPONSE_DELAY = "llmhost:response_delay_seconds"
RESPONSE_DELAY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
SPECS += (MetricSpec(RESPONSE_DELAY, "histogram", "Time from an engine output to its response leaving the "
                     "backend (to tritonserver or the engine socket).", RESPONSE_DELAY_BUCKETS),)
# Times the engine held requests and made no progress for engine_hang_timeout_s
# (watchdog.py); each is followed by the restart of the server, which starts the
# series again at 0.
ENGINE_HANGS = "llmhost:engine_hangs_total"
SPECS += (MetricSpec(ENGINE_HANGS, "counter", "Times vLLM's engine made no progress for engine_hang_timeout_s "
                     "with requests in flight; the server then restarts."),)
SPEC_BY_NAME = {s.name: s for s in SPECS}


@dataclass
class _Hist:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # last = +Inf only

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[int]:
        out, run = [], 0
        for c in self.counts:
            run += c
            out.append(run)
        return out


class ServingMetrics:
    """Thread-safe aggregation; ``flush`` hands deltas to an exporter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str | None], float] = {}
        self._gauges: dict[str, float] = {}
        self._hists = {s.name: _Hist(s.buckets) for s in SPECS if s.kind == "histogram"}
        self._sent_counters: dict[tuple[str, str | None], float] = {}
        self._sent_gauges: dict[str, float] = {}
        self._sent_hists: dict[str, tuple[list[int], float]] = {}
        # Generation tokens vLLM's statistics have recorded so far (engine.py waits
        # for them to cover the tokens it has seen before a final response leaves).
        self.generation_recorded = 0

    # -- recording (any thread) --------------------------------------------
    def inc(self, name: str, value: float = 1.0, label: str | None = None) -> None:
        with self._lock:
            key = (name, label)
            self._counters[key] = self._counters.get(key, 0.0) + value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._gauges[name] = value

    def observe(self, name: str, values: Iterable[float]) -> None:
        with self._lock:
            hist = self._hists[name]
            for v in values:
                hist.observe(v)

    def record_scheduler(self, running: int, waiting: int, kv_cache_usage: float, preemptions: int = 0,
                         prefix_queries: int = 0, prefix_hits: int = 0) -> None:
        with self._lock:
            self._gauges["vllm:num_requests_running"] = running
            self._gauges["vllm:num_requests_waiting"] = waiting
            self._gauges["vllm:kv_cache_usage_perc"] = kv_cache_usage
            c = self._counters
            for name, value in (("vllm:prefix_cache_queries_total", prefix_queries),
                                ("vllm:prefix_cache_hits_total", prefix_hits)):
                if value:
                    c[(name, None)] = c.get((name, None), 0.0) + value

    def record_iteration(
        self,
        prompt_tokens: int,
        generation_tokens: int,
        ttfts: Iterable[float],
        itls: Iterable[float],
        preempted: int,
        finished: Iterable[dict[str, Any]],
        n_params: Iterable[int] = (),
    ) -> None:
        """One engine step's statistics; ``finished`` items carry finish_reason,
        e2e_latency, queued_time, prefill_time, decode_time, num_prompt_tokens,
        num_generation_tokens; ``n_params`` is the ``n`` of each request that
        started this step."""
        with self._lock:
            c = self._counters
            c[("vllm:prompt_tokens_total", None)] = c.get(("vllm:prompt_tokens_total", None), 0.0) + prompt_tokens
            key = ("vllm:generation_tokens_total", None)
            c[key] = c.get(key, 0.0) + generation_tokens
            self.generation_recorded += generation_tokens
            if preempted:
                key = ("vllm:num_preemptions_total", None)
                c[key] = c.get(key, 0.0) + preempted
            h = self._hists
            for v in ttfts:
                h["vllm:time_to_first_token_seconds"].observe(v)
            for v in itls:
                h["vllm:inter_token_latency_seconds"].observe(v)
                h["vllm:time_per_output_token_seconds"].observe(v)
            for v in n_params:
                h["vllm:request_params_n"].observe(v)
            for f in finished:
                reason = f["finish_reason"] if f["finish_reason"] in FINISH_REASONS else "error"
                key = ("vllm:request_success_total", reason)
                c[key] = c.get(key, 0.0) + 1
                h["vllm:e2e_request_latency_seconds"].observe(f["e2e_latency"])
                h["vllm:request_queue_time_seconds"].observe(f["queued_time"])
                h["vllm:request_prefill_time_seconds"].observe(f["prefill_time"])
                h["vllm:request_decode_time_seconds"].observe(f["decode_time"])
                h["vllm:request_prompt_tokens"].observe(f["num_prompt_tokens"])
                h["vllm:request_generation_tokens"].observe(f["num_generation_tokens"])

    # -- export (the Triton I/O thread) -------------------------------------
    def deltas(self) -> list[tuple[str, str, str | None, float]]:
        """Changes since the last call: (kind, series, label, amount).

        kind 'inc' adds ``amount`` to a counter series; 'set' sets a gauge.
        Histogram series are '<name>_bucket' (label = le), '<name>_sum', '<name>_count'.
        """
        out: list[tuple[str, str, str | None, float]] = []
        with self._lock:
            for key, value in self._counters.items():
                d = value - self._sent_counters.get(key, 0.0)
                if d:
                    out.append(("inc", key[0], key[1], d))
                    self._sent_counters[key] = value
            for name, value in self._gauges.items():
                if self._sent_gauges.get(name) != value:
                    out.append(("set", name, None, value))
                    self._sent_gauges[name] = value
            for name, hist in self._hists.items():
                prev_cum, prev_sum = self._sent_hists.get(name, ([0] * len(hist.counts), 0.0))
                cum = hist.cumulative()
                if cum[-1] == prev_cum[-1]:
                    continue
                for le, now, before in zip((*hist.buckets, float("inf")), cum, prev_cum, strict=True):
                    if now != before:
                        out.append(("inc", f"{name}_bucket", _le(le), now - before))
                out.append(("inc", f"{name}_sum", None, hist.total - prev_sum))
                out.append(("inc", f"{name}_count", None, cum[-1] - prev_cum[-1]))
                self._sent_hists[name] = (cum, hist.total)
        return out


def _le(bound: float) -> str:
    if bound == float("inf"):
        return "+Inf"
    return repr(float(bound)) if not float(bound).is_integer() else f"{bound:.1f}"


def series_names() -> list[str]:
    """Every metric family name as it appears on /metrics (docs/monitoring.md lists these)."""
    out = []
    for s in SPECS:
        if s.kind == "histogram":
            out += [f"{s.name}_bucket", f"{s.name}_sum", f"{s.name}_count"]
        else:
            out.append(s.name)
    return out


class TritonExporter:
    """Applies ServingMetrics deltas to pb_utils metric families (stub side)."""

    def __init__(self, pb_utils: Any, model: str, version: str, instance: str | None = None) -> None:
        self._labels = {"model": model, "version": version}
        self._instance = instance or model
        self._families: dict[str, Any] = {}
        self._metrics: dict[tuple[str, str | None], Any] = {}
        self._pb = pb_utils
        fam = pb_utils.MetricFamily
        for spec in SPECS:
            if spec.kind == "histogram":
                for suffix in ("_bucket", "_sum", "_count"):
                    self._family(f"{spec.name}{suffix}", fam.COUNTER, spec.help)
                for bound in (*spec.buckets, float("inf")):
                    self._metric(f"{spec.name}_bucket", _le(bound))
                self._metric(f"{spec.name}_sum", None)
                self._metric(f"{spec.name}_count", None)
            else:
                kind = fam.GAUGE if spec.kind == "gauge" else fam.COUNTER
                self._family(spec.name, kind, spec.help)
                # Pre-create labelled series at zero so rate() and dashboards see them.
                for value in spec.label_values:
                    self._metric(spec.name, value)
                if not spec.label:
                    self._metric(spec.name, None)

    def _family(self, name: str, kind: Any, help_text: str) -> None:
        self._families[name] = self._pb.MetricFamily(name=name, description=help_text, kind=kind)

    def _metric(self, series: str, label: str | None) -> Any:
        key = (series, label)
        metric = self._metrics.get(key)
        if metric is None:
            labels = dict(self._labels)
            if SPEC_BY_NAME.get(series) is not None and SPEC_BY_NAME[series].per_instance:
                labels[INSTANCE_LABEL] = self._instance
            if label is not None:
                base = series.removesuffix("_bucket")
                extra = "le" if series.endswith("_bucket") else SPEC_BY_NAME[base].label
                labels[str(extra)] = label
            metric = self._families[series].Metric(labels=labels)
            self._metrics[key] = metric
        return metric

    def apply(self, deltas: list[tuple[str, str, str | None, float]]) -> None:
        for kind, series, label, amount in deltas:
            metric = self._metric(series, label)
            if kind == "inc":
                metric.increment(amount)
            else:
                metric.set(amount)

    def close(self) -> None:
        self._metrics.clear()
        self._families.clear()


FlushFn = Callable[[list[tuple[str, str, str | None, float]]], None]
