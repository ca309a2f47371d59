"""`make soak` (`python -m tests.harness.soak`): concurrency 32 for 10 minutes against a
fresh `llmhost serve` on the tiny model; prints requests, errors, tokens/s and the
server's RSS at start and end. Not a test: numbers only (docs/reliability.md holds a
run's figures)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from llmhost.tiny.model import write_tiny_model
from tests.harness.load import run_load, tree_rss_mib
from tests.harness.server import start_server


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmhost-soak-"))
    srv = start_server(write_tiny_model(work / "tiny"), work / "serve")
    try:
        # Warm up first so the RSS baseline includes the allocator's steady state.
        def rss() -> float:
            return tree_rss_mib(srv.proc.pid)

        run_load(srv.http, srv.name, rss, args.concurrency, 20)
        rep = run_load(srv.http, srv.name, rss, args.concurrency, args.minutes * 60)
    finally:
        srv.stop()
    r = rep.result
    print(f"soak: concurrency {args.concurrency}, {r.duration_s:.0f} s, {r.requests} requests, {r.errors} errors, "
          f"{r.output_tokens_per_s:.0f} output tok/s, e2e p50/p99 {r.e2e_s.get('p50', 0):.2f}/"
          f"{r.e2e_s.get('p99', 0):.2f} s; RSS of the server tree {rep.rss_start_mib:.0f} -> "
          f"{rep.rss_end_mib:.0f} MiB ({rep.rss_end_mib - rep.rss_start_mib:+.0f} MiB)")
    if r.first_error:
        print(f"first error: {r.first_error}")
    return 1 if r.errors else 0


if __name__ == "__main__":
    sys.exit(main())
