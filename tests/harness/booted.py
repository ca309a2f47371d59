"""A booted Debian 12 host with systemd as PID 1, for the system tests.

Thin, typed wrapper around ``python -m tests.harness`` (tests/harness/cli.py:
systemd-nspawn + overlayfs, sshd on 127.0.0.1:<port>), run as a child process.
The system tests drive it the way an operator drives a real server: Ansible
over SSH with the inventory written here, then checks with ``exec`` (nsenter)
or ``ssh``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness.net import free_port
from tests.harness.paths import ROOT
from tests.harness.pipconf import pip_role_vars

# The test host tool, run from the repository's root with this interpreter (it is stdlib-only).
TESTHOST = [sys.executable, "-m", "tests.harness"]
NAME_PREFIX = "llmhost-sys-"
ROOTFS_TIMEOUT_S = 900.0
UP_TIMEOUT_S = 300.0
DOWN_TIMEOUT_S = 120.0


class HostError(RuntimeError):
    """The test host tool failed; the message carries its stderr."""


@dataclass(frozen=True)
class Stop:
    """How ``BootedHost.stop_unit`` went: its length, the unit's Result after it
    ("success", "timeout", ...), and the unit's processes (``unit_report``) when the
    stop was still going after one TimeoutStopSec, else empty."""

    seconds: float
    result: str
    report: str


def _seconds(span: str) -> float:
    """systemd's time span as `systemctl show` prints it ("1min 15s", "75s", "infinity")."""
    if span == "infinity":
        raise HostError("the unit has no stop timeout (TimeoutStopSec=infinity)")
    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
    total = 0.0
    for part in span.split():
        number = part.rstrip("abcdefghijklmnopqrstuvwxyz")
        total += float(number) * units[part[len(number):] or "s"]
    return total


def testhost(*args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``python -m tests.harness ARGS`` with this interpreter."""
    cmd = [*TESTHOST, *args]
    try:
        proc = subprocess.run(cmd, text=True, capture_output=True, timeout=timeout, check=False, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        raise HostError(f"timed out after {timeout:.0f}s: {' '.join(cmd)}\n{err}") from exc
    if check and proc.returncode != 0:
        raise HostError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stderr ---\n{proc.stderr}\n--- stdout ---\n{proc.stdout}"
        )
    return proc


def pip_config() -> dict[str, Any]:
    """The machine's pip configuration as ``python -m tests.harness pip-config`` reads it."""
    return dict(json.loads(testhost("pip-config", timeout=60).stdout))


@dataclass
class BootedHost:
    """A running test host. ``stop()`` is idempotent."""

    name: str
    ssh_port: int
    inventory: Path
    ssh_key: Path
    state_dir: Path
    pid: int
    leader: int
    pip_config: dict[str, Any]
    pip_vars_file: Path
    stopped: bool = field(default=False, init=False)

    # -- lifecycle -------------------------------------------------------------------

    @classmethod
    def start(cls, name: str | None = None, ssh_port: int | None = None, attempts: int = 3) -> BootedHost:
        """Build/reuse the cached rootfs and boot a fresh host; raise HostError on failure."""
        name = name or f"{NAME_PREFIX}{os.getpid()}"
        # Hosts left by a test session that was killed (SIGKILL, OOM) before its finalizer ran.
        testhost("gc", "--prefix", NAME_PREFIX, timeout=DOWN_TIMEOUT_S)
        testhost("rootfs", timeout=ROOTFS_TIMEOUT_S)
        cfg = pip_config()
        try:
            return cls._boot(name, ssh_port, attempts, cfg)
        except BaseException:
            # `up` cleans up after itself, unless it was killed (a timeout, Ctrl-C).
            testhost("down", "--name", name, timeout=DOWN_TIMEOUT_S, check=False)
            raise

    @classmethod
    def _boot(cls, name: str, ssh_port: int | None, attempts: int, cfg: dict[str, Any]) -> BootedHost:
        last: HostError | None = None
        for _ in range(attempts):
            port = ssh_port or free_port()
            args = ["up", "--name", name, "--ssh-port", str(port), "--owner-pid", str(os.getpid())]
            for b in cfg["bind"]:
                args += ["--bind-ro", b]
            try:
                info = json.loads(testhost(*args, timeout=UP_TIMEOUT_S).stdout)
            except HostError as exc:
                last = exc
                if ssh_port is None and "is in use" in str(exc):
                    continue  # lost the race for the free port: take another one
                raise
            state_dir = Path(info["state_dir"])
            vars_file = state_dir / "pip.yml"
            vars_file.write_text(json.dumps(pip_role_vars(dict(cfg)), indent=2) + "\n")
            return cls(
                name=info["name"],
                ssh_port=int(info["ssh_port"]),
                inventory=Path(info["inventory"]),
                ssh_key=Path(info["ssh_key"]),
                state_dir=state_dir,
                pid=int(info["pid"]),
                leader=int(info["leader"]),
                pip_config=cfg,
                pip_vars_file=vars_file,
            )
        assert last is not None
        raise last

    def stop(self) -> None:
        if self.stopped:
            return
        testhost("down", "--name", self.name, timeout=DOWN_TIMEOUT_S)
        self.stopped = True

    def running(self) -> bool:
        return testhost("status", "--name", self.name, timeout=30, check=False).returncode == 0

    # -- running things inside ---------------------------------------------------------

    def exec(
        self, cmd: str | Sequence[str], *, timeout: float = 300.0, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Run CMD inside the host (nsenter into all its namespaces, clean environment).

        A string runs through ``sh -c``. Output is captured as text; the exit status
        is the command's own.
        """
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        proc = subprocess.run(
            [*TESTHOST, "exec", "--name", self.name, "--", *argv],
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise HostError(f"in {self.name}: {argv} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def unit_props(self, unit: str, *names: str, timeout: float = 300.0) -> dict[str, str]:
        """The unit's properties NAMES, read in one ``systemctl show``."""
        r = self.exec(["systemctl", "show", unit, *[f"--property={n}" for n in names]], check=True, timeout=timeout)
        return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)

    def unit_pids(self, unit: str) -> set[int]:
        """Every process in the unit's control group (any cgroup layout)."""
        cg = self.unit_props(unit, "ControlGroup")["ControlGroup"]
        if not cg:
            return set()
        r = self.exec(f"for d in /sys/fs/cgroup/unified /sys/fs/cgroup/systemd /sys/fs/cgroup; do "
                      f"f=$d{cg}/cgroup.procs; if [ -r $f ]; then cat $f; exit 0; fi; done")
        return {int(p) for p in r.stdout.split()}

    def stop_unit(self, unit: str) -> Stop:
        """``systemctl stop UNIT`` as an operator would, bounded by what systemd itself
        promises: each of its stop phases lasts at most the unit's TimeoutStopSec, and
        there are five when processes outlive SIGKILL (ExecStop, SIGTERM, SIGKILL, then
        the final SIGTERM and SIGKILL; systemd then gives up and marks the unit failed).
        Returns how the stop went; a stop still going after one TimeoutStopSec gets a
        report of the unit's processes then (see unit_report). Past the bound (and a
        minute more), fails with that report."""
        phase = _seconds(self.unit_props(unit, "TimeoutStopUSec", timeout=60)["TimeoutStopUSec"])
        bound = 5 * phase + 60
        began = time.monotonic()
        report = ""
        self.exec(["systemctl", "stop", "--no-block", unit], check=True, timeout=60)
        while time.monotonic() - began < bound:
            state = self.unit_props(unit, "ActiveState", "Result", timeout=60)
            if state["ActiveState"] in ("inactive", "failed"):
                return Stop(seconds=time.monotonic() - began, result=state["Result"], report=report)
            if not report and time.monotonic() - began > phase:
                report = self.unit_report(unit)
            time.sleep(1)
        raise HostError(f"in {self.name}: `systemctl stop {unit}` not done after {bound:.0f} s "
                        f"(5 x TimeoutStopSec + 60 s):\n{self.unit_report(unit)}")

    def unit_report(self, unit: str) -> str:
        """What to read when a unit misbehaves: its status and journal, then each of its
        processes (unit_pids) with its state, the threads not sleeping interruptibly
        (state, kernel wait channel) and its kernel stack: a process that outlives
        SIGKILL shows where the kernel holds it."""
        pids = " ".join(str(p) for p in sorted(self.unit_pids(unit)))
        script = f"""
systemctl status --no-pager {unit} | head -20
journalctl -u {unit} -n 60 --no-pager -o short-precise
echo "--- processes of {unit}"
for p in {pids}; do
  echo "== pid $p: $(tr '\\0' ' ' < /proc/$p/cmdline 2>/dev/null | cut -c1-160 | sed 's/ *$//')"
  grep -E '^(State|PPid|Threads|VmRSS)' /proc/$p/status 2>/dev/null | tr '\\n\\t' '  '; echo
  for t in /proc/$p/task/*; do
    st=$(cut -d' ' -f3 $t/stat 2>/dev/null)
    [ "$st" = S ] || echo "   thread ${{t##*/}} $st $(cat $t/wchan 2>/dev/null) $(cat $t/comm 2>/dev/null)"
  done
  sed 's/^/   /' /proc/$p/stack 2>&1 | head -25
done
"""
        why = self.exec(["sh", "-c", script], timeout=60)
        return f"{why.stdout[-16000:]}\n{why.stderr[-2000:]}"

    def popen(self, cmd: str) -> subprocess.Popen[str]:
        """Start ``sh -c CMD`` inside the host without waiting; its stdin, stdout and
        stderr are text pipes (``communicate()`` sends input and collects output)."""
        return subprocess.Popen(
            [*TESTHOST, "exec", "--name", self.name, "--", "sh", "-c", cmd],
            cwd=ROOT,
            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )

    def ssh(self, cmd: str, *, timeout: float = 300.0, check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run CMD as root over SSH (the way Ansible reaches the host)."""
        argv = [
            "ssh",
            "-i",
            str(self.ssh_key),
            "-p",
            str(self.ssh_port),
            *self.ssh_options(),
            "root@127.0.0.1",
            cmd,
        ]
        proc = subprocess.run(argv, text=True, capture_output=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise HostError(f"ssh {self.name}: {cmd!r} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    # -- Ansible -----------------------------------------------------------------------

    @staticmethod
    def ssh_options() -> list[str]:
        return [
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
        ]

    def host_vars(self) -> dict[str, Any]:
        """Connection variables of this host (the same as in ``self.inventory``)."""
        return {
            "ansible_host": "127.0.0.1",
            "ansible_port": self.ssh_port,
            "ansible_user": "root",
            "ansible_ssh_private_key_file": str(self.ssh_key),
            "ansible_ssh_common_args": " ".join(self.ssh_options()),
            "ansible_python_interpreter": "/usr/bin/python3",
        }

    def write_inventory(
        self,
        path: Path,
        groups: Sequence[str] = (),
        group_vars: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write an inventory (YAML) with this host in GROUPS and GROUP_VARS on ``all``."""
        inv: dict[str, Any] = {"all": {"hosts": {self.name: self.host_vars()}}}
        if groups:
            inv["all"]["children"] = {g: {"hosts": {self.name: {}}} for g in groups}
        if group_vars:
            inv["all"]["vars"] = dict(group_vars)
        path.write_text(json.dumps(inv, indent=2) + "\n")  # JSON is YAML
        return path

    def ansible_args(self) -> list[str]:
        """``-i <inventory> -e @<pip vars>`` for ansible-playbook against this host."""
        return ["-i", str(self.inventory), "-e", f"@{self.pip_vars_file}"]
