"""The clients of the inference servers: ``client`` (one server: our backend over its
engine sockets on this host, else Triton's gRPC streaming) and ``request`` (what one
request upstream carries, from any door).
"""
