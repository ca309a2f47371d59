"""What the python_env role puts on a host for the llmhost package. The role's own tasks
that choose the files run for real on this machine (connection local); its pack step
(files/pack_llmhost_sources.py, with the argv of its task) archives exactly that list,
and the archive is unpacked into a temporary directory as the host's unarchive does,
then the unpacked tree is built into a wheel as the host's pip does.

The host gets pyproject.toml and src/llmhost, nothing of lab/ or tests/, and the wheel
holds every module of the package with its templates and data.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.ansible._helpers import REPO, ROLES, ansible_playbook, load_yaml

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the role's tasks run as root")

TASKS = ROLES / "python_env" / "tasks" / "llmhost.yml"
FIRST_HOST_TASK = "Read the digest of the installed llmhost sources"
COPY_TASK = "Copy the llmhost sources"
PACK_TASK = "Pack the llmhost sources on the controller"
PACKER = ROLES / "python_env" / "files" / "pack_llmhost_sources.py"
PACKAGE = REPO / "src" / "llmhost"


def _tasks() -> list[dict]:
    """The file's top-level tasks: the ones that choose the files come first."""
    tasks = load_yaml(TASKS)
    names = [t.get("name") for t in tasks]
    assert FIRST_HOST_TASK in names, names
    return tasks


def _every_task(tasks: list[dict]) -> list[dict]:
    """The tasks, those inside blocks included."""
    return [inner for t in tasks for inner in ([t] if "block" not in t else _every_task(t["block"]))]


def test_the_sources_reach_the_host_as_one_archive_of_the_chosen_files():
    """What the fixture below relies on: the pack step archives the role's own list, and
    the one unarchive puts that archive into the source directory; nothing else copies
    a file of the checkout."""
    every = _every_task(_tasks())
    (pack,) = [t for t in every if t.get("name") == PACK_TASK]
    cmd = " ".join(pack["ansible.builtin.script"]["cmd"].split())
    head = "{{ ([llmhost_source_dir, _python_env_src_scratch.path ~ '/llmhost-src.tar']"
    assert cmd.startswith(f"{PACKER.name} {head}"), cmd
    assert cmd.endswith("+ _python_env_src_files) | map('quote') | join(' ') }}"), cmd
    assert pack["ansible.builtin.script"]["executable"] == "{{ ansible_playbook_python }}"
    assert pack["delegate_to"] == "localhost"
    (copy,) = [t for t in every if t.get("name") == COPY_TASK]
    assert copy["ansible.builtin.unarchive"]["src"] == "{{ _python_env_src_scratch.path }}/llmhost-src.tar"
    assert copy["ansible.builtin.unarchive"]["dest"] == "{{ _python_env_src_dir }}"
    copies = [t for t in every if "ansible.builtin.copy" in t and "src" in t["ansible.builtin.copy"]]
    assert copies == []


def test_the_sources_are_copied_only_when_the_installed_build_is_not_the_checkouts():
    """A converge whose installed build has the checkout's digest runs no task per file:
    the copy sits in a block that runs only when the digest differs or llmhost is missing."""
    tasks = _tasks()
    (decide,) = [t for t in tasks if "_python_env_src_stale" in t.get("ansible.builtin.set_fact", {})]
    rule = decide["ansible.builtin.set_fact"]["_python_env_src_stale"]
    assert "_python_env_step_llmhost_missing" in rule and "!= _python_env_src_digest" in rule, rule
    (block,) = [t for t in tasks if "block" in t and COPY_TASK in [b.get("name") for b in _every_task(t["block"])]]
    assert block["when"] == "_python_env_src_stale | bool"
    names = [b.get("name") for b in block["block"]]
    assert "Pip-install the llmhost sources" in names and "Record the digest of the installed sources" in names


@pytest.fixture(scope="module")
def landed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files the role copies (its own list, _python_env_src_files), copied here."""
    tmp = tmp_path_factory.mktemp("package-sources")
    tasks = _tasks()
    choose = tasks[: [t.get("name") for t in tasks].index(FIRST_HOST_TASK)]
    listed = tmp / "files.json"
    choose.append({"name": "Write the list down", "ansible.builtin.copy": {
        "content": "{{ _python_env_src_files | to_json }}", "dest": str(listed), "mode": "0644"}})
    (tmp / "choose.yml").write_text(yaml.safe_dump(choose, sort_keys=False))
    play = [{"name": "Choose the llmhost sources as python_env does", "hosts": "all", "gather_facts": False,
             "tasks": [{"name": "The role's tasks", "ansible.builtin.include_tasks": str(tmp / "choose.yml")}]}]
    (tmp / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    extra = {"llmhost_source_dir": str(REPO), "ansible_python_interpreter": sys.executable}
    run = ansible_playbook("-i", "localhost,", "-c", "local", "-e", json.dumps(extra), str(tmp / "play.yml"))
    assert run.rc == 0, run.output[-3000:]
    archive = tmp / "llmhost-src.tar"
    subprocess.run([sys.executable, "-I", str(PACKER), str(REPO), str(archive), *json.loads(listed.read_text())],
                   check=True, timeout=120)
    dest = tmp / "src" / "llmhost"
    dest.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        assert {(m.uid, m.gid, m.mode) for m in members if m.isfile()} == {(0, 0, 0o644)}
        assert {(m.uid, m.gid, m.mode) for m in members if m.isdir()} == {(0, 0, 0o755)}
        tar.extractall(dest, filter="data")
    return dest


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_the_host_gets_the_package_and_nothing_of_lab_or_tests(landed: Path):
    files = _files(landed)
    assert "pyproject.toml" in files and "src/llmhost/cli.py" in files, sorted(files)[:20]
    strays = sorted(f for f in files if f != "pyproject.toml" and f != "LICENSE" and not f.startswith("src/llmhost/"))
    assert strays == []
    assert not [f for f in files if f.startswith(("lab/", "tests/")) or "/lab/" in f or "gpucheck" in f]


def test_every_module_template_and_data_file_of_the_package_lands(landed: Path):
    wanted = {f"src/llmhost/{f}" for f in _files(PACKAGE)
              if "__pycache__" not in f and f.endswith((".py", ".j2", ".json"))}
    assert wanted - _files(landed) == set()


def test_the_wheel_built_on_the_host_holds_the_package_alone(landed: Path, tmp_path: Path):
    """pip on the host builds from the copied tree: the wheel has every module, the Triton
    templates and the CUDA matrix, and no top-level name but llmhost."""
    build = tmp_path / "tree"
    shutil.copytree(landed, build)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "--no-input", "-q", "-w", str(tmp_path / "out"),
                           str(build)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "out").glob("llmhost-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"llmhost"}, top
    modules = {f"llmhost/{f}" for f in _files(PACKAGE)
               if "__pycache__" not in f and f.endswith((".py", ".j2", ".json"))}
    assert modules - names == set()
    assert "llmhost/server/templates/tritonserver.args.j2" in names
    assert "llmhost/data/cuda_matrix.json" in names


@pytest.mark.parametrize("name", ["../pyproject.toml", "/etc/passwd", "src/llmhost", "src/llmhost/no_such_module.py"])
def test_the_pack_step_refuses_what_is_not_a_file_of_the_checkout(name: str, tmp_path: Path):
    argv = [sys.executable, "-I", str(PACKER), str(REPO), str(tmp_path / "x.tar"), "pyproject.toml", name]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and f"not a file under {REPO}: {name}" in proc.stderr, proc.stderr
    assert not (tmp_path / "x.tar").exists()
