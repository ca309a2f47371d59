"""Bad input at scale and a short load against the booted host's tritonserver unit,
the way clients reach a real server: the e2e fuzzer (tests/harness/fuzz.py; here
HOST_EXAMPLES cases per endpoint for HTTP /generate and gRPC, to show the hardened
unit (its system call filter, its sandbox) answers them like a local server; the
e2e tests run the full FUZZ_EXAMPLES through the same backend), 100 clients
disconnecting mid-stream, and 30 s at concurrency 32 with zero errors and the
memory of the unit's control group bounded. The unit must neither restart nor
crash meanwhile."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness.endpoint import Endpoint
from tests.harness.fuzz import EXAMPLES, disconnect_mid_stream, fuzz_grpc, fuzz_http_generate
from tests.harness.load import assert_clean_and_bounded, run_load
from tests.system._converge import Converged
from tests.system._unit import endpoint, props, unit_rss_mib, wait_ready

LOAD_S = 30
HOST_EXAMPLES = min(EXAMPLES, 300)


@pytest.fixture
def serving(converged: Converged) -> Iterator[Endpoint]:
    """The host's endpoint; afterwards, the unit has not restarted."""
    assert wait_ready(converged.triton_http, timeout_s=300)
    before = props(converged.host, "MainPID", "NRestarts")
    yield endpoint(converged)
    after = props(converged.host, "MainPID", "NRestarts", "ActiveState")
    assert after.pop("ActiveState") == "active" and after == before, (before, after)


def test_fuzz_http_generate_on_host(serving: Endpoint):
    seen = fuzz_http_generate(serving, HOST_EXAMPLES)
    print(f"\nHTTP /generate on the host: {sum(seen.values())} cases, {seen}")
    assert sum(seen.values()) >= HOST_EXAMPLES


def test_fuzz_grpc_on_host(serving: Endpoint):
    seen = fuzz_grpc(serving, HOST_EXAMPLES)
    print(f"\ngRPC stream on the host: {sum(seen.values())} cases, {seen}")
    assert sum(seen.values()) >= HOST_EXAMPLES


def test_100_clients_disconnecting_mid_stream_on_host(serving: Endpoint):
    disconnect_mid_stream(serving, clients=100)


def test_short_load_on_host(serving: Endpoint, converged: Converged):
    report = run_load(serving.http, serving.name, lambda: unit_rss_mib(converged.host), concurrency=32,
                      duration_s=LOAD_S)
    assert_clean_and_bounded(report, f"load on the host, concurrency 32 for {LOAD_S} s")
