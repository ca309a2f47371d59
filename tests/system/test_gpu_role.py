"""The GPU play in the booted Debian 12 host: the driver role's decisions and a CPU host converging.

1. Decisions: the nvidia_driver role runs in check mode over SSH against the booted
   host once per simulated machine (Ubuntu 22.04/24.04, Debian 12; with and without
   an NVIDIA GPU, NVSwitches, Secure Boot, nouveau or an old module loaded), each
   with a fake sysfs tree made inside the host and the distribution overridden; the
   role's plan (package choice, repository, nouveau, reboot decision, skip) is read
   back and checked by the same assertions as tests/ansible/test_nvidia_driver.py.
   One more simulated machine keeps the host's real facts (Debian 12).
2. playbooks/gpu.yml for real on the booted host, which has no NVIDIA GPU: it
   skips with a message, changes nothing, and a second run reports changed=0.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.harness import driver_sim as sim
from tests.harness.booted import BootedHost
from tests.harness.paths import ROOT
from tests.harness.sysfs import Sysfs

FAKE_SYS = "/tmp/llmhost-fakesys"


def test_driver_decisions_for_simulated_hosts(booted_host: BootedHost, tmp_path: Path):
    script = "".join(s.script(f"{FAKE_SYS}/{name}") for name, (s, _) in sim.SCENARIOS.items())
    script += Sysfs(gpus=2).script(f"{FAKE_SYS}/real-facts")
    booted_host.exec(["sh", "-c", script], check=True)
    kernel = booted_host.exec("uname -r", check=True).stdout.strip()

    conn = booted_host.host_vars()
    hosts: dict[str, dict[str, Any]] = {
        name: {**conn, "nvidia_driver_sysfs_root": f"{FAKE_SYS}/{name}", **hostvars}
        for name, (_, hostvars) in sim.SCENARIOS.items()
    }
    hosts["real-facts"] = {**conn, "nvidia_driver_sysfs_root": f"{FAKE_SYS}/real-facts"}
    out = tmp_path / "out"
    out.mkdir()
    output = sim.run_play(sim.write_inventory(tmp_path / "inventory.json", hosts), out)
    got = sim.results(out, list(hosts))
    sim.check_decisions(got, output, kernel)

    real = got["real-facts"]
    assert real["failure"] is None, real
    plan = real["plan"]
    assert plan["distribution"] == "Debian 12" and plan["source"] == "cuda_repo"
    assert plan["packages"] == ["nvidia-driver-pinning-580", "nvidia-open"]
    assert plan["gpus"] == ["0000:18:00.0", "0000:19:00.0"]
    # The host itself: Python's dpkg view found installed packages, none of the driver's.
    assert f"linux-headers-{kernel}" in plan["missing_packages"]
    assert plan["reboot"]["action"] == "stop"
    booted_host.exec(["rm", "-rf", FAKE_SYS], check=True)


def _gpu_play(host: BootedHost, inventory: Path, *extra: str) -> str:
    env = {**os.environ, "ANSIBLE_HOME": str(ROOT / ".cache" / "ansible"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
           "PATH": f"{sim.PLAYBOOK_BIN.parent}:{os.environ.get('PATH', '')}"}
    proc = subprocess.run([str(sim.PLAYBOOK_BIN), "-i", str(inventory), *extra, "playbooks/gpu.yml"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _recap(output: str, host: str) -> dict[str, int]:
    m = re.search(rf"^{re.escape(host)}\s*:\s*(.*)$", output, re.M)
    assert m, output
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_gpu_play_on_a_host_without_nvidia_gpu(booted_host: BootedHost, tmp_path: Path, profile: str):
    pci = booted_host.exec("cat /sys/bus/pci/devices/*/vendor 2>/dev/null", check=False).stdout
    assert "0x10de" not in pci, "the test host has an NVIDIA GPU: this test expects none"
    inventory = booted_host.write_inventory(tmp_path / "inventory.json", groups=["inference"],
                                            group_vars={"llmhost_profile": profile})
    reason = "llmhost_profile is cpu" if profile == "cpu" else "no NVIDIA GPU (PCI vendor 0x10de, class 0x03xxxx)"
    check = _gpu_play(booted_host, inventory, "--check", "--diff")
    assert f"nvidia_driver: nothing to do on {booted_host.name}: {reason}" in check
    first = _gpu_play(booted_host, inventory)
    second = _gpu_play(booted_host, inventory)
    for output in (check, first, second):
        recap = _recap(output, booted_host.name)
        assert recap["changed"] == 0 and recap["failed"] == 0, output
    assert booted_host.exec("test -e /etc/modprobe.d/llmhost-blacklist-nouveau.conf").returncode == 1
    plan_json = json.dumps({"nvidia_driver_enabled": False})
    off = _gpu_play(booted_host, inventory, "-e", plan_json)
    assert f"nvidia_driver: nothing to do on {booted_host.name}: nvidia_driver_enabled is false" in off
