"""The model's config.pbtxt ``parameters`` our backend reads, as NVIDIA's vllm_backend does.

- ``REPORT_CUSTOM_METRICS``: the backend's ``vllm:`` metrics are exported only when it
  is "true" (any case) and model.json does not set ``disable_log_stats`` to true. Absent
  or anything else: none are. llmhost's template (config.pbtxt.j2) writes it "true".
- ``ENABLE_VLLM_HEALTH_CHECK``: "true" makes a dead engine unload the model, so that it
  reads not ready (health.py).

Values are read as vllm_backend reads them: ``string_value`` compared to "true"
ignoring case; any other value means false.
"""

from __future__ import annotations

from typing import Any

REPORT_CUSTOM_METRICS = "REPORT_CUSTOM_METRICS"
ENABLE_VLLM_HEALTH_CHECK = "ENABLE_VLLM_HEALTH_CHECK"


def bool_param(model_config: dict[str, Any], name: str) -> bool:
    """True when config.pbtxt sets parameter NAME to "true" (any case)."""
    params = model_config.get("parameters") or {}
    entry = params.get(name)
    if not isinstance(entry, dict):
        return False
    return str(entry.get("string_value", "")).strip().lower() == "true"


def metrics_enabled(model_config: dict[str, Any], engine_args: dict[str, Any]) -> bool:
    """Whether the backend's metrics are exported: REPORT_CUSTOM_METRICS on, and
    ``disable_log_stats`` not set (to a true value) in model.json. (Our own engine default of
    ``disable_log_stats``, which only silences vLLM's log lines, does not count.)"""
    return bool_param(model_config, REPORT_CUSTOM_METRICS) and not engine_args.get("disable_log_stats")
