"""`llmhost gateway`: an authenticated, OpenAI-compatible front door to Triton.

The gateway speaks OpenAI's API (``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``) to clients and Triton's gRPC streaming API to our backend.
Modules: ``config`` (settings), ``keys`` (hashed API keys), ``errors`` (OpenAI error
objects), ``openai_models`` (request models), ``mapping`` (OpenAI request -> backend
inputs), ``upstream`` (the Triton client), ``responses`` (OpenAI response and SSE
chunk shapes), ``app`` (the ASGI app) and ``cli`` (the command).
"""
