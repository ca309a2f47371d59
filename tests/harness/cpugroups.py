"""Each pytest worker in control groups of its own: what its tests cost, and what share
of the CPU they get.

Every process a worker starts (tritonserver, vLLM, Ansible, a booted host's systemd
and its services) inherits the worker's groups: systemd-nspawn moves a booted host only
in the systemd hierarchies, and the host's systemd cannot move its processes in the
others. So:

- the cpuacct group's counter is the CPU that the worker's tests cost, whatever ran it.
  A test's share is the counter's growth from the end of the previous test's report to
  the end of its own (its fixtures' setup and teardown included), kept in its reports as
  the user property CPU_SECONDS; the controller adds them up by folder and by module.
- the cpu group's weight (cpu.shares) is the worker's claim on the CPU when the cores
  are busy, for all its processes together. Nice values cannot do that here: with the
  kernel's autogroups, each session (a booted host, a server started in a session of its
  own) is scheduled as a group of its own, and a nice value weighs only within its
  session.

On a machine without writable cgroup v1 cpu and cpuacct hierarchies (not root, cgroup
v2 only) nothing is measured or weighted, and nothing is printed.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CGROUP_V1 = Path("/sys/fs/cgroup")
GROUP_PREFIX = "llmhost-tests-"
CPU_SECONDS = "cpu_seconds"


@dataclass
class Group:
    """The cpuacct and cpu groups this process moved into (with what it starts from then on)."""

    accounting: Path
    weighting: Path | None

    @classmethod
    def join(cls, name: str, root: Path = CGROUP_V1) -> Group | None:
        """Create GROUP_PREFIX+NAME under ROOT's cpuacct and cpu hierarchies and move this
        process into both; None where it cannot be accounted for."""
        paths: dict[str, Path | None] = {}
        for hierarchy in ("cpuacct", "cpu"):
            path = root / hierarchy / f"{GROUP_PREFIX}{name}"
            try:
                path.mkdir(exist_ok=True)
                (path / "cgroup.procs").write_text(f"{os.getpid()}\n")
            except OSError:
                paths[hierarchy] = None
            else:
                paths[hierarchy] = path
        accounting = paths["cpuacct"]
        return cls(accounting, paths["cpu"]) if accounting is not None else None

    def seconds(self) -> float:
        """CPU time used by the group's processes so far, those that have ended included."""
        return int((self.accounting / "cpuacct.usage").read_text()) / 1e9

    def weigh(self, shares: int) -> bool:
        """Set the group's CPU weight; False where there is no cpu group."""
        if self.weighting is None:
            return False
        try:
            (self.weighting / "cpu.shares").write_text(f"{shares}\n")
        except OSError:
            return False
        return True

    def leave(self, root: Path = CGROUP_V1) -> None:
        """Back to the root groups; each group is removed once no process is left in it."""
        for path in (self.accounting, self.weighting):
            if path is None:
                continue
            with contextlib.suppress(OSError):
                (root / path.parent.name / "cgroup.procs").write_text(f"{os.getpid()}\n")
            with contextlib.suppress(OSError):
                path.rmdir()


def folder_of(nodeid: str) -> str:
    """tests/e2e/test_x.py::t -> tests/e2e."""
    path = nodeid.split("::", 1)[0]
    return path.rsplit("/", 1)[0] if "/" in path else path


Table = dict[str, list[float]]


def totals(reports: Iterable[Any]) -> tuple[Table, Table, Table]:
    """{folder: [cpu seconds, wall seconds]}, {module: [...]} and {test: [...]}, from the
    reports' CPU_SECONDS properties and durations (setup, call and teardown of every test;
    a module-scoped fixture's start counts to the test that started it)."""
    folders: Table = defaultdict(lambda: [0.0, 0.0])
    modules: Table = defaultdict(lambda: [0.0, 0.0])
    tests: Table = defaultdict(lambda: [0.0, 0.0])
    for report in reports:
        cpu = sum(float(v) for k, v in getattr(report, "user_properties", ()) if k == CPU_SECONDS)
        wall = float(getattr(report, "duration", 0.0) or 0.0)
        if not cpu and not wall:
            continue
        module = report.nodeid.split("::", 1)[0]
        for table, key in ((folders, folder_of(report.nodeid)), (modules, module), (tests, report.nodeid)):
            table[key][0] += cpu
            table[key][1] += wall
    return dict(folders), dict(modules), dict(tests)


def summary(reports: Iterable[Any], top: int = 25) -> list[str]:
    """Lines for the terminal: CPU and wall seconds by folder, then the TOP modules and the
    TOP tests by CPU."""
    folders, modules, tests = totals(reports)
    if not any(cpu for cpu, _ in folders.values()):
        return []
    lines = [f"{'cpu s':>8} {'wall s':>8}  folder"]
    for name, (cpu, wall) in sorted(folders.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{cpu:8.0f} {wall:8.0f}  {name}")
    lines.append(f"{sum(c for c, _ in folders.values()):8.0f} {sum(w for _, w in folders.values()):8.0f}  all")
    lines += ["", f"{'cpu s':>8} {'wall s':>8}  module (the {top} that used the most CPU)"]
    for name, (cpu, wall) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{cpu:8.0f} {wall:8.0f}  {name}")
    lines += ["", f"{'cpu s':>8} {'wall s':>8}  test (the {top} that used the most CPU)"]
    for name, (cpu, wall) in sorted(tests.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{cpu:8.0f} {wall:8.0f}  {name}")
    return lines
