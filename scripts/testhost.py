#!/usr/bin/env python3
"""Booted systemd test hosts for llmhost: Debian 12 under systemd-nspawn.

A pristine Debian 12 root filesystem is built once with debootstrap and cached.
Each host boots a fresh overlayfs copy of it with systemd as PID 1, shares the
host's network, and runs sshd on 127.0.0.1:<port> so that Ansible reaches it the
way it reaches a real server (SSH, become, systemd, apt).

Subcommands (see ``--help`` of each):

    rootfs      build (once) and cache the pristine root filesystem
    up          boot a host (reuses a running host of the same name)
    down        stop a host and remove everything it left (idempotent)
    exec        run a command inside a host, passing its exit status through
    status      JSON for a running host, exit 1 when it is not running
    list        JSON list of the hosts that have state
    gc          take down hosts whose nspawn or whose owner process is gone
    pip-config  the host's pip configuration (find-links, indexes) as JSON

Nothing here names a package mirror: debootstrap uses the first URI of the
host's apt sources for the suite, and those sources are copied into the rootfs.
Only the standard library is used; run it with the system python3 as root.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_ENV = "LLMHOST_TESTHOST_CACHE"
DEFAULT_CACHE = REPO_ROOT / ".cache" / "testhost"

SUITE = "bookworm"
# Bump when the way the rootfs is prepared changes: it is part of the cache key.
ROOTFS_RECIPE_VERSION = 1
PACKAGES: tuple[str, ...] = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "libpam-systemd",
    "python3",
    "python3-venv",
    "python3-pip",
    "python3-apt",
    "libpython3.11",
    "sudo",
    "openssh-server",
    "iproute2",
    "procps",
    "ca-certificates",
    "curl",
    "acl",
    "xz-utils",
    "debian-archive-keyring",
)
# Units that would fight Ansible for the apt lock or are useless in a test host.
MASKED_UNITS: tuple[str, ...] = (
    "apt-daily.timer",
    "apt-daily.service",
    "apt-daily-upgrade.timer",
    "apt-daily-upgrade.service",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    "fstrim.timer",
    "systemd-timesyncd.service",
)
HOST_TOOLS: dict[str, str] = {
    "debootstrap": "debootstrap",
    "systemd-nspawn": "systemd-container",
    "nsenter": "util-linux",
    "ssh-keygen": "openssh-client",
}
CGROUP_ROOTS: tuple[Path, ...] = (
    Path("/sys/fs/cgroup/unified"),
    Path("/sys/fs/cgroup/systemd"),
)
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
SSHD_DROPIN = "etc/ssh/sshd_config.d/00-testhost-port.conf"


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


# --------------------------------------------------------------------------- paths


def cache_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg).resolve()
    env = os.environ.get(CACHE_ENV)
    return Path(env).resolve() if env else DEFAULT_CACHE


def state_base(cache: Path, arg: str | None) -> Path:
    return Path(arg).resolve() if arg else cache / "hosts"


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise TestHostError(f"invalid host name {name!r}: use letters, digits, '.', '_' and '-' (max 63)")
    return name


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- host setup


def require_root() -> None:
    if os.geteuid() != 0:
        raise TestHostError("testhost needs root (debootstrap, mount, systemd-nspawn)")


def ensure_host_tools() -> None:
    missing = sorted({pkg for tool, pkg in HOST_TOOLS.items() if shutil.which(tool) is None})
    if not missing:
        return
    log(f"installing host packages: {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if run(cmd, check=False, env=env).returncode != 0:
        run(["apt-get", "update", "-q"], env=env)
        run(cmd, env=env)
    still = [tool for tool in HOST_TOOLS if shutil.which(tool) is None]
    if still:
        raise TestHostError(f"host tools still missing after install: {', '.join(still)}")


# --------------------------------------------------------------------------- apt sources


@dataclass
class AptSource:
    types: list[str]
    uris: list[str]
    suites: list[str]
    components: list[str]
    signed_by: str | None = None


def _deb822_stanzas(text: str) -> list[dict[str, str]]:
    stanzas: list[dict[str, str]] = []
    current: dict[str, str] = {}
    key: str | None = None
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if current:
                stanzas.append(current)
            current, key = {}, None
            continue
        if raw[0] in " \t" and key is not None:
            current[key] += "\n" + raw.strip()
            continue
        if ":" in raw:
            k, v = raw.split(":", 1)
            key = k.strip().lower()
            current[key] = v.strip()
    if current:
        stanzas.append(current)
    return stanzas


def host_apt_sources() -> list[AptSource]:
    """Every enabled deb source of the host, deb822 files and one-line lists alike."""
    sources: list[AptSource] = []
    d = Path("/etc/apt/sources.list.d")
    for path in sorted(d.glob("*.sources")) if d.is_dir() else []:
        for st in _deb822_stanzas(path.read_text()):
            if st.get("enabled", "yes").lower() == "no":
                continue
            signed = st.get("signed-by")
            sources.append(
                AptSource(
                    types=st.get("types", "").split(),
                    uris=st.get("uris", "").split(),
                    suites=st.get("suites", "").split(),
                    components=st.get("components", "").split(),
                    signed_by=signed if signed and "\n" not in signed else None,
                )
            )
    lists = [Path("/etc/apt/sources.list")]
    lists += sorted(d.glob("*.list")) if d.is_dir() else []
    for path in lists:
        if not path.is_file():
            continue
        for raw in path.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            m = re.match(r"^(deb|deb-src)\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s*(.*)$", line)
            if not m:
                continue
            opts = m.group(2) or ""
            sb = re.search(r"signed-by=(\S+?)[\s\]]", opts + " ")
            sources.append(
                AptSource(
                    types=[m.group(1)],
                    uris=[m.group(3)],
                    suites=[m.group(4)],
                    components=m.group(5).split(),
                    signed_by=sb.group(1) if sb else None,
                )
            )
    return sources


def suite_sources(sources: list[AptSource], suite: str) -> list[AptSource]:
    """Sources for this suite and its companions (-updates, -security, ...)."""
    return [
        s
        for s in sources
        if "deb" in s.types and any(x == suite or x.startswith((f"{suite}-", f"{suite}/")) for x in s.suites)
    ]


def host_mirror(suite: str) -> str:
    for src in suite_sources(host_apt_sources(), suite):
        if suite in src.suites and src.uris:
            return src.uris[0]
    raise TestHostError(f"no apt source for suite {suite!r} in the host's /etc/apt/sources.list(.d): pass --mirror URL")


def write_rootfs_sources(root: Path, suite: str) -> None:
    """Copy the host's apt sources for the suite into the rootfs (deb822)."""
    srcs = suite_sources(host_apt_sources(), suite)
    if not srcs:
        return  # keep debootstrap's sources.list (from --mirror)
    stanzas = []
    for s in srcs:
        lines = [
            "Types: deb",
            f"URIs: {' '.join(s.uris)}",
            f"Suites: {' '.join(x for x in s.suites)}",
            f"Components: {' '.join(s.components) or 'main'}",
        ]
        if s.signed_by:
            key = Path(s.signed_by)
            if key.is_absolute() and key.is_file():
                target = root / key.relative_to("/")
                if not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(key, target)
            lines.append(f"Signed-By: {s.signed_by}")
        stanzas.append("\n".join(lines))
    d = root / "etc/apt/sources.list.d"
    d.mkdir(parents=True, exist_ok=True)
    (d / "testhost-host.sources").write_text(
        "# Copied from the build host's apt sources by scripts/testhost.py\n" + "\n\n".join(stanzas) + "\n"
    )
    (root / "etc/apt/sources.list").unlink(missing_ok=True)


# --------------------------------------------------------------------------- rootfs


def rootfs_key() -> str:
    blob = json.dumps({"suite": SUITE, "packages": sorted(PACKAGES), "recipe": ROOTFS_RECIPE_VERSION})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def rootfs_path(cache: Path) -> Path:
    return cache / f"rootfs-{SUITE}-{rootfs_key()}"


def ssh_key(cache: Path) -> Path:
    key = cache / "id_ed25519"
    if not key.is_file() or not key.with_suffix(".pub").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        key.unlink(missing_ok=True)
        key.with_suffix(".pub").unlink(missing_ok=True)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "llmhost-testhost", "-f", key], capture=True)
    key.chmod(0o600)
    return key


def install_authorized_key(root: Path, key: Path) -> None:
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(parents=True, exist_ok=True)
    ssh_dir.chmod(0o700)
    auth = ssh_dir / "authorized_keys"
    auth.write_text(key.with_suffix(".pub").read_text())
    auth.chmod(0o600)


def mounts() -> list[tuple[str, str]]:
    """(mount point, super options) of every mount in this mount namespace."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        point = left.split()[4].encode().decode("unicode_escape")
        out.append((point, right))
    return out


def prepare_rootfs(root: Path, key: Path) -> None:
    write_rootfs_sources(root, SUITE)
    (root / "etc/hostname").write_text("testhost\n")
    (root / "etc/hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
    (root / "etc/default/locale").write_text("LANG=C.UTF-8\n")
    # An empty machine-id: every boot gets its own (systemd makes a transient one).
    (root / "etc/machine-id").write_text("")
    (root / "var/lib/dbus/machine-id").unlink(missing_ok=True)
    for unit in MASKED_UNITS:
        link = root / "etc/systemd/system" / unit
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    sshd_d = root / "etc/ssh/sshd_config.d"
    sshd_d.mkdir(parents=True, exist_ok=True)
    # The port comes at `up` time (00-testhost-port.conf on the overlay).
    (sshd_d / "10-testhost.conf").write_text(
        "# scripts/testhost.py: the host shares the build machine's network\n"
        "ListenAddress 127.0.0.1\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UseDNS no\n"
    )
    install_authorized_key(root, key)
    env = {"PATH": CLEAN_PATH, "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
    run(["chroot", root, "apt-get", "clean"], env=env)
    (root / "etc/testhost-rootfs").write_text(
        json.dumps({"suite": SUITE, "key": rootfs_key(), "packages": sorted(PACKAGES)}) + "\n"
    )


def build_rootfs(cache: Path, mirror: str | None, force: bool = False) -> Path:
    require_root()
    cache.mkdir(parents=True, exist_ok=True)
    final = rootfs_path(cache)
    with locked(cache / ".rootfs.lock"):
        key = ssh_key(cache)
        if final.is_dir() and not force:
            if (final / "etc/testhost-rootfs").is_file() and (final / "usr/lib/systemd/systemd").exists():
                install_authorized_key(final, key)
                return final
            log(f"{final.name} is incomplete: rebuilding it")
            force = True
        if final.exists() and any(str(final) in opts for _, opts in mounts()):
            raise TestHostError(f"{final} is in use by a running host: take it down first")
        ensure_host_tools()
        mirror = mirror or host_mirror(SUITE)
        tmp = cache / f".{final.name}.tmp-{os.getpid()}"
        for stale in cache.glob(f".{final.name}.tmp-*"):
            log(f"removing interrupted build {stale.name}")
            shutil.rmtree(stale)
        log(f"debootstrap {SUITE} -> {final.name} (about 1-2 min)")
        t0 = time.monotonic()
        try:
            run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(PACKAGES)}",
                    "--components=main",
                    SUITE,
                    tmp,
                    mirror,
                ]
            )
            prepare_rootfs(tmp, key)
            if final.exists():  # --force: swap the old one out
                old = cache / f".{final.name}.old-{os.getpid()}"
                final.rename(old)
                shutil.rmtree(old)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"rootfs ready in {time.monotonic() - t0:.0f}s: {final}")
        prune_rootfs(cache, keep=final)
        return final


def prune_rootfs(cache: Path, keep: Path) -> None:
    """Remove cached root filesystems of older recipes that no overlay uses."""
    in_use = " ".join(opts for _, opts in mounts())
    for old in cache.glob(f"rootfs-{SUITE}-*"):
        if old != keep and old.is_dir() and str(old) not in in_use:
            log(f"removing old rootfs {old.name}")
            shutil.rmtree(old)


# --------------------------------------------------------------------------- processes


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


# --------------------------------------------------------------------------- cgroups


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


# --------------------------------------------------------------------------- host state


@dataclass
class HostState:
    name: str
    state_dir: str
    ssh_port: int
    rootfs: str
    key: str
    inventory: str
    binds: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    pid: int | None = None
    pid_starttime: int | None = None
    leader: int | None = None
    owner_pid: int | None = None
    owner_starttime: int | None = None
    phase: str = "new"

    @property
    def dir(self) -> Path:
        return Path(self.state_dir)

    @property
    def merged(self) -> Path:
        return self.dir / "root"

    def save(self) -> None:
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(self.dir / "state.json")

    @classmethod
    def load(cls, state_dir: Path) -> HostState | None:
        try:
            data = json.loads((state_dir / "state.json").read_text())
        except (OSError, ValueError):
            return None
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    def running(self) -> bool:
        return (
            self.phase == "running"
            and proc_alive(self.pid, self.pid_starttime)
            and self.leader is not None
            and proc_alive(self.leader, None)
        )

    def public(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pid": self.pid,
            "leader": self.leader,
            "ssh_port": self.ssh_port,
            "ssh_key": self.key,
            "inventory": self.inventory,
            "state_dir": self.state_dir,
            "binds": self.binds,
        }


def nsenter_cmd(leader: int, cmd: Sequence[str]) -> list[str]:
    return ["nsenter", "-t", str(leader), "-a", "--", *cmd]


def clean_env() -> dict[str, str]:
    return {"PATH": CLEAN_PATH, "LANG": "C.UTF-8", "TERM": os.environ.get("TERM", "dumb"), "HOME": "/root"}


def host_exec(leader: int, cmd: Sequence[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        nsenter_cmd(leader, cmd), text=True, capture_output=True, env=clean_env(), timeout=timeout, check=False
    )


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ssh_banner(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.settimeout(2)
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


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
    text = f"# Written by scripts/testhost.py for the test host {st.name}\nall:\n  hosts:\n{host}"
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
    (root / SSHD_DROPIN).write_text(f"# scripts/testhost.py up --ssh-port {st.ssh_port}\nPort {st.ssh_port}\n")
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

    def system_running() -> str | None:
        assert st.leader is not None
        try:
            r = host_exec(st.leader, ["systemctl", "is-system-running"], timeout=10)
        except subprocess.TimeoutExpired:
            return None
        state = r.stdout.strip()
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


def running_state(base: Path, name: str) -> HostState:
    st = HostState.load(base / name)
    if st is None or not st.running():
        raise TestHostError(f"host {name} is not running")
    return st


# --------------------------------------------------------------------------- pip


HOST_PIP_CA = "/etc/ssl/llmhost-pip-ca.crt"


def pip_config() -> dict[str, Any]:
    """The host's effective pip index settings, and the local folders they use."""
    r = subprocess.run([sys.executable, "-m", "pip", "config", "list"], text=True, capture_output=True, check=False)
    if r.returncode != 0:
        raise TestHostError(f"`{sys.executable} -m pip config list` failed:\n{r.stderr.strip()}")
    # pip precedence: environment > command section (install) > global section.
    rank = {"global": 1, "install": 2, ":env:": 3}
    best: dict[str, tuple[int, str]] = {}
    for line in r.stdout.splitlines():
        m = re.match(r"^([^.=]+|:env:)\.([A-Za-z0-9_-]+)=(.*)$", line.strip())
        if not m or m.group(1) not in rank:
            continue
        section, key, raw = m.groups()
        try:
            value = str(json.loads(raw)) if raw.startswith('"') else raw.strip("'")
        except ValueError:
            value = raw.strip("'\"")
        key = key.replace("_", "-")
        if key not in best or rank[section] >= best[key][0]:
            best[key] = (rank[section], value)

    def values(key: str) -> list[str]:
        return best[key][1].split() if key in best else []

    find_links = values("find-links")
    extra = values("extra-index-url")
    index = values("index-url")
    binds: list[str] = []

    def local_dir(url: str, index_url: bool) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("", "file"):
            return
        p = Path(unquote(parsed.path)).resolve()
        if not p.exists():
            return
        if p.is_file():
            p = p.parent
        elif index_url and p.name == "simple":
            p = p.parent  # PEP 503 trees link to ../../files and the like
        binds.append(str(p))

    for url in find_links:
        local_dir(url, index_url=False)
    for url in [*extra, *index]:
        local_dir(url, index_url=True)
    unique: list[str] = []
    for b in sorted(set(binds), key=len):
        if not any(b == u or b.startswith(u + "/") for u in unique):
            unique.append(b)
    # A CA bundle pip trusts here (e.g. for an HTTPS proxy or a private index) is
    # bound into the host at a fixed path and handed to the role as python_env_pip_cert.
    cert = values("cert")
    cert_src = str(Path(cert[0]).resolve()) if cert and Path(cert[0]).is_file() else None
    return {
        "find_links": find_links,
        "extra_index_urls": extra,
        "index_url": index[0] if index else None,
        "constraints": values("constraint"),
        "cert": HOST_PIP_CA if cert_src else None,
        "bind": sorted(unique) + ([f"{cert_src}:{HOST_PIP_CA}"] if cert_src else []),
    }


def pip_role_vars(cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "python_env_pip_find_links": cfg["find_links"],
        "python_env_pip_extra_index_urls": cfg["extra_index_urls"],
    }
    if cfg["index_url"]:
        out["python_env_pip_index_url"] = cfg["index_url"]
    if cfg.get("cert"):
        out["python_env_pip_cert"] = cfg["cert"]
    return out


# --------------------------------------------------------------------------- CLI


def cmd_rootfs(a: argparse.Namespace) -> int:
    path = build_rootfs(cache_dir(a.cache), a.mirror, force=a.force)
    print(json.dumps({"rootfs": str(path), "ssh_key": str(ssh_key(cache_dir(a.cache)))}))
    return 0


def cmd_up(a: argparse.Namespace) -> int:
    cache = cache_dir(a.cache)
    binds = list(a.bind_ro)
    if a.pip_binds:
        binds += pip_config()["bind"]
    st = host_up(
        cache,
        state_base(cache, a.state),
        check_name(a.name),
        a.ssh_port,
        binds,
        a.group,
        a.timeout,
        a.owner_pid,
        a.keep_on_failure,
    )
    print(json.dumps(st.public()))
    return 0


def cmd_down(a: argparse.Namespace) -> int:
    cache = cache_dir(a.cache)
    host_down(state_base(cache, a.state), check_name(a.name))
    return 0


def cmd_exec(a: argparse.Namespace) -> int:
    cache = cache_dir(a.cache)
    st = running_state(state_base(cache, a.state), check_name(a.name))
    cmd = list(a.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise TestHostError("exec: no command given (use: exec --name NAME -- CMD...)")
    assert st.leader is not None
    return subprocess.run(nsenter_cmd(st.leader, cmd), env=clean_env(), check=False).returncode


def cmd_status(a: argparse.Namespace) -> int:
    cache = cache_dir(a.cache)
    st = HostState.load(state_base(cache, a.state) / check_name(a.name))
    if st is None or not st.running():
        print(json.dumps({"name": a.name, "running": False}))
        return 1
    assert st.leader is not None
    r = host_exec(st.leader, ["systemctl", "is-system-running"], timeout=10)
    print(json.dumps({**st.public(), "running": True, "system_state": r.stdout.strip()}))
    return 0


def all_states(base: Path) -> list[HostState]:
    out = []
    for d in sorted(base.iterdir()) if base.is_dir() else []:
        st = HostState.load(d) if d.is_dir() else None
        if st is not None:
            out.append(st)
    return out


def cmd_list(a: argparse.Namespace) -> int:
    base = state_base(cache_dir(a.cache), a.state)
    print(json.dumps([{**st.public(), "running": st.running()} for st in all_states(base)]))
    return 0


def cmd_gc(a: argparse.Namespace) -> int:
    base = state_base(cache_dir(a.cache), a.state)
    for st in all_states(base):
        if a.prefix and not st.name.startswith(a.prefix):
            continue
        if st.owner_pid is not None:
            # An owned host may still be booting: only its owner's death makes it garbage.
            if proc_alive(st.owner_pid, st.owner_starttime):
                continue
            reason = f"owner pid {st.owner_pid} is gone"
        elif st.running():
            continue
        else:
            reason = "not running"
        log(f"gc: {st.name} ({reason})")
        host_down(base, st.name)
    return 0


def cmd_pip_config(a: argparse.Namespace) -> int:
    cfg = pip_config()
    if a.vars_file:
        Path(a.vars_file).parent.mkdir(parents=True, exist_ok=True)
        Path(a.vars_file).write_text(json.dumps(pip_role_vars(cfg), indent=2) + "\n")
    print(json.dumps(cfg))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="testhost.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, state: bool = True) -> None:
        sp.add_argument("--cache", help=f"cache dir (default: ${CACHE_ENV} or {DEFAULT_CACHE})")
        if state:
            sp.add_argument("--state", help="directory holding the hosts' state dirs (default: CACHE/hosts)")

    sp = sub.add_parser("rootfs", help="build and cache the pristine Debian rootfs")
    common(sp, state=False)
    sp.add_argument("--mirror", help="debootstrap mirror (default: from the host's apt sources)")
    sp.add_argument("--force", action="store_true", help="rebuild even when cached")
    sp.set_defaults(func=cmd_rootfs)

    sp = sub.add_parser("up", help="boot a host (reuse it when running)")
    common(sp)
    sp.add_argument("--name", required=True)
    sp.add_argument("--ssh-port", type=int, required=True)
    sp.add_argument("--bind-ro", action="append", default=[], metavar="SRC[:DST]")
    sp.add_argument("--pip-binds", action="store_true", help="also bind the folders of the host's pip config")
    sp.add_argument("--group", action="append", default=[], help="inventory group for the host (repeatable)")
    sp.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for boot (default 120)")
    sp.add_argument("--owner-pid", type=int, help="`gc` takes the host down once this process is gone")
    sp.add_argument("--keep-on-failure", action="store_true", help="leave a failed host for debugging")
    sp.set_defaults(func=cmd_up)

    sp = sub.add_parser("down", help="stop a host and remove its state (idempotent)")
    common(sp)
    sp.add_argument("--name", required=True)
    sp.set_defaults(func=cmd_down)

    sp = sub.add_parser("exec", help="run a command inside a host (nsenter)")
    common(sp)
    sp.add_argument("--name", required=True)
    sp.add_argument("cmd", nargs=argparse.REMAINDER)
    sp.set_defaults(func=cmd_exec)

    sp = sub.add_parser("status", help="JSON for a running host; exit 1 when not running")
    common(sp)
    sp.add_argument("--name", required=True)
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("list", help="JSON list of hosts with state")
    common(sp)
    sp.set_defaults(func=cmd_list)

    sp = sub.add_parser("gc", help="take down hosts that are dead or whose owner process is gone")
    common(sp)
    sp.add_argument("--prefix", help="only hosts whose name starts with this")
    sp.set_defaults(func=cmd_gc)

    sp = sub.add_parser("pip-config", help="the host's pip index configuration as JSON")
    sp.add_argument("--vars-file", help="also write the python_env role's pip variables (YAML/JSON) here")
    sp.set_defaults(func=cmd_pip_config)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except TestHostError as exc:
        print(f"testhost: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
