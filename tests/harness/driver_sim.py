"""The nvidia_driver role's decisions on simulated hosts: the play, the scenarios, the checks.

Each simulated host is a machine (this one over ``ansible_connection: local``, or the
booted test host over SSH) with its own fake sysfs tree (tests.harness.sysfs) and its
distribution overridden through the role's ``_nvidia_driver_distribution*`` variables.
The play runs in check mode and writes what the role decided (its plan, the reboot
decision, a failure) to a JSON file per host. tests/ansible/test_nvidia_driver.py runs
it here, tests/system/test_gpu_role.py in the booted Debian 12 host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.harness.paths import ROOT
from tests.harness.sysfs import Sysfs

PLAYBOOK_BIN = next((p for p in (Path(sys.executable).parent / "ansible-playbook",
                                  ROOT / ".venv" / "bin" / "ansible-playbook") if p.is_file()),
                    ROOT / ".venv" / "bin" / "ansible-playbook")

PLAY = """\
---
- name: nvidia_driver decisions on simulated hosts
  hosts: all
  gather_facts: true
  gather_subset: [min]
  tasks:
    - name: Run the role
      block:
        # Tagged always: they run with any --tags; the role's tasks keep their own tags.
        - name: The nvidia_driver role
          tags: [always]
          ansible.builtin.include_role:
            name: nvidia_driver
            tasks_from: "{{ sim_tasks_from | default('preflight.yml') }}"
          vars:
            _nvidia_driver_distribution: "{{ sim_distribution | default(ansible_facts['distribution']) }}"
            _nvidia_driver_distribution_version: "{{ sim_version | default(ansible_facts['distribution_version']) }}"
      rescue:
        - name: Record the failure
          tags: [always]
          ansible.builtin.set_fact:
            sim_failure:
              task: "{{ ansible_failed_task.name }}"
              msg: >-
                {{ ([ansible_failed_result.msg | default('')] + (ansible_failed_result.results | default([])
                    | selectattr('failed', 'defined') | selectattr('failed') | map(attribute='msg') | list))
                   | join(' | ') }}
      always:
        - name: Write what the role decided
          tags: [always]
          ansible.builtin.copy:
            content: >-
              {{ {'plan': _nvidia_driver_plan | default(none), 'reboot': _nvidia_driver_reboot | default(none),
                  'failure': sim_failure | default(none)} | to_json }}
            dest: "{{ sim_out }}/{{ inventory_hostname }}.json"
            mode: "0644"
          delegate_to: localhost
          check_mode: false
"""


# name -> (fake sysfs, host variables)
UBUNTU24 = {"sim_distribution": "Ubuntu", "sim_version": "24.04"}
UBUNTU22 = {"sim_distribution": "Ubuntu", "sim_version": "22.04"}
DEBIAN12 = {"sim_distribution": "Debian", "sim_version": "12.7"}
SCENARIOS: dict[str, tuple[Sysfs, dict[str, Any]]] = {
    "ubuntu24-gpu": (Sysfs(nouveau_loaded=True), UBUNTU24),
    "ubuntu22-cuda-repo": (Sysfs(gpus=2), {**UBUNTU22, "nvidia_driver_source": "cuda_repo",
                                            "nvidia_driver_kernel_modules": "proprietary",
                                            "nvidia_driver_allow_reboot": True}),
    "debian12-gpu": (Sysfs(), DEBIAN12),
    "debian12-distro": (Sysfs(), {**DEBIAN12, "nvidia_driver_source": "distro"}),
    "hgx-fabricmanager": (Sysfs(gpus=4, nvswitches=2), {**UBUNTU24, "nvidia_driver_fabricmanager": True}),
    "fabricmanager-no-nvswitch": (Sysfs(), {**UBUNTU24, "nvidia_driver_fabricmanager": True}),
    "secure-boot": (Sysfs(secure_boot=True), UBUNTU24),
    "secure-boot-off": (Sysfs(secure_boot=False), UBUNTU24),
    # Packages already installed (names this machine has), module loaded: nothing to do.
    "installed-loaded": (Sysfs(nvidia_version="580.159.04"),
                         {**UBUNTU24, "nvidia_driver_packages": ["bash", "coreutils"],
                          "nvidia_driver_kernel_headers": False}),
    "installed-old-module": (Sysfs(nvidia_version="535.247.01"),
                             {**UBUNTU24, "nvidia_driver_packages": ["bash"], "nvidia_driver_kernel_headers": False}),
    "no-gpu": (Sysfs(gpus=0), UBUNTU24),
    "profile-cpu": (Sysfs(), {**UBUNTU24, "llmhost_profile": "cpu"}),
    "disabled": (Sysfs(), {**UBUNTU24, "nvidia_driver_enabled": False}),
    "ubuntu20-gpu": (Sysfs(), {"sim_distribution": "Ubuntu", "sim_version": "20.04"}),
    "debian-distro-fabricmanager": (Sysfs(gpus=8, nvswitches=4), {**DEBIAN12, "nvidia_driver_source": "distro",
                                                                  "nvidia_driver_fabricmanager": True}),
    "bad-source": (Sysfs(), {**UBUNTU24, "nvidia_driver_source": "ppa"}),
    "bad-branch": (Sysfs(), {**UBUNTU24, "nvidia_driver_branch": "latest"}),
}
CUDA_ROOT = "https://developer.download.nvidia.com/compute/cuda/repos"


def run_play(inventory: Path, out: Path, extra: list[str] | None = None, timeout: float = 600) -> str:
    """Run the decision play in check mode; return its output (the results are in OUT/*.json)."""
    play = out / "play.yml"
    play.write_text(PLAY)
    env = {**os.environ, "ANSIBLE_HOME": str(ROOT / ".cache" / "ansible"), "ANSIBLE_FORCE_COLOR": "0",
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
           "PATH": f"{PLAYBOOK_BIN.parent}:{os.environ.get('PATH', '')}"}
    cmd = [str(PLAYBOOK_BIN), "-i", str(inventory), "--check", "-e", json.dumps({"sim_out": str(out)}),
           *(extra or []), str(play)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode not in (0, 2):  # 2: some simulated host failed on purpose (rescued ones do not count)
        raise AssertionError(f"ansible-playbook exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout + proc.stderr


def results(out: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    found = {}
    for name in names:
        path = out / f"{name}.json"
        assert path.is_file(), f"no result for simulated host {name}"
        found[name] = json.loads(path.read_text())
    return found


def check_decisions(got: Mapping[str, Mapping[str, Any]], output: str, kernel: str) -> None:
    """What every scenario in SCENARIOS must decide (shared with the system test)."""
    def plan(name: str) -> dict[str, Any]:
        entry = got[name]
        assert entry["failure"] is None, f"{name}: {entry['failure']}"
        return dict(entry["plan"])

    p = plan("ubuntu24-gpu")
    assert p["install"] and p["gpus"] == ["0000:18:00.0"] and p["nvswitches"] == []
    assert (p["distribution"], p["source"], p["branch"], p["kernel_modules"]) == ("Ubuntu 24.04", "distro", "580",
                                                                                    "open")
    assert p["packages"] == ["nvidia-headless-580-server-open", "nvidia-utils-580-server"]
    assert p["kernel_headers"] == [f"linux-headers-{kernel}"] and p["repo"] is None
    assert p["nouveau"] == {"blacklist": True, "loaded": True} and p["persistenced"] is True
    assert p["reboot"]["due"] and p["reboot"]["action"] == "stop" and not p["reboot"]["allowed"]
    assert p["reboot"]["reasons"] == [
        "driver packages to install: nvidia-headless-580-server-open, nvidia-utils-580-server",
        "nouveau is loaded", "the nvidia kernel module is not loaded"]

    p = plan("ubuntu22-cuda-repo")
    assert p["gpus"] == ["0000:18:00.0", "0000:19:00.0"] and p["source"] == "cuda_repo"
    assert p["packages"] == ["nvidia-driver-pinning-580", "cuda-drivers-580"]
    arch = "sbsa" if os.uname().machine == "aarch64" else "x86_64"
    uri = f"{CUDA_ROOT}/ubuntu2204/{arch}/"
    assert p["repo"] == {"uri": uri, "key_url": f"{uri}3bf863cc.pub"}
    assert p["reboot"]["action"] == "reboot" and p["reboot"]["allowed"]

    p = plan("debian12-gpu")
    assert (p["distribution"], p["source"], p["branch"]) == ("Debian 12", "cuda_repo", "580")
    assert p["packages"] == ["nvidia-driver-pinning-580", "nvidia-open"]
    assert p["repo"]["uri"] == f"{CUDA_ROOT}/debian12/{arch}/"

    p = plan("debian12-distro")
    assert (p["source"], p["branch"], p["repo"]) == ("distro", "535", None)
    assert p["packages"] == ["nvidia-open-kernel-dkms", "nvidia-smi", "nvidia-persistenced", "libcuda1",
                             "firmware-nvidia-gsp"]
    assert "own NVIDIA driver is branch 535" in output

    p = plan("hgx-fabricmanager")
    assert len(p["gpus"]) == 4 and p["nvswitches"] == ["0000:80:00.0", "0000:81:00.0"]
    assert p["fabricmanager"] and p["fabricmanager_packages"] == ["nvidia-fabricmanager-580", "libnvidia-nscq-580"]
    assert "nvidia-fabricmanager-580" in p["missing_packages"]

    p = plan("fabricmanager-no-nvswitch")
    assert not p["fabricmanager"] and p["fabricmanager_packages"] == []
    assert "has no NVSwitch" in output

    assert plan("secure-boot")["secure_boot"] is True
    assert plan("secure-boot-off")["secure_boot"] is False
    assert plan("ubuntu24-gpu")["secure_boot"] is False  # neither mokutil nor the EFI variable
    assert "Enroll MOK" in output and "mokutil --import /var/lib/dkms/mok.pub" in output

    p = plan("installed-loaded")
    assert p["missing_packages"] == [] and not p["driver_change"]
    assert p["nvidia_module"] == {"loaded": True, "version": "580.159.04"}
    assert p["reboot"] == {"due": False, "reasons": [], "allowed": False, "action": "none"}

    p = plan("installed-old-module")
    assert p["reboot"]["reasons"] == ["the loaded nvidia module is 535.247.01, not branch 580"]

    for name, reason in [("no-gpu", "no NVIDIA GPU (PCI vendor 0x10de, class 0x03xxxx) under"),
                         ("profile-cpu", "llmhost_profile is cpu"), ("disabled", "nvidia_driver_enabled is false")]:
        p = plan(name)
        assert not p["install"] and p["skip_reason"].startswith(reason), (name, p)
        assert set(p) == {"install", "skip_reason", "host", "gpus", "nvswitches"}
        assert f"nvidia_driver: nothing to do on {name}: {reason}" in output

    def failure(name: str) -> str:
        entry = got[name]
        assert entry["failure"] is not None, f"{name} did not fail: {entry['plan']}"
        return str(entry["failure"]["msg"])

    assert "Ubuntu 22.04/24.04 and Debian 12" in failure("ubuntu20-gpu") and "20.04" in failure("ubuntu20-gpu")
    assert "nvidia_driver_enabled: false" in failure("ubuntu20-gpu")
    msg = failure("debian-distro-fabricmanager")
    assert "has NVSwitches" in msg and "use nvidia_driver_source cuda_repo" in msg
    # The role's argument spec refuses it; included with tasks_from (no spec), the plan does.
    assert "no driver packages for Ubuntu with nvidia_driver_source ppa" in failure("bad-source")
    assert 'nvidia_driver_branch must be a driver branch such as "580", got "latest"' in failure("bad-branch")


def write_inventory(path: Path, hosts: Mapping[str, Mapping[str, Any]]) -> Path:
    path.write_text(json.dumps({"all": {"hosts": dict(hosts)}}, indent=2))
    return path
