"""A test host's state on disk (state.json in its state directory) and the hosts that have one."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.harness.procs import proc_alive
from tests.harness.shell import TestHostError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def state_base(cache: Path, arg: str | None) -> Path:
    return Path(arg).resolve() if arg else cache / "hosts"


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise TestHostError(f"invalid host name {name!r}: use letters, digits, '.', '_' and '-' (max 63)")
    return name


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


def all_states(base: Path) -> list[HostState]:
    out = []
    for d in sorted(base.iterdir()) if base.is_dir() else []:
        st = HostState.load(d) if d.is_dir() else None
        if st is not None:
            out.append(st)
    return out


def running_state(base: Path, name: str) -> HostState:
    st = HostState.load(base / name)
    if st is None or not st.running():
        raise TestHostError(f"host {name} is not running")
    return st
