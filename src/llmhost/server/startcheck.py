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

Such a start is known sooner than the bound, which must leave room for the slowest
load: our backend opens each model instance's engine socket
(``$LLMHOST_ENGINE_SOCKET_DIR``, llmhost.backend.stream_socket) at the end of its
initialisation, and once every instance that the repository's ``config.pbtxt`` files
ask for has opened one in this start, tritonserver opens its endpoints within
seconds. One that still does not answer ``--stuck-after-s`` later (60 s) is taken
as stuck the same way. Where a configuration cannot be read so, or a model fails to
initialise, only the bound applies.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

POLL_S = 1.0
REQUEST_TIMEOUT_S = 2.0
STUCK_AFTER_S = 60.0
SOCKET_DIR_ENV = "LLMHOST_ENGINE_SOCKET_DIR"  # llmhost.backend.stream_socket's (not imported: no vLLM here)

_COUNT = re.compile(r"^\s*count\s*:\s*(\d+)\s*$", re.M)
_KIND = re.compile(r"^\s*kind\s*:\s*(\w+)\s*$", re.M)
_GPUS = re.compile(r"^\s*gpus\s*:\s*\[([^]]*)\]", re.M)


class StuckStart(Exception):
    """Every model instance initialised, and the server still does not answer."""


def expected_instances(repository: Path) -> dict[str, int] | None:
    """Per model directory of REPOSITORY, how many instances its config.pbtxt asks for
    (``count`` of its one instance group, times its ``gpus`` for KIND_GPU); None where
    a configuration is not one instance group read so, or there is no model."""
    expected: dict[str, int] = {}
    try:
        configs = sorted(repository.glob("*/config.pbtxt"))
        for config in configs:
            text = config.read_text(errors="replace")
            counts, kinds, gpus = _COUNT.findall(text), _KIND.findall(text), _GPUS.findall(text)
            if text.count("instance_group") != 1 or len(counts) != 1 or len(kinds) > 1 or len(gpus) > 1:
                return None
            per = len([g for g in gpus[0].split(",") if g.strip()]) if gpus and kinds == ["KIND_GPU"] else 1
            expected[config.parent.name] = int(counts[0]) * max(per, 1)
    except OSError:
        return None
    return expected or None


def initialised_at(socket_dir: Path, expected: dict[str, int], since: float) -> float | None:
    """When the last of the EXPECTED model instances opened its engine socket in
    SOCKET_DIR (wall clock), counting only sockets made at SINCE or later; None while
    one is missing."""
    last = since
    for model, count in expected.items():
        try:
            made = [m for m in (p.stat().st_mtime for p in (socket_dir / model).glob("*.sock")) if m >= since]
        except OSError:
            return None
        if len(made) < count:
            return None
        last = max(last, *made)
    return last


def answers(url: str, timeout_s: float = REQUEST_TIMEOUT_S) -> bool:
    """Whether the server at URL (``http://host:port``) says it is live."""
    try:
        with urllib.request.urlopen(f"{url}/v2/health/live", timeout=timeout_s) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):  # refused, reset, timed out, an HTTP error status
        return False


def raise_if_stuck(url: str, initialised: Callable[[], float | None] | None, stuck_after_s: float,
                   probe: Callable[[str], bool] = answers) -> None:
    """Raise StuckStart when INITIALISED() (when every model instance initialised, wall
    clock) lies STUCK_AFTER_S in the past and PROBE(URL) says the server does not answer."""
    done = initialised() if initialised is not None else None
    if done is not None and time.time() - done >= stuck_after_s and not probe(url):
        raise StuckStart(f"every model instance initialised {time.time() - done:.0f} s ago "
                         f"and tritonserver still does not answer at {url}")


def wait_until_answering(url: str, timeout_s: float, poll_s: float = POLL_S,
                         probe: Callable[[str], bool] = answers,
                         initialised: Callable[[], float | None] | None = None,
                         stuck_after_s: float = STUCK_AFTER_S) -> bool:
    """Poll URL until it answers (True) or TIMEOUT_S passed (False). Raises StuckStart
    once INITIALISED() (when every model instance initialised, wall clock) lies
    STUCK_AFTER_S in the past and URL still does not answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        if probe(url):
            return True
        raise_if_stuck(url, initialised, stuck_after_s, lambda _url: False)
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def initialisation_watch(repository: Path | None, socket_dir: Path | None,
                         since: float) -> Callable[[], float | None] | None:
    """INITIALISED for wait_until_answering: the models of REPOSITORY and their engine
    sockets in SOCKET_DIR since SINCE; None where either is unknown."""
    if repository is None or socket_dir is None:
        return None
    expected = expected_instances(repository)
    if expected is None:
        return None
    return lambda: initialised_at(socket_dir, expected, since)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmhost.server.startcheck",
        description="Wait until tritonserver answers on HTTP; fail when it has not within the bound, "
                    "so that systemd starts it again.")
    parser.add_argument("--url", required=True, help="tritonserver's HTTP address, e.g. http://127.0.0.1:8000")
    parser.add_argument("--timeout-s", type=float, required=True,
                        help="how long a start may take until the server answers")
    parser.add_argument("--repository", type=Path,
                        help="tritonserver's model repository: with $LLMHOST_ENGINE_SOCKET_DIR, a start whose "
                             "model instances all initialised and that still does not answer is known sooner")
    parser.add_argument("--stuck-after-s", type=float, default=STUCK_AFTER_S,
                        help=f"how long after the last model instance initialised (default {STUCK_AFTER_S:g})")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s must be > 0, got {args.timeout_s:g}")
    if args.stuck_after_s <= 0:
        parser.error(f"--stuck-after-s must be > 0, got {args.stuck_after_s:g}")
    started, since = time.monotonic(), time.time()
    socket_dir = os.environ.get(SOCKET_DIR_ENV, "").strip()
    watch = initialisation_watch(args.repository, Path(socket_dir) if socket_dir else None, since)
    try:
        answered = wait_until_answering(args.url, args.timeout_s, initialised=watch,
                                        stuck_after_s=args.stuck_after_s)
    except StuckStart as exc:
        print(f"{exc}: taken as a start that hangs; systemd stops it and starts it again after RestartSec",
              file=sys.stderr, flush=True)
        return 1
    if answered:
        print(f"tritonserver answers at {args.url} after {time.monotonic() - started:.0f} s", flush=True)
        return 0
    print(f"tritonserver did not answer at {args.url}/v2/health/live within {args.timeout_s:g} s "
          "(triton_service_ready_timeout_s): taken as a start that hangs; systemd stops it and starts it "
          "again after RestartSec", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
