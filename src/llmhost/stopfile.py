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
"""

from __future__ import annotations

import os
from pathlib import Path

STOP_FILE_ENV = "LLMHOST_STOP_FILE"
STOP_FILE_NAME = "stopping"


def announce_stop(path: Path, server_pid: int) -> None:
    """Record that the server SERVER_PID is being stopped (atomically)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(f"{server_pid}\n")
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


def stop_file_from_env(environ: dict[str, str] | None = None) -> Path | None:
    value = (os.environ if environ is None else environ).get(STOP_FILE_ENV, "")
    return Path(value) if value else None
