"""A short load inside `make test` (the long one is `make soak`): concurrency 32,
zero errors, every stream complete, memory bounded."""

from __future__ import annotations

from tests.harness.load import assert_clean_and_bounded, run_load, tree_rss_mib
from tests.harness.server import Server


def test_short_load_at_concurrency_32(server: Server) -> None:
    report = run_load(server.http, server.name, lambda: tree_rss_mib(server.proc.pid), concurrency=32,
                      duration_s=45)
    assert_clean_and_bounded(report, "load")
