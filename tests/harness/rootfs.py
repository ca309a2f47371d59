"""The pristine Debian 12 root filesystem: built once with debootstrap, cached by recipe."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from tests.harness.apt import host_mirror, write_rootfs_sources
from tests.harness.paths import ROOT
from tests.harness.procs import mounts
from tests.harness.shell import CLEAN_PATH, TestHostError, locked, log, require_root, run
from tests.harness.ssh import install_authorized_key, ssh_key

CACHE_ENV = "LLMHOST_TESTHOST_CACHE"
DEFAULT_CACHE = ROOT / ".cache" / "testhost"
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


def cache_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg).resolve()
    env = os.environ.get(CACHE_ENV)
    return Path(env).resolve() if env else DEFAULT_CACHE


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


def rootfs_key() -> str:
    blob = json.dumps({"suite": SUITE, "packages": sorted(PACKAGES), "recipe": ROOTFS_RECIPE_VERSION})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def rootfs_path(cache: Path) -> Path:
    return cache / f"rootfs-{SUITE}-{rootfs_key()}"


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
        "# tests/harness (rootfs.py): the host shares the build machine's network\n"
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
