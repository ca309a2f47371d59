"""The nvidia_driver role's decisions, on simulated hosts, without changing this machine.

Each simulated host is this machine reached with ``ansible_connection: local``, with
its own fake sysfs tree (tests.harness.sysfs) and its distribution overridden; the
play, the scenarios and the checks are tests.harness.driver_sim's, shared with
tests/system/test_gpu_role.py, which runs the same play in the booted Debian 12 host
over SSH. Only tmp is written.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.harness.driver_sim import SCENARIOS, UBUNTU24, check_decisions, results, run_play, write_inventory
from tests.harness.paths import ROOT
from tests.harness.sysfs import Sysfs


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict[str, Any]], str]:
    base = tmp_path_factory.mktemp("nvidia-driver")
    hosts = {}
    for name, (sysfs, hostvars) in SCENARIOS.items():
        root = base / "sys" / name
        subprocess.run(["sh", "-c", sysfs.script(str(root))], check=True)
        hosts[name] = {"ansible_connection": "local", "ansible_python_interpreter": "/usr/bin/python3",
                       "nvidia_driver_sysfs_root": str(root), **hostvars}
    out = base / "out"
    out.mkdir()
    output = run_play(write_inventory(base / "inventory.json", hosts), out)
    return results(out, list(SCENARIOS)), output


def test_decisions_per_distribution_and_hardware(local_run: tuple[dict[str, dict[str, Any]], str]):
    got, output = local_run
    check_decisions(got, output, os.uname().release)


def test_fake_sysfs_matches_the_recorded_h100():
    """The tree the tests fake has the shape of a real one: vendor and class as the H100's -q shows."""
    q = (ROOT / "tests" / "fixtures" / "gpu" / "h100-580.159.04-real" / "nvidia-smi-q.txt").read_text()
    assert "Device Id                                      : 0x233010DE" in q  # vendor 0x10de in the low half
    assert "Base Classcode                                 : 0x3" in q and "Sub Classcode" in q


def test_install_configure_and_reboot_decision_in_check_mode(tmp_path: Path):
    """main.yml through install, configure and the reboot decision (service and verify need a real driver),
    with package names this machine has: nothing installed, nothing written outside tmp."""
    root = tmp_path / "sys"
    subprocess.run(["sh", "-c", Sysfs(nvidia_version="580.159.04").script(str(root))], check=True)
    hosts = {"installed": {"ansible_connection": "local", "ansible_python_interpreter": "/usr/bin/python3",
                           "nvidia_driver_sysfs_root": str(root), **UBUNTU24, "sim_tasks_from": "main.yml",
                           "nvidia_driver_packages": ["bash"], "nvidia_driver_kernel_headers": False}}
    before = {p: p.exists() for p in (Path("/etc/modprobe.d/llmhost-blacklist-nouveau.conf"),
                                      Path("/etc/systemd/system/nvidia-persistenced.service.d"))}
    output = run_play(write_inventory(tmp_path / "inventory.json", hosts), tmp_path,
                      ["--tags", "install,configure,reboot", "--diff"])
    got = results(tmp_path, ["installed"])["installed"]
    assert got["failure"] is None, got
    assert got["plan"]["reboot"]["due"] is False
    # This machine has no NVIDIA driver: nvidia-smi fails, so a real run would stop for a reboot.
    reboot = got["reboot"]
    assert reboot["due"] and reboot["action"] == "stop" and reboot["reasons"][0].startswith("nvidia-smi fails")
    assert "check mode: a real run would stop: a reboot is due (nvidia-smi fails" in output
    assert "blacklist nouveau" in output and "--persistence-mode" in output  # the --diff of both files
    assert {p: p.exists() for p in before} == before


def test_argument_specs_cover_every_default():
    import yaml

    role = ROOT / "roles" / "nvidia_driver"
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text())
    options = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert set(defaults) == set(options)
    for name, value in defaults.items():
        assert options[name]["default"] == value, name
        assert options[name].get("description"), name


def test_working_unpackaged_driver_is_adopted_not_overwritten(tmp_path: Path):
    """Seen on the real H100 (device run 2026-11-22): driver 580.159.04 loaded and working, but
    installed by no package. The role must not plan to install packages over it, unless told to."""
    root = tmp_path / "sys"
    subprocess.run(["sh", "-c", Sysfs(nvidia_version="580.159.04").script(str(root))], check=True)
    base = {"ansible_connection": "local", "ansible_python_interpreter": "/usr/bin/python3",
            "nvidia_driver_sysfs_root": str(root), **UBUNTU24, "sim_tasks_from": "preflight.yml"}
    hosts = {"adopt": base, "replace": {**base, "nvidia_driver_adopt_existing": False}}
    run_play(write_inventory(tmp_path / "inventory.json", hosts), tmp_path)
    got = results(tmp_path, ["adopt", "replace"])
    adopt, replace = got["adopt"]["plan"], got["replace"]["plan"]
    assert adopt["unmanaged_driver"] is True
    assert adopt["missing_packages"] == [] and adopt["driver_change"] is False
    assert adopt["reboot"]["due"] is False
    assert replace["unmanaged_driver"] is False and replace["driver_change"] is True
    assert "nvidia-utils-580-server" in replace["missing_packages"]
