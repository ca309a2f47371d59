"""Helpers for the fast Ansible checks: the repository, ansible-playbook, YAML, the recap."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.paths import ROOT

REPO = ROOT
ROLES = REPO / "roles"
BIN = Path(sys.executable).parent


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def role_names() -> list[str]:
    return sorted(p.name for p in ROLES.iterdir() if (p / "tasks" / "main.yml").is_file())


@dataclass
class PlaybookRun:
    rc: int
    output: str

    def recap(self) -> dict[str, dict[str, int]]:
        return parse_recap(self.output)

    def failure(self) -> str:
        """The output from the first failed task on, as one line (see unwrap)."""
        assert self.rc != 0, f"the play passed but should have failed:\n{self.output}"
        starts = [i for i in (self.output.find("fatal: ["), self.output.find("failed: [")) if i >= 0]
        assert starts, self.output
        return unwrap(self.output[min(starts) :])


def unwrap(output: str) -> str:
    """Output as one line: the YAML callback wraps long messages and doubles quotes in them."""
    return " ".join(output.split()).replace("''", "'")


def parse_recap(output: str) -> dict[str, dict[str, int]]:
    """{host: {ok: N, changed: N, ...}} from the PLAY RECAP of ansible-playbook."""
    hosts: dict[str, dict[str, int]] = {}
    lines = output.splitlines()
    try:
        start = max(i for i, line in enumerate(lines) if line.startswith("PLAY RECAP"))
    except ValueError:
        return hosts
    for line in lines[start + 1 :]:
        if " : " not in line or "=" not in line:
            continue
        host, _, counts = line.partition(" : ")
        hosts[host.strip()] = {k: int(v) for k, v in (kv.split("=") for kv in counts.split())}
    return hosts


def ansible_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_HOME=str(REPO / ".cache" / "ansible"),
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        PYTHONUNBUFFERED="1",
    )
    return env


def ansible_playbook(*args: str, timeout: float = 300) -> PlaybookRun:
    exe = BIN / "ansible-playbook"
    if not exe.is_file():
        pytest.fail(f"{exe} is missing: ansible-core belongs in the test extra (make setup)")
    proc = subprocess.run(
        [str(exe), *args],
        cwd=REPO,
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return PlaybookRun(proc.returncode, proc.stdout + proc.stderr)
