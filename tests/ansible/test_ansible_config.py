"""Ansible's temporary files on the targets stay out of world-writable directories.

A predictable path in /tmp (the old `remote_tmp = /tmp/.ansible-${USER}/tmp`) lets
another local user create it first and read or replace what root then runs: the
class of CVE-2020-1733. The effective setting is read back from Ansible itself.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

from tests.ansible._helpers import BIN, REPO, ansible_env

WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
SETTINGS = re.compile(r"(ansible_remote_tmp|ANSIBLE_REMOTE_TE?MP|remote_tmp\s*=|ansible_async_dir|ANSIBLE_ASYNC_DIR)")


def shell_settings() -> dict[str, Any]:
    """The sh shell plugin's options as this checkout's ansible.cfg makes them."""
    env = {k: v for k, v in ansible_env().items()
           if k not in ("ANSIBLE_REMOTE_TEMP", "ANSIBLE_REMOTE_TMP", "ANSIBLE_ASYNC_DIR")}
    proc = subprocess.run([str(BIN / "ansible-config"), "dump", "-t", "shell", "--format", "json"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    for plugin in json.loads(proc.stdout):
        if "sh" in plugin:
            return {item["name"]: item for item in plugin["sh"]}
    raise AssertionError(f"no sh shell plugin in {proc.stdout[:2000]}")


def in_world_writable(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in WORLD_WRITABLE)


def test_remote_tmp_is_in_the_remote_users_home() -> None:
    sh = shell_settings()
    remote_tmp = sh["remote_tmp"]
    assert remote_tmp["origin"].endswith("ansible.cfg"), remote_tmp  # stated, not left to a default
    assert remote_tmp["value"] == "~/.ansible/tmp", remote_tmp
    assert not in_world_writable(remote_tmp["value"]), remote_tmp
    # The async job results (hub downloads) too, and no world-readable temporary files.
    assert not in_world_writable(sh["async_dir"]["value"]) and sh["async_dir"]["value"].startswith("~/"), sh
    assert sh["world_readable_temp"]["value"] is False, sh


def test_in_world_writable() -> None:
    assert in_world_writable("/tmp/.ansible-root/tmp") and in_world_writable("/var/tmp")
    assert not in_world_writable("~/.ansible/tmp") and not in_world_writable("/tmpfoo")


def test_nothing_in_the_repository_moves_it() -> None:
    """No inventory, play, role, make target or test host setup overrides those settings
    (ansible_remote_tmp and the environment variables rank above ansible.cfg)."""
    files = [REPO / "ansible.cfg", REPO / "Makefile", *REPO.glob("*.yml"), *REPO.glob("inventory/**/*.yml"),
             *REPO.glob("playbooks/*.yml"), *REPO.glob("roles/**/*.yml"), *REPO.glob("roles/**/*.j2"),
             *REPO.glob("mk/*.mk"), *REPO.glob("lab/*"), *REPO.glob("tests/system/*.py")]
    offenders = []
    for path in files:
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if SETTINGS.search(line) and not line.lstrip().startswith("#"):
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert len(offenders) == 1 and offenders[0].startswith("ansible.cfg:"), offenders
    assert offenders[0].endswith("remote_tmp = ~/.ansible/tmp"), offenders
