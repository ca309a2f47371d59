"""Running commands for the test host tool: its error, log lines, locks and the root check."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class TestHostError(RuntimeError):
    """A failure with a message meant for the user (no traceback)."""


_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[testhost {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def run(
    cmd: Sequence[str | os.PathLike[str]],
    *,
    check: bool = True,
    capture: bool = False,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    args = [str(c) for c in cmd]
    try:
        return subprocess.run(
            args,
            check=check,
            text=True,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.PIPE if capture else None,
            env=env,
            timeout=timeout,
        )
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or "").strip()[-2000:]
        raise TestHostError(f"command failed ({exc.returncode}): {shlex.join(args)}\n{detail}") from exc


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def require_root() -> None:
    if os.geteuid() != 0:
        raise TestHostError("testhost needs root (debootstrap, mount, systemd-nspawn)")
