"""Stop a tritonserver that serves our backend: announce, SIGTERM, free its HTTP port.

The unit's ExecStop (``python -m llmhost.server.stopserver``, as root: it may take
tritonserver's sockets) and ``llmhost serve`` (tritonserver's parent) stop it the
same way:

1. write tritonserver's pid into the stop file: each backend process drains at once
   (``llmhost.server.stopfile``), and marks itself drained when nothing is in flight;
2. SIGTERM tritonserver alone (vLLM's engine processes would stop at once on their
   own SIGTERM and cut every stream);
3. until tritonserver exits: once every backend process is drained (or the drain
   timeout is over), shut down each connection to the HTTP port on which nothing
   has moved for ``IDLE_S`` (``llmhost.server.httpconns``). Triton 2.51 would otherwise
   wait its whole exit timeout for an idle keep-alive client and exit 1 without
   unloading the models.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from llmhost.server import httpconns
from llmhost.server.stopfile import STOP_FILE_ENV, all_drained, announce_stop

# A connection silent both ways this long, after the drain, carries no request: the
# last response of a finished stream leaves within milliseconds of the mark.
IDLE_S = 2.0
# After the drain timeout (the backends abort what is left), this long for the
# aborted requests' errors to reach their clients before their connections count as idle.
AFTER_DRAIN_S = 3.0
POLL_S = 0.5
_STUB_COMM = "triton_python_b"  # triton_python_backend_stub, as the kernel truncates it


def backend_pids(server_pid: int) -> list[int]:
    """The python backend processes (stubs) of the server SERVER_PID."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(entry.path, "stat").read_text()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid == server_pid and comm.startswith(_STUB_COMM):
                pids.append(int(entry.name))
    return sorted(pids)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own child, not yet reaped) has exited.
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    return True


def free_http_port(server_pid: int, http_port: int, stop_file: Path | None, drain_timeout_s: float,
                   log: Callable[[str], None], exited: Callable[[], bool] | None = None,
                   idle_s: float = IDLE_S, poll_s: float = POLL_S) -> int:
    """Until the server has exited (EXITED, else its pid is gone): once every backend
    is drained, or DRAIN_TIMEOUT_S (+ AFTER_DRAIN_S) after the call, shut down each
    idle connection to HTTP_PORT. Returns how many were shut down."""
    exited = exited or (lambda: not alive(server_pid))
    deadline = time.monotonic() + drain_timeout_s + AFTER_DRAIN_S
    closed = 0
    warned = False
    while not exited():
        if stop_file is not None:
            drained = all_drained(stop_file, server_pid, backend_pids(server_pid))
        else:
            drained = False
        if drained or time.monotonic() >= deadline:
            try:
                gone = httpconns.shut_down_idle(server_pid, http_port, idle_s)
            except OSError as exc:  # no right to take the server's sockets; it ends by its exit timeout
                if not warned:
                    log(f"cannot close idle HTTP connections of tritonserver (pid {server_pid}): {exc}")
                    warned = True
                gone = []
            if gone:
                closed += len(gone)
                why = "every model drained" if drained else "the drain timeout is over"
                log(f"closed {len(gone)} idle HTTP connection(s) to port {http_port} ({why}): "
                    + ", ".join(c.peer for c in gone))
        time.sleep(poll_s)
    return closed


def stop(server_pid: int, http_port: int, stop_file: Path | None, drain_timeout_s: float,
         log: Callable[[str], None]) -> int:
    """The whole stop (announce, SIGTERM, free the port) of SERVER_PID; returns
    once it has exited."""
    if stop_file is not None:
        try:
            announce_stop(stop_file, server_pid)
        except OSError as exc:  # the backend then drains when Triton unloads it, as before
            log(f"cannot write the stop file {stop_file}: {exc}")
    try:
        os.kill(server_pid, signal.SIGTERM)
    except ProcessLookupError:
        return 0
    return free_http_port(server_pid, http_port, stop_file, drain_timeout_s, log)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmhost.server.stopserver", description=__doc__.splitlines()[0])
    p.add_argument("--pid", type=int, default=int(os.environ.get("MAINPID") or 0),
                   help="tritonserver's pid (default: $MAINPID, as systemd sets it for ExecStop)")
    p.add_argument("--http-port", type=int, required=True, help="tritonserver's HTTP port")
    p.add_argument("--drain-timeout-s", type=float, required=True,
                   help="the longest drain_timeout_s of the models: idle connections are closed after it at the latest")
    p.add_argument("--stop-file", type=Path, default=os.environ.get(STOP_FILE_ENV) or None,
                   help=f"the backend's stop file (default: ${STOP_FILE_ENV})")
    args = p.parse_args(argv)
    if args.pid <= 0:
        return 0  # nothing runs: nothing to stop

    def log(message: str) -> None:
        print(f"llmhost stop: {message}", file=sys.stderr, flush=True)

    stop(args.pid, args.http_port, args.stop_file, args.drain_timeout_s, log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
