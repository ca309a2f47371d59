"""The gateway's doors, one room each: ``openai`` (OpenAI's API: chat, completions,
responses, embeddings, tokenize, the models listing), ``native`` (Triton's HTTP
generate/health/metadata API), ``grpc`` (Triton's KServe v2 gRPC API) and ``admin``
(holding upstreams out of the pool); ``triton_generate`` is Triton's generate request and
responses, which both Triton doors take and give. Each takes the shared ``llmhost.gateway.access``
(keys, limits, the pool); a new door is a new module or package here.
"""
