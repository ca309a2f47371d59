"""A short load inside `make test` (the long one is `make soak`): concurrency 32,
zero errors, every stream complete, memory bounded."""

from __future__ import annotations

from tests.e2e._load import run_load


def test_short_load_at_concurrency_32(server):
    report = run_load(server.http, server.name, server.proc.pid, concurrency=32, duration_s=45)
    r = report.result
    print(f"\nload: {r.requests} requests in {r.duration_s:.0f}s, {r.output_tokens_per_s:.0f} tok/s, "
          f"{r.errors} errors; RSS {report.rss_start_mib:.0f} -> {report.rss_end_mib:.0f} MiB")
    assert r.requests >= 32 and r.errors == 0, r.first_error
    # Bounded growth: the KV cache and allocator are warm already; allow slack for
    # Python's arenas, never a leak that scales with requests.
    assert report.rss_end_mib < report.rss_start_mib * 1.25 + 200
