"""Helpers for the fast Ansible checks: the repository, ansible-playbook, YAML, the recap."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping
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


# -- many preflight cases in one ansible-playbook run, one inventory host per case ------------

# A result line of the default callback: `ok: [host]`, `fatal: [host]: FAILED! =>`,
# `failed: [host] (item=x) =>`, `ok: [host -> localhost] => (item=x)`, `skipping: [host]`.
_RESULT = re.compile(
    r"^(?:ok|changed|fatal|failed|skipping|unreachable|ignored|rescued): \[([^\]\s]+)(?: -> [^\]]*)?\]"
)
# `included: /path/file.yml for host-1, host-2`
_INCLUDED = re.compile(r"^included: (.*) for (.+)$")
_HEADERS = ("PLAY [", "TASK [", "RUNNING HANDLER [", "NO MORE HOSTS LEFT")


def host_view(output: str, host: str, shown_as: str = "localhost") -> str:
    """The output of a multi-host ansible-playbook run as a run on `host` alone would print it.

    Kept: the play and task headers under which `host` has a line, its result lines with their
    indented continuation, the lines printed just before one of its results ([ERROR] blocks,
    `task path:`), lines that belong to no host, and its PLAY RECAP line. Every occurrence
    of `host` is shown as `shown_as`: host names must be tokens that occur nowhere else.
    """
    kept: list[str] = []
    header: list[str] = []  # the headers since the last line kept for this host
    pending: list[str] = []  # lines printed before the next result line, for its host
    owner: str | None = None  # the host whose result the indented lines continue
    in_recap = False

    def keep(lines: list[str]) -> None:
        kept.extend(header)
        header.clear()
        kept.extend(lines)

    for line in output.splitlines():
        if in_recap:
            name = line.split(" : ", 1)[0].strip() if " : " in line and "=" in line else None
            if name is None or name == host:
                kept.append(line)
            continue
        if line.startswith(_HEADERS) or line.startswith("PLAY RECAP"):
            if pending:  # printed for no host in particular (e.g. "skipping: no hosts matched")
                keep(pending)
                pending = []
            owner = None
            if line.startswith("PLAY RECAP"):
                kept.extend(["", line])
                header.clear()
                in_recap = True
            elif line.startswith("PLAY ["):
                header[:] = ["", line]
            else:  # a task this host may have no line under: only the play's header stays
                header[:] = header[:2] if header[1:2] and header[1].startswith("PLAY [") else []
                header.extend(["", line])
            continue
        result = _RESULT.match(line)
        included = _INCLUDED.match(line)
        if result or included:
            hosts = [result.group(1)] if result else [h.strip() for h in included.group(2).split(",")]  # type: ignore[union-attr]
            owner = host if host in hosts else ""
            if owner:
                keep([*pending, f"included: {included.group(1)} for {host}" if included else line])
            pending = []
            continue
        if line.startswith("...ignoring"):
            if owner:
                kept.append(line)
            continue
        if owner is not None and (not line or line[0].isspace()):
            if owner:
                kept.append(line)
            continue
        owner = None
        if line or pending:
            pending.append(line)
    kept.extend(pending)
    return re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w.-])", shown_as, "\n".join(kept).strip("\n") + "\n")


def host_rc(rc: int, view: str) -> int:
    """The exit status a run on the host alone would have: 2 when it failed, 4 when unreachable."""
    counts = parse_recap(view)
    if rc not in (0, 2, 4) or len(counts) != 1:
        return rc or 1  # no recap for the host: the run itself broke
    (host,) = counts.values()
    return 2 if host.get("failed") else 4 if host.get("unreachable") else 0


def host_name(index: int) -> str:
    """The inventory name of the index-th case of a batch: a token found nowhere else in the output."""
    return f"llmhost-case-{index:03d}"


def batch_inventory(cases: list[Mapping[str, Any]]) -> dict[str, Any]:
    """inventory/localhost.yml with one host per case in place of localhost; each host's vars are
    the case's (as host vars: role vars, play vars and set_fact beat them, which -e would not)."""
    source = REPO / "inventory" / "localhost.yml"
    local = load_yaml(source)["all"]["children"]["inference"]["hosts"]["localhost"]
    # As from inventory/localhost.yml: defaults such as llmhost_pki_dir derive from inventory_dir.
    where = {"inventory_file": str(source), "inventory_dir": str(source.parent)}
    hosts = {host_name(i): {**local, **where, **case} for i, case in enumerate(cases)}
    return {"all": {"children": {"inference": {"hosts": hosts}, "monitoring": {"hosts": {key: {} for key in hosts}}}}}


# How long a run of many hosts may take: forty preflight cases are about 200 s of CPU, and
# the workers that run these modules have the smallest CPU weight (tests/conftest.py), so
# such a run took 750 s in a full run while the booted hosts and the e2e servers were busy.
BATCH_TIMEOUT_S = 1800


def ansible_playbook_per_host(cases: list[Mapping[str, Any]], *args: str,
                              timeout: float = BATCH_TIMEOUT_S) -> list[PlaybookRun]:
    """One ansible-playbook run for all cases, one host each; per case what a run of its own prints."""
    return ansible_playbook_on_hosts(batch_inventory(cases), len(cases), *args, timeout=timeout)


def ansible_playbook_on_hosts(
    inventory: Mapping[str, Any], count: int, *args: str, shown_as: str = "localhost",
    timeout: float = BATCH_TIMEOUT_S
) -> list[PlaybookRun]:
    """One ansible-playbook run against `inventory`, whose hosts are host_name(0) to
    host_name(count - 1); per host what a run on it alone prints, the host shown as `shown_as`."""
    with tempfile.TemporaryDirectory(prefix="llmhost-batch-") as tmp:
        path = Path(tmp) / "inventory.json"
        path.write_text(json.dumps(inventory))
        run = ansible_playbook("-i", str(path), *args, timeout=timeout)
    views = [host_view(run.output, host_name(i), shown_as) for i in range(count)]
    return [PlaybookRun(host_rc(run.rc, view), view) for view in views]


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this pytest session that every xdist worker sees."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent / "shared" if os.environ.get("PYTEST_XDIST_WORKER") else base / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    return shared


def runs_once_per_session(
    shared: Path, cases: list[Mapping[str, Any]], run: Any, chunk: int
) -> list[PlaybookRun]:
    """run(cases[i:i + chunk]) for every chunk, each chunk by one xdist worker only: a worker
    takes the chunks no other has taken, then waits for the others' results (kept in shared)."""
    chunks = [cases[i : i + chunk] for i in range(0, len(cases), chunk)]
    paths = [shared / hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest() for c in chunks]

    def fill(cases_of: list[Mapping[str, Any]], path: Path, block: bool) -> None:
        with open(path.with_suffix(".lock"), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
            except BlockingIOError:
                return
            if not path.with_suffix(".json").exists():
                runs = run(cases_of)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps([[r.rc, r.output] for r in runs]))
                tmp.rename(path.with_suffix(".json"))

    for cases_of, path in zip(chunks, paths, strict=True):
        fill(cases_of, path, block=False)
    for cases_of, path in zip(chunks, paths, strict=True):
        fill(cases_of, path, block=True)
    results = [json.loads(path.with_suffix(".json").read_text()) for path in paths]
    return [PlaybookRun(rc, output) for chunk_results in results for rc, output in chunk_results]
