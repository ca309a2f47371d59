"""Booting a test host: an overlay on the cached rootfs under systemd-nspawn with systemd as
PID 1, commands inside it through nsenter, and taking it down without leftovers."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.harness.net import port_free
from tests.harness.procs import (
    CGROUP_ROOTS,
    cgroup_dirs,
    children,
    enter_own_cgroups,
    mounts,
    proc_alive,
    proc_starttime,
    remove_cgroup,
)
from tests.harness.rootfs import build_rootfs, ensure_host_tools
from tests.harness.shell import CLEAN_PATH, TestHostError, locked, log, require_root, run
from tests.harness.ssh import SSHD_DROPIN, install_authorized_key, ssh_banner, ssh_key
from tests.harness.state import HostState


def nsenter_cmd(leader: int, cmd: Sequence[str]) -> list[str]:
    return ["nsenter", "-t", str(leader), "-a", "--", *cmd]


def clean_env() -> dict[str, str]:
    return {"PATH": CLEAN_PATH, "LANG": "C.UTF-8", "TERM": os.environ.get("TERM", "dumb"), "HOME": "/root"}


def host_exec(leader: int, cmd: Sequence[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        nsenter_cmd(leader, cmd), text=True, capture_output=True, env=clean_env(), timeout=timeout, check=False
    )


def write_inventory(st: HostState) -> None:
    host = (
        f"    {st.name}:\n"
        f"      ansible_host: 127.0.0.1\n"
        f"      ansible_port: {st.ssh_port}\n"
        f"      ansible_user: root\n"
        f"      ansible_ssh_private_key_file: {json.dumps(st.key)}\n"
        f"      ansible_ssh_common_args: >-\n"
        f"        -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null\n"
        f"        -o LogLevel=ERROR -o IdentitiesOnly=yes\n"
        f"      ansible_python_interpreter: /usr/bin/python3\n"
    )
    text = f"# Written by tests/harness (nspawn.py) for the test host {st.name}\nall:\n  hosts:\n{host}"
    if st.groups:
        text += "  children:\n"
        for g in st.groups:
            text += f"    {g}:\n      hosts:\n        {st.name}: {{}}\n"
    Path(st.inventory).write_text(text)


def console_tail(st: HostState, lines: int = 40) -> str:
    parts = []
    with contextlib.suppress(OSError):
        log_lines = (st.dir / "console.log").read_text(errors="replace").splitlines()
        parts.append("--- nspawn output (tail) ---\n" + "\n".join(log_lines[-lines:]))
    if st.leader and proc_alive(st.leader, None):
        for cmd in (
            ["systemctl", "--failed", "--no-pager", "--no-legend"],
            ["journalctl", "-b", "--no-pager", "-n", str(lines)],
        ):
            with contextlib.suppress(subprocess.TimeoutExpired):
                r = host_exec(st.leader, cmd, timeout=10)
                parts.append(f"--- {' '.join(cmd)} ---\n{(r.stdout + r.stderr).strip()}")
    return "\n".join(parts)


def parse_bind(spec: str) -> tuple[str, str]:
    src, _, dst = spec.partition(":")
    src_p = Path(src).resolve()
    if not src_p.exists():
        raise TestHostError(f"--bind-ro source does not exist: {src}")
    return str(src_p), dst or str(src_p)


def wait_for(what: str, fn: Any, timeout: float, st: HostState, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = fn()
        if result:
            return result
        if st.pid is not None and not proc_alive(st.pid, st.pid_starttime):
            raise TestHostError(f"systemd-nspawn exited while waiting for {what}\n{console_tail(st)}")
        if time.monotonic() > deadline:
            raise TestHostError(f"timed out after {timeout:.0f}s waiting for {what}\n{console_tail(st)}")
        time.sleep(interval)


def host_up(
    cache: Path,
    base: Path,
    name: str,
    port: int,
    binds: list[str],
    groups: list[str],
    timeout: float,
    owner_pid: int | None,
    keep_on_failure: bool,
) -> HostState:
    require_root()
    sdir = base / name
    with locked(base / f".{name}.lock"):
        old = HostState.load(sdir)
        if old is not None and old.running():
            if old.ssh_port != port:
                raise TestHostError(
                    f"host {name} is already running with ssh port {old.ssh_port} (asked: {port}); run `down` first"
                )
            log(f"host {name} already running (pid {old.pid}); reusing it")
            return old
        if old is not None or sdir.exists() or any(cg.exists() for cg in cgroup_dirs(name)):
            log(f"cleaning up what a previous run of {name} left")
            teardown(base, name)

        ensure_host_tools()
        rootfs = build_rootfs(cache, None)
        if not port_free(port):
            raise TestHostError(f"port 127.0.0.1:{port} is in use on this machine; choose another --ssh-port")
        sdir.mkdir(parents=True)
        st = HostState(
            name=name,
            state_dir=str(sdir),
            ssh_port=port,
            rootfs=str(rootfs),
            key=str(ssh_key(cache)),
            inventory=str(sdir / "inventory.yml"),
            binds=[":".join(parse_bind(b)) for b in binds],
            groups=groups,
            owner_pid=owner_pid,
            owner_starttime=proc_starttime(owner_pid) if owner_pid else None,
        )
        st.save()
        try:
            boot(st, timeout)
        except BaseException:
            if not keep_on_failure:
                log(f"up failed: tearing {name} down")
                teardown(base, name)
            raise
        return st


def boot(st: HostState, timeout: float) -> None:
    t0 = time.monotonic()
    for sub in ("upper", "work", "root"):
        (st.dir / sub).mkdir()
    run(
        [
            "mount",
            "-t",
            "overlay",
            f"testhost-{st.name}",
            "-o",
            f"lowerdir={st.rootfs},upperdir={st.dir / 'upper'},workdir={st.dir / 'work'}",
            st.merged,
        ]
    )
    st.phase = "mounted"
    st.save()
    root = st.merged
    (root / SSHD_DROPIN).parent.mkdir(parents=True, exist_ok=True)
    (root / SSHD_DROPIN).write_text(f"# python -m tests.harness up --ssh-port {st.ssh_port}\nPort {st.ssh_port}\n")
    (root / "etc/hostname").write_text(f"{st.name}\n")
    install_authorized_key(root, Path(st.key))

    cgs = [root_ / f"testhost-{st.name}" for root_ in CGROUP_ROOTS]
    for cg in cgs:
        if not cg.parent.is_dir():
            raise TestHostError(f"cgroup hierarchy {cg.parent} is missing on this host")
        cg.mkdir(exist_ok=True)
    cmd = [
        "systemd-nspawn",
        "-D",
        str(root),
        "-b",
        f"--machine={st.name}",
        "--register=no",
        "--keep-unit",
        "--console=passive",
        # nspawn's own system-call filter denies pidfd_getfd, which a real host allows
        # root (the tritonserver unit's ExecStop takes idle HTTP sockets with it).
        "--system-call-filter=pidfd_getfd",
        *[f"--bind-ro={b}" for b in st.binds],
    ]
    console = (st.dir / "console.log").open("w")
    with console:
        console.write(f"$ {shlex.join(cmd)}\n")
        console.flush()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: enter_own_cgroups(cgs),  # in the child, before exec
            close_fds=True,
        )
    st.pid = proc.pid
    st.pid_starttime = proc_starttime(proc.pid)
    st.phase = "booting"
    st.save()
    log(f"systemd-nspawn pid {proc.pid}; waiting for systemd")

    def leader() -> int | None:
        kids = children(proc.pid, "systemd")
        return kids[0] if kids else None

    st.leader = wait_for("the container's systemd", leader, min(timeout, 60), st)
    st.save()

    # "offline" is also what systemctl says before the new systemd answers on its bus:
    # a failure only once it has had this long to start.
    offline_until = time.monotonic() + 30

    def system_running() -> str | None:
        assert st.leader is not None
        try:
            r = host_exec(st.leader, ["systemctl", "is-system-running"], timeout=10)
        except subprocess.TimeoutExpired:
            return None
        state = r.stdout.strip()
        if state == "offline" and time.monotonic() < offline_until:
            return None
        if state in ("maintenance", "stopping", "offline"):
            raise TestHostError(f"container systemd is {state!r}\n{console_tail(st)}")
        return state if state in ("running", "degraded") else None

    state = wait_for("systemctl is-system-running = running|degraded", system_running, timeout, st)
    if state == "degraded":
        assert st.leader is not None
        failed = host_exec(st.leader, ["systemctl", "--failed", "--no-legend", "--no-pager"]).stdout.strip()
        log(f"system is degraded; failed units:\n{failed}")
    log(f"systemd is {state} after {time.monotonic() - t0:.1f}s")
    wait_for(f"sshd on 127.0.0.1:{st.ssh_port}", lambda: ssh_banner(st.ssh_port), 30, st)
    write_inventory(st)
    st.phase = "running"
    st.save()
    # Reap the Popen object without waiting for nspawn: it keeps running in its own session.
    proc.returncode = 0
    log(f"host {st.name} up in {time.monotonic() - t0:.1f}s (ssh 127.0.0.1:{st.ssh_port})")


def stop_nspawn(st: HostState | None) -> None:
    if st is None or not proc_alive(st.pid, st.pid_starttime):
        return
    assert st.pid is not None
    log(f"stopping systemd-nspawn pid {st.pid}")
    with contextlib.suppress(ProcessLookupError):
        os.kill(st.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and proc_alive(st.pid, st.pid_starttime):
        time.sleep(0.1)
    if proc_alive(st.pid, st.pid_starttime):
        log(f"nspawn {st.pid} ignored SIGTERM for 20s: SIGKILL")
        with contextlib.suppress(ProcessLookupError):
            os.kill(st.pid, signal.SIGKILL)
        for _ in range(100):
            if not proc_alive(st.pid, st.pid_starttime):
                break
            time.sleep(0.1)


def unmount_below(path: Path) -> None:
    prefix = str(path)
    points = sorted(
        {p for p, _ in mounts() if p == prefix or p.startswith(prefix + "/")},
        key=len,
        reverse=True,
    )
    for p in points:
        if run(["umount", p], check=False, capture=True).returncode != 0:
            time.sleep(0.5)
            if run(["umount", p], check=False, capture=True).returncode != 0:
                log(f"umount {p} busy: lazy unmount")
                run(["umount", "-l", p], capture=True)


def teardown(base: Path, name: str) -> bool:
    """Stop and remove everything of host NAME. Returns whether anything existed."""
    sdir = base / name
    st = HostState.load(sdir)
    cgs = cgroup_dirs(name)
    existed = st is not None or sdir.exists() or any(cg.exists() for cg in cgs)
    stop_nspawn(st)
    for cg in cgs:  # anything still running in the host's cgroups (also after a crash)
        remove_cgroup(cg)
    if sdir.exists():
        unmount_below(sdir)
        if any(p == str(sdir) or p.startswith(f"{sdir}/") for p, _ in mounts()):
            raise TestHostError(f"mounts remain below {sdir}; not removing it")
        shutil.rmtree(sdir)
    return existed


def host_down(base: Path, name: str) -> None:
    require_root()
    with locked(base / f".{name}.lock"):
        existed = teardown(base, name)
    (base / f".{name}.lock").unlink(missing_ok=True)
    log(f"host {name} {'removed' if existed else 'was not there'}")
