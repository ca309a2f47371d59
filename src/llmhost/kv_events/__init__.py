"""vLLM's KV-cache events between the backend, whose engines publish them, and the
gateway, which routes by them: where they are published and how they are described
(``sockets``). Neither side imports the other; both import this."""
