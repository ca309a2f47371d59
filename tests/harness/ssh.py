"""SSH into the test hosts: the cached key, root's authorized_keys, sshd's port drop-in and banner."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.harness.shell import run

SSHD_DROPIN = "etc/ssh/sshd_config.d/00-testhost-port.conf"


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


def ssh_banner(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.settimeout(2)
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False
