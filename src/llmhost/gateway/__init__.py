"""`llmhost gateway`: an authenticated, OpenAI-compatible front door to Triton.

The gateway speaks OpenAI's API (``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``) and Triton's own generate/health/metadata API (``/v2/...``) to
clients, and Triton's gRPC streaming API to our backend on one or more Triton servers.
Layout: one room per door, ``doors`` (``doors.openai``: OpenAI's API; ``doors.native``:
Triton's HTTP API; ``doors.grpc``: Triton's gRPC API; ``doors.admin``: the admin API);
``routing`` (the upstream pool, its health checks and the routing policies);
``upstreams`` (the engine-socket and gRPC client of one server, and the request it
sends). Shared by every door, here: ``config`` (settings and the YAML config file),
``keys`` (hashed API keys and their limits), ``limits`` (per-key rate limits),
``access`` (a request's key, model and limits), ``errors`` (OpenAI error objects),
``httpio`` (HTTP plumbing), ``record`` (per-request record), ``metrics``
(Prometheus), ``accesslog`` (JSON access log), ``connections`` (client connection
bounds), ``app`` (the ASGI app of the HTTP doors), ``workers`` (several processes
on one port) and ``cli`` (the command).
"""
