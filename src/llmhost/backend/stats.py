"""A vLLM stat logger that feeds llmhost's ServingMetrics.

vLLM calls ``record`` once per engine step with scheduler and iteration stats;
the logger copies plain numbers into ``ServingMetrics`` (no I/O here).
These vLLM classes are "not considered stable interfaces": the pinned vLLM
version is tested by tests/unit/test_stats.py and the e2e metrics test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from llmhost.backend.metrics import ServingMetrics


class ServingStatLogger(StatLoggerBase):
    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
            self.metrics.record_scheduler(
                running=scheduler_stats.num_running_reqs,
                waiting=scheduler_stats.num_waiting_reqs,
                kv_cache_usage=scheduler_stats.kv_cache_usage,
                prefix_queries=prefix.queries if prefix is not None else 0,
                prefix_hits=prefix.hits if prefix is not None else 0,
            )
        if iteration_stats is not None:
            self.metrics.record_iteration(
                prompt_tokens=iteration_stats.num_prompt_tokens,
                generation_tokens=iteration_stats.num_generation_tokens,
                ttfts=iteration_stats.time_to_first_tokens_iter,
                itls=iteration_stats.inter_token_latencies_iter,
                preempted=iteration_stats.num_preempted_reqs,
                finished=[
                    {
                        "finish_reason": str(f.finish_reason),
                        "e2e_latency": f.e2e_latency,
                        "queued_time": f.queued_time,
                        "prefill_time": f.prefill_time,
                        "decode_time": f.decode_time,
                        "num_prompt_tokens": f.num_prompt_tokens,
                        "num_generation_tokens": f.num_generation_tokens,
                    }
                    for f in iteration_stats.finished_requests
                ],
                n_params=getattr(iteration_stats, "n_params_iter", ()),
            )

    def log_engine_initialized(self) -> None:
        pass


def stat_logger_factory(metrics: ServingMetrics) -> Callable[[Any, int], StatLoggerBase]:
    def factory(vllm_config: Any, engine_index: int = 0) -> StatLoggerBase:
        return ServingStatLogger(metrics)

    return factory
