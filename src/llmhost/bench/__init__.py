"""Measuring an endpoint: `llmhost bench`'s load generator (`loadgen`), vLLM's own
bench client (`vllm_client`), the arithmetic of side-by-side runs (`compare`) and
Prometheus queries (`promql`)."""
