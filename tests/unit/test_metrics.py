"""Metric aggregation and the deltas pushed to Triton."""

from __future__ import annotations

from typing import Any, ClassVar

from llmhost.backend.metrics import SPEC_BY_NAME, SPECS, ServingMetrics, TritonExporter, series_names


def finished(**kw: Any) -> dict[str, Any]:
    base = {"finish_reason": "length", "e2e_latency": 0.5, "queued_time": 0.01, "prefill_time": 0.02,
            "decode_time": 0.4, "num_prompt_tokens": 10, "num_generation_tokens": 16}
    return base | kw


def test_deltas_are_incremental_and_histograms_cumulative():
    m = ServingMetrics()
    m.record_iteration(prompt_tokens=10, generation_tokens=3, ttfts=[0.03], itls=[0.01, 0.02],
                       preempted=0, finished=[finished()])
    m.record_scheduler(running=2, waiting=1, kv_cache_usage=0.25)
    d = {(series, label): amount for _, series, label, amount in m.deltas()}
    assert d[("vllm:prompt_tokens_total", None)] == 10
    assert d[("vllm:generation_tokens_total", None)] == 3
    assert d[("vllm:request_success_total", "length")] == 1
    assert d[("vllm:num_requests_running", None)] == 2
    assert d[("vllm:kv_cache_usage_perc", None)] == 0.25
    # 0.03 falls in le=0.04 and every bucket above it, +Inf included.
    assert d[("vllm:time_to_first_token_seconds_bucket", "0.04")] == 1
    assert ("vllm:time_to_first_token_seconds_bucket", "0.02") not in d
    assert d[("vllm:time_to_first_token_seconds_bucket", "+Inf")] == 1
    assert d[("vllm:inter_token_latency_seconds_count", None)] == 2
    assert abs(d[("vllm:inter_token_latency_seconds_sum", None)] - 0.03) < 1e-9
    assert m.deltas() == []  # nothing new
    m.record_iteration(prompt_tokens=0, generation_tokens=2, ttfts=[], itls=[], preempted=1,
                       finished=[finished(finish_reason="weird")])
    d = {(series, label): amount for _, series, label, amount in m.deltas()}
    assert d[("vllm:generation_tokens_total", None)] == 2
    assert d[("vllm:num_preemptions_total", None)] == 1
    assert d[("vllm:request_success_total", "error")] == 1  # unknown reasons are not dropped


def test_gauge_sent_only_on_change():
    m = ServingMetrics()
    m.set("vllm:num_requests_running", 0)
    assert m.deltas() == [("set", "vllm:num_requests_running", None, 0)]
    m.set("vllm:num_requests_running", 0)
    assert m.deltas() == []


class FakeMetric:
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels, self.value = labels, 0.0

    def increment(self, v: float) -> None:
        self.value += v

    def set(self, v: float) -> None:
        self.value = v


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: ClassVar[dict[str, FakeFamily]] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind, self.metrics = name, kind, []
        FakeFamily.made[name] = self

    def Metric(self, labels: dict[str, str]) -> FakeMetric:
        m = FakeMetric(labels)
        self.metrics.append(m)
        return m


class FakePb:
    MetricFamily = FakeFamily


def test_exporter_families_match_readme_list_and_apply_deltas():
    FakeFamily.made.clear()
    exp = TritonExporter(FakePb, "tiny", "1")
    assert set(FakeFamily.made) == set(series_names())
    assert FakeFamily.made["vllm:num_requests_running"].kind == "gauge"
    bucket_family = FakeFamily.made["vllm:time_to_first_token_seconds_bucket"]
    assert {m.labels["le"] for m in bucket_family.metrics} >= {"0.001", "+Inf"}
    m = ServingMetrics()
    m.record_iteration(prompt_tokens=5, generation_tokens=1, ttfts=[0.5], itls=[], preempted=0, finished=[])
    m.inc("vllm:request_failed_total", label="invalid_request")
    exp.apply(m.deltas())
    failed = {x.labels["reason"]: x.value for x in FakeFamily.made["vllm:request_failed_total"].metrics}
    assert failed == {"invalid_request": 1.0, "engine_error": 0.0, "shutting_down": 0.0,
                      "engine_dead": 0.0}
    inf = next(x for x in bucket_family.metrics if x.labels["le"] == "+Inf")
    assert inf.value == 1 and inf.labels["model"] == "tiny"


def test_every_spec_has_help_and_prefix():
    for spec in SPECS:
        assert spec.name.startswith(("vllm:", "llmhost:")) and spec.help


def test_vllm_backend_names_are_exported_with_its_buckets():
    """NVIDIA vllm_backend's series beside ours: time per output token (the same
    observations as our inter-token latency) and the n parameter, with its bucket
    boundaries; our e2e buckets hold all of its."""
    from llmhost.backend.metrics import N_BUCKETS, TPOT_BUCKETS

    assert SPEC_BY_NAME["vllm:time_per_output_token_seconds"].buckets == TPOT_BUCKETS
    assert TPOT_BUCKETS == (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
    assert SPEC_BY_NAME["vllm:request_params_n"].buckets == N_BUCKETS == (1, 2, 5, 10, 20)
    assert {1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0} <= set(
        SPEC_BY_NAME["vllm:e2e_request_latency_seconds"].buckets)
    assert {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0} <= set(
        SPEC_BY_NAME["vllm:time_to_first_token_seconds"].buckets)
    m = ServingMetrics()
    m.record_iteration(prompt_tokens=3, generation_tokens=2, ttfts=[], itls=[0.02, 0.03], preempted=0,
                       finished=[], n_params=[2, 1])
    got = {(s, lbl): a for _, s, lbl, a in m.deltas()}
    assert got[("vllm:time_per_output_token_seconds_count", None)] == 2
    assert got[("vllm:inter_token_latency_seconds_count", None)] == 2
    assert got[("vllm:request_params_n_count", None)] == 2
    assert got[("vllm:request_params_n_sum", None)] == 3
    assert got[("vllm:request_params_n_bucket", "1.0")] == 1
    assert got[("vllm:request_params_n_bucket", "2.0")] == 2  # buckets are cumulative
