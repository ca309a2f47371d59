"""Whether a tritonserver start succeeded: it answers on HTTP within a bound.

tritonserver opens its HTTP and gRPC endpoints only once every model of the
repository has been tried, so "answers ``/v2/health/live``" is the moment a start
is over, whether each model loaded or failed. Some starts never get there: with
the CPU starved, Triton's python backend may give up on a stub whose health flag
it could not read within a second while the stub was initialising, then wait
forever for that stub to exit (docs/testing.md, "A tritonserver that never
answers"). The process is alive, systemd sees it running, and nothing serves.

The unit runs this check as its ``ExecStartPost``, so systemd counts the start as
done only once the server answers; when it has not answered within ``--timeout-s``
the check fails, systemd stops the server and, with ``Restart=always``, starts it
again after ``RestartSec`` (bounded by ``StartLimitBurst``). ``llmhost serve`` does
the same for the tritonserver it runs.
"""

from __future__ import annotations

import argparse
import http.client
import sys
import time
import urllib.request
from collections.abc import Callable

POLL_S = 1.0
REQUEST_TIMEOUT_S = 2.0


def answers(url: str, timeout_s: float = REQUEST_TIMEOUT_S) -> bool:
    """Whether the server at URL (``http://host:port``) says it is live."""
    try:
        with urllib.request.urlopen(f"{url}/v2/health/live", timeout=timeout_s) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):  # refused, reset, timed out, an HTTP error status
        return False


def wait_until_answering(url: str, timeout_s: float, poll_s: float = POLL_S,
                         probe: Callable[[str], bool] = answers) -> bool:
    """Poll URL until it answers (True) or TIMEOUT_S passed (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if probe(url):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmhost.server.startcheck",
        description="Wait until tritonserver answers on HTTP; fail when it has not within the bound, "
                    "so that systemd starts it again.")
    parser.add_argument("--url", required=True, help="tritonserver's HTTP address, e.g. http://127.0.0.1:8000")
    parser.add_argument("--timeout-s", type=float, required=True,
                        help="how long a start may take until the server answers")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s must be > 0, got {args.timeout_s:g}")
    started = time.monotonic()
    if wait_until_answering(args.url, args.timeout_s):
        print(f"tritonserver answers at {args.url} after {time.monotonic() - started:.0f} s", flush=True)
        return 0
    print(f"tritonserver did not answer at {args.url}/v2/health/live within {args.timeout_s:g} s "
          "(triton_service_ready_timeout_s): taken as a start that hangs; systemd stops it and starts it "
          "again after RestartSec", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
