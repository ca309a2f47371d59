"""Where a test run's CPU goes: each pytest worker in a cpuacct control group of its own.

Every process a worker starts (tritonserver, vLLM, Ansible, a booted host's systemd
and its services) inherits the worker's group, so the group's counter is the CPU
that the worker's tests cost, whatever ran it. A test's share is the counter's growth
from the end of the previous test's report to the end of its own (its fixtures' setup
and teardown included), kept in its reports as the user property CPU_SECONDS; the
controller adds them up by folder and by module at the end of the run.

On a machine whose cgroup v1 cpuacct hierarchy is not mounted or not writable (not
root, cgroup v2 only) nothing is measured and nothing is printed.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
GROUP_PREFIX = "llmhost-tests-"
CPU_SECONDS = "cpu_seconds"


@dataclass
class Group:
    """The cpuacct group this process moved into (with what it starts from then on)."""

    path: Path

    @classmethod
    def join(cls, name: str, root: Path = CPUACCT) -> Group | None:
        """Create ROOT/GROUP_PREFIX+NAME and move this process into it; None where that cannot be done."""
        path = root / f"{GROUP_PREFIX}{name}"
        try:
            path.mkdir(exist_ok=True)
            (path / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError:
            return None
        return cls(path)

    def seconds(self) -> float:
        """CPU time used by the group's processes so far, those that have ended included."""
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def leave(self, root: Path = CPUACCT) -> None:
        """Back to the root group; the group is removed once no process is left in it."""
        with contextlib.suppress(OSError):
            (root / "cgroup.procs").write_text(f"{os.getpid()}\n")
        with contextlib.suppress(OSError):
            self.path.rmdir()


def folder_of(nodeid: str) -> str:
    """tests/e2e/test_x.py::t -> tests/e2e."""
    path = nodeid.split("::", 1)[0]
    return path.rsplit("/", 1)[0] if "/" in path else path


def totals(reports: Iterable[Any]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """{folder: [cpu seconds, wall seconds]} and {module: [...]}, from the reports' CPU_SECONDS
    properties and durations (setup, call and teardown of every test)."""
    folders: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for report in reports:
        cpu = sum(float(v) for k, v in getattr(report, "user_properties", ()) if k == CPU_SECONDS)
        wall = float(getattr(report, "duration", 0.0) or 0.0)
        if not cpu and not wall:
            continue
        module = report.nodeid.split("::", 1)[0]
        for table, key in ((folders, folder_of(report.nodeid)), (modules, module)):
            table[key][0] += cpu
            table[key][1] += wall
    return dict(folders), dict(modules)


def summary(reports: Iterable[Any], top: int = 25) -> list[str]:
    """Lines for the terminal: CPU and wall seconds by folder, then the TOP modules by CPU."""
    folders, modules = totals(reports)
    if not any(cpu for cpu, _ in folders.values()):
        return []
    lines = [f"{'cpu s':>8} {'wall s':>8}  folder"]
    for name, (cpu, wall) in sorted(folders.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{cpu:8.0f} {wall:8.0f}  {name}")
    lines.append(f"{sum(c for c, _ in folders.values()):8.0f} {sum(w for _, w in folders.values()):8.0f}  all")
    lines += ["", f"{'cpu s':>8} {'wall s':>8}  module (the {top} that used the most CPU)"]
    for name, (cpu, wall) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{cpu:8.0f} {wall:8.0f}  {name}")
    return lines
