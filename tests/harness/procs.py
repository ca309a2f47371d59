"""Processes, mounts and cgroups of the test hosts, read from /proc and /sys/fs/cgroup."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from tests.harness.shell import TestHostError

CGROUP_ROOTS: tuple[Path, ...] = (
    Path("/sys/fs/cgroup/unified"),
    Path("/sys/fs/cgroup/systemd"),
)


def mounts() -> list[tuple[str, str]]:
    """(mount point, super options) of every mount in this mount namespace."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        point = left.split()[4].encode().decode("unicode_escape")
        out.append((point, right))
    return out


def proc_starttime(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])  # field 22 overall: starttime


def proc_alive(pid: int | None, starttime: int | None) -> bool:
    if not pid:
        return False
    st = proc_starttime(pid)
    if st is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and (starttime is None or st == starttime)


def children(pid: int, comm: str | None = None) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and (comm is None or name == comm):
            out.append(int(p.name))
    return out


def cgroup_dirs(name: str) -> list[Path]:
    return [root / f"testhost-{name}" for root in CGROUP_ROOTS if root.is_dir()]


def cgroup_pids(cg: Path) -> set[int]:
    pids: set[int] = set()
    if not cg.is_dir():
        return pids
    for procs in cg.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            pids.update(int(x) for x in procs.read_text().split())
    return pids


def remove_cgroup(cg: Path) -> None:
    """Kill what is left in the cgroup tree, then rmdir it deepest first."""
    if not cg.is_dir():
        return
    for _ in range(50):
        pids = cgroup_pids(cg)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    dirs = sorted((d for d in cg.rglob("*") if d.is_dir()), key=lambda d: len(d.parts), reverse=True)
    for d in [*dirs, cg]:
        for _ in range(50):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise TestHostError(f"cannot remove cgroup {d} (still busy)")


def enter_own_cgroups(dirs: list[Path]) -> None:
    """preexec_fn: move the launching process into its own cgroups."""
    for d in dirs:
        (d / "cgroup.procs").write_text("0\n")
