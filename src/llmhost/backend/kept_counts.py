"""Counts that outlive the server's restart.

A hung engine is counted (``llmhost:engine_hangs_total``) and then tritonserver
stops so that its supervisor (systemd, ``llmhost serve``) starts it again: a counter
kept only in memory would be on /metrics for the moment between the two, which a
scrape every 15 s almost never sees. So each model instance keeps its count in a
file of its own under ``$LLMHOST_STATE_DIR`` (the unit's StateDirectory; serve's
work folder) and the restarted instance starts its counter from it. The series
then only grows, as Prometheus expects of a counter, until the state is removed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

STATE_DIR_ENV = "LLMHOST_STATE_DIR"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def count_file(name: str, model: str, instance: str, environ: Mapping[str, str] | None = None) -> Path | None:
    """The file of NAME's count for this model instance; None without a state folder."""
    folder = (os.environ if environ is None else environ).get(STATE_DIR_ENV, "").strip()
    if not folder:
        return None
    return Path(folder) / _file_name(model) / f"{_file_name(instance)}.{name}"


def _file_name(text: str) -> str:
    """TEXT as one file name of the state folder: no slash, no leading dot."""
    safe = _UNSAFE.sub("_", text) or "_"
    return "_" + safe[1:] if safe.startswith(".") else safe


def read_count(path: Path | None) -> int:
    """The count kept in PATH; 0 where there is none or it is not a count."""
    if path is None:
        return 0
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return 0
    return int(text) if text.isdigit() else 0


def add_count(path: Path | None, by: int = 1) -> int:
    """Add BY to the count in PATH (written whole, then renamed over the old one);
    returns the new count. A state folder that cannot be written raises OSError."""
    total = read_count(path) + by
    if path is None:
        return total
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_text(f"{total}\n", encoding="ascii")
    os.replace(part, path)
    return total
