"""Which upstream takes a request: ``pool`` (the upstreams, their health checks,
in-flight counts, queueing and retries) and ``policies`` (cache-aware, least-loaded,
round-robin among a model's replicas).
"""
