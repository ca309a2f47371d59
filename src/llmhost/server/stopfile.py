"""How our backend learns that its tritonserver was asked to stop.

On SIGTERM, Triton 2.51 first waits, up to ``--exit-timeout-secs``, until every
HTTP connection has closed (server#6986), and only then stops the models; each
model's ``finalize`` is where our backend drains. A stream longer than that wait
would use up the whole exit timeout and tritonserver would exit 1 without
unloading anything, cutting the stream without an error. So whoever stops
tritonserver (the unit's ExecStop, ``llmhost serve``) first writes the server's
pid into the file named by ``LLMHOST_STOP_FILE``; the backend's watchdog sees it
within a second and drains at once: new requests are refused ("shutting down"),
requests in flight get ``drain_timeout_s`` to finish, then are aborted with an
error. Their connections end, and Triton goes on to unload with time to spare.

The pid ties the file to one server: a file left by an earlier instance (a
crash, a restart) is ignored.

Once a backend process has no request in flight any more during such a stop (and
has handed its last responses to tritonserver), it leaves a second file beside it,
``<stop file>.drained.<its pid>``, holding the server's pid too: the stopper
(``llmhost.server.stopserver``) then knows that an HTTP connection still open carries no
request, and closes it (``llmhost.server.httpconns``).
"""

from __future__ import annotations

import os
from pathlib import Path

STOP_FILE_ENV = "LLMHOST_STOP_FILE"
STOP_FILE_NAME = "stopping"


def announce_stop(path: Path, server_pid: int) -> None:
    """Record that the server SERVER_PID is being stopped (atomically)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        # Readable by tritonserver's user whatever the writer's umask: the unit's
        # ExecStop writes it as root under UMask=0077 (the directory is 0700 anyway).
        os.fchmod(fd, 0o644)
        os.write(fd, f"{server_pid}\n".encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def stop_requested(path: Path | None, server_pid: int) -> bool:
    """Whether PATH says that the server SERVER_PID is being stopped."""
    if path is None:
        return False
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return False
    return text.isdigit() and int(text) == server_pid


def drained_file(path: Path, backend_pid: int) -> Path:
    return path.with_name(f"{path.name}.drained.{backend_pid}")


def mark_drained(path: Path, server_pid: int, backend_pid: int | None = None) -> None:
    """Record that the backend process BACKEND_PID (this one by default) of the
    server SERVER_PID has nothing in flight any more during the server's stop."""
    announce_stop(drained_file(path, os.getpid() if backend_pid is None else backend_pid), server_pid)


def all_drained(path: Path, server_pid: int, backend_pids: list[int]) -> bool:
    """Whether every one of BACKEND_PIDS has marked itself drained for SERVER_PID."""
    return all(stop_requested(drained_file(path, pid), server_pid) for pid in backend_pids)


def remove_stop_files(path: Path) -> None:
    """Remove the stop file and every drained mark beside it (before a start)."""
    for old in [path, *path.parent.glob(f"{path.name}.drained.*")]:
        old.unlink(missing_ok=True)


def stop_file_from_env(environ: dict[str, str] | None = None) -> Path | None:
    value = (os.environ if environ is None else environ).get(STOP_FILE_ENV, "")
    return Path(value) if value else None
