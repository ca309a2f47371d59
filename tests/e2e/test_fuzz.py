"""Property-based fuzzing of a local `llmhost serve` (tests/harness/fuzz.py): 2,000
generated requests per endpoint over HTTP /generate and gRPC (500 over
/generate_stream), and 100 clients disconnecting mid-stream."""

from __future__ import annotations

from tests.harness.fuzz import disconnect_mid_stream, fuzz_grpc, fuzz_http_generate, fuzz_http_generate_stream
from tests.harness.server import Server


def test_fuzz_http_generate(server: Server) -> None:
    fuzz_http_generate(server)


def test_fuzz_http_generate_stream(server: Server) -> None:
    fuzz_http_generate_stream(server)


def test_fuzz_grpc(server: Server) -> None:
    fuzz_grpc(server)


def test_100_clients_disconnecting_mid_stream(server: Server) -> None:
    disconnect_mid_stream(server, clients=100)
