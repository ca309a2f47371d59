from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.server import Server, start_server, wait_gone


# Package scope: the server stops once the e2e tests are done, so it does not hold
# memory and CPU through the system tests that follow (several hosts, each with
# its own tritonserver and vLLM, on two cores).
@pytest.fixture(scope="package")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Two response threads, so every e2e test also covers streams spread over
    # several I/O threads (the default is one); fresh_metrics, so tests that read
    # /metrics right after a response (vllm_backend's contract) find it counted.
    # The default (periodic pushes only) is what the system tests deploy.
    # pin_frontend_cpus (opt-in), so tests/e2e/test_cpus.py sees the threads moved.
    # tool_parser hermes (the tiny model's template's format) for tests/e2e/test_tools.py.
    srv = start_server(tiny_model, tmp_path_factory.mktemp("serve"),
                       extra=["--setting", "response_threads=2", "--setting", "fresh_metrics=true",
                              "--setting", "pin_frontend_cpus=true", "--setting", "tool_parser=hermes"])
    yield srv
    kids = srv.descendants()
    srv.stop()
    left = wait_gone(kids)
    assert not left, f"processes left after SIGTERM: {[p.pid for p in left]}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/e2e/" in str(item.path):
            item.add_marker(pytest.mark.e2e)
