"""Property-based fuzzing of a local `llmhost serve` (tests/harness/fuzz.py): 2,000
generated requests per endpoint over HTTP /generate and gRPC (500 over
/generate_stream), and 100 clients disconnecting mid-stream; and of a gateway's
POST /v1/responses in front of it (RESPONSES_EXAMPLES bodies) and its gRPC door
(GRPC_DOOR_EXAMPLES streamed requests)."""

from __future__ import annotations

import pytest

from tests.harness.fuzz import (
    assert_healthy,
    disconnect_mid_stream,
    fuzz_gateway_responses,
    fuzz_grpc,
    fuzz_http_generate,
    fuzz_http_generate_stream,
)
from tests.harness.gateway import KEY, keyed_gateway, stop_gateway
from tests.harness.net import free_port
from tests.harness.server import Server

# The gateway's /v1/responses bodies: fewer than the backend's, as a third of them
# generate tokens through the whole path.
RESPONSES_EXAMPLES = 300
# Requests through the gateway's gRPC door (--grpc-listen): its decoding is the
# gateway's own, the rest the backend's, fuzzed above over tritonserver's gRPC.
GRPC_DOOR_EXAMPLES = 300


def test_fuzz_http_generate(server: Server) -> None:
    fuzz_http_generate(server)


def test_fuzz_http_generate_stream(server: Server) -> None:
    fuzz_http_generate_stream(server)


def test_fuzz_grpc(server: Server) -> None:
    fuzz_grpc(server)


def test_fuzz_gateway_grpc(server: Server, tmp_path_factory: pytest.TempPathFactory) -> None:
    address = f"127.0.0.1:{free_port()}"
    gateway = keyed_gateway(server, tmp_path_factory.mktemp("fuzz-grpc-door"), "--grpc-listen", address,
                            "--engine-sockets", f"{server.grpc}={server.engine_sockets}")
    try:
        fuzz_grpc(server, GRPC_DOOR_EXAMPLES, address, {"authorization": f"Bearer {KEY}"})
    finally:
        stop_gateway(gateway.proc, gateway.log)


def test_100_clients_disconnecting_mid_stream(server: Server) -> None:
    disconnect_mid_stream(server, clients=100)


def test_fuzz_gateway_responses(server: Server, tmp_path_factory: pytest.TempPathFactory) -> None:
    gateway = keyed_gateway(server, tmp_path_factory.mktemp("fuzz-responses"),
                            "--engine-sockets", f"{server.grpc}={server.engine_sockets}")
    try:
        fuzz_gateway_responses(gateway.url, KEY, server.name, RESPONSES_EXAMPLES)
    finally:
        stop_gateway(gateway.proc, gateway.log)
    assert_healthy(server)
