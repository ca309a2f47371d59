"""`llmhost gateway`: an authenticated, OpenAI-compatible front door to Triton.

The gateway speaks OpenAI's API (``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``) and Triton's own generate/health/metadata API (``/v2/...``) to
clients, and Triton's gRPC streaming API to our backend on one or more Triton servers.
Modules: ``config`` (settings and the YAML config file), ``keys`` (hashed API keys and
their limits), ``limits`` (per-key rate limits), ``errors`` (OpenAI error objects),
``openai_models`` (request models), ``mapping`` (OpenAI request -> backend inputs),
``upstream`` (the Triton client), ``pool`` (several upstreams: health checks, routing,
retry, queueing), ``responses`` (OpenAI response and SSE chunk shapes), ``native``
(Triton's HTTP API over gRPC), ``httpio`` (HTTP plumbing), ``record`` (per-request
record), ``metrics`` (Prometheus), ``accesslog`` (JSON access log), ``app`` (the ASGI
app) and ``cli`` (the command).
"""
