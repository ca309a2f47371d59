"""The dcgm_exporter role's decisions and files, on this machine in check mode.

The role installs NVIDIA DCGM and dcgm-exporter on GPU hosts. This machine has no
GPU and cannot reach NVIDIA's repository, so the role runs here in check mode
(nothing is written) against localhost, with an nvidia-smi that prints the real
H100 recording: preflight decisions and failures by name, and the files it would
write (--diff) for the configure phase.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.ansible._helpers import (
    REPO,
    PlaybookRun,
    ansible_playbook,
    ansible_playbook_on_hosts,
    batch_inventory,
)

H100_SMI = REPO / "tests" / "fixtures" / "gpu" / "h100-580.159.04-real" / "nvidia-smi.txt"

PLAY = """\
---
- name: dcgm_exporter on this machine
  hosts: localhost
  gather_facts: true
  gather_subset: [min]
  roles:
    - role: dcgm_exporter
"""


# The same play for every host of a batch (one host per case, see preflight_runs).
BATCH_PLAY = PLAY.replace("hosts: localhost", "hosts: all")


def fake_smi(tmp_path: Path, text_file: Path | None) -> str:
    """An nvidia-smi in tmp_path that prints text_file, or fails as without a driver (None)."""
    path = tmp_path / (f"nvidia-smi-{text_file.parent.name}" if text_file else "nvidia-smi-failing")
    failing = "echo 'NVIDIA-SMI has failed because it could not communicate' >&2; exit 9"
    body = f"exec cat {text_file}" if text_file else failing
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def run(tmp_path: Path, tags: str, **variables: Any) -> PlaybookRun:
    play = tmp_path / "play.yml"
    play.write_text(PLAY)
    smi = variables.pop("smi") if "smi" in variables else fake_smi(tmp_path, H100_SMI)
    extra = {"llmhost_profile": "gpu", "dcgm_exporter_nvidia_smi": smi, **variables}
    return ansible_playbook("-i", "inventory/localhost.yml", "-e", json.dumps(extra),
                            "--tags", tags, "--check", "--diff", str(play))


def runs_per_host(folder: Path, tags: str, cases: dict[str, dict[str, Any]]) -> dict[str, PlaybookRun]:
    """run(tags, **variables) for every case, in one ansible-playbook run (one host per case,
    the variables its host vars); per case what its host alone printed."""
    play = folder / "play.yml"
    play.write_text(BATCH_PLAY)
    hosts = [{"llmhost_profile": "gpu", **variables} for variables in cases.values()]
    runs = ansible_playbook_on_hosts(batch_inventory(hosts), len(hosts), "--tags", tags, "--check", "--diff", str(play))
    return dict(zip(cases, runs, strict=True))


@pytest.fixture(scope="module")
def preflight_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PlaybookRun]:
    """The preflight (--tags preflight --check --diff) of every test below that runs only it:
    "plan" (the H100's nvidia-smi), "no driver" (a failing nvidia-smi) and each of CASES as
    "case: <name>" (the H100's nvidia-smi and the case's settings)."""
    folder = tmp_path_factory.mktemp("dcgm-preflight")
    h100 = {"dcgm_exporter_nvidia_smi": fake_smi(folder, H100_SMI)}
    cases = {"plan": h100, "no driver": {"dcgm_exporter_nvidia_smi": fake_smi(folder, None)},
             **{f"case: {name}": {**h100, **override} for name, override, _ in CASES}}
    return runs_per_host(folder, "preflight", cases)


def test_gpu_host_plan_names_packages_for_the_driver_cuda_major(preflight_runs: dict[str, PlaybookRun]) -> None:
    r = preflight_runs["plan"]
    assert r.rc == 0, r.output
    plan = " ".join(r.output.split())
    # The H100 recording reports CUDA 13.0: DCGM 4's CUDA 13 libraries.
    assert ("dcgm_exporter: datacenter-gpu-manager-4-core datacenter-gpu-manager-4-cuda13 "
            "datacenter-gpu-manager-exporter from https://developer.download.nvidia.com/compute/cuda/repos/") in plan
    assert "19 fields every 15000 ms on :9400" in plan
    assert r.recap()["localhost"]["changed"] == 0


def test_cpu_profile_skips_with_a_message(tmp_path: Path) -> None:
    r = run(tmp_path, "all", llmhost_profile="cpu", smi="/nonexistent/nvidia-smi")
    assert r.rc == 0, r.output
    assert "dcgm_exporter: skipped on localhost: llmhost_profile is cpu" in r.output
    assert r.recap()["localhost"]["changed"] == 0


def test_no_working_driver_fails_naming_the_fix(preflight_runs: dict[str, PlaybookRun]) -> None:
    r = preflight_runs["no driver"]
    msg = r.failure()
    assert "dcgm_exporter needs a working NVIDIA driver" in msg
    assert "could not communicate" in msg and "dcgm_exporter_enabled to false" in msg


CASES: list[tuple[str, dict[str, Any], str]] = [
    ("source", {"dcgm_exporter_source": "docker"}, "dcgm_exporter_source"),
    ("listen", {"dcgm_exporter_listen_address": "9400"}, "dcgm_exporter_listen_address must be HOST:PORT"),
    ("interval", {"dcgm_exporter_collect_interval_ms": "fast"}, "dcgm_exporter_collect_interval_ms"),
    ("interval too short", {"dcgm_exporter_collect_interval_ms": 10},
     "dcgm_exporter_collect_interval_ms must be a whole number of milliseconds, at least 100"),
    ("counter field", {"dcgm_exporter_counters": [["GPU_TEMP", "gauge", "t"]]}, "dcgm_exporter_counters must be"),
    ("counter type", {"dcgm_exporter_counters": [["DCGM_FI_DEV_GPU_TEMP", "summary", "t"]]},
     "dcgm_exporter_counters must be"),
    ("counter shape", {"dcgm_exporter_counters": "DCGM_FI_DEV_GPU_TEMP"}, "dcgm_exporter_counters must be"),
    ("repo url", {"dcgm_exporter_cuda_repo_url": "ftp://mirror/cuda"}, "dcgm_exporter_cuda_repo_url must be"),
    ("key sha", {"dcgm_exporter_cuda_repo_key_sha256": "abc"}, "dcgm_exporter_cuda_repo_key_sha256 must be"),
    ("debs missing", {"dcgm_exporter_source": "deb"}, "dcgm_exporter_source deb needs dcgm_exporter_debs"),
    ("deb without sha", {"dcgm_exporter_source": "deb", "dcgm_exporter_debs": [{"path": "/tmp/x.deb"}]},
     "dcgm_exporter_source deb needs dcgm_exporter_debs"),
    ("deb not on controller",
     {"dcgm_exporter_source": "deb", "dcgm_exporter_debs": [{"path": "/nonexistent/dcgm.deb", "sha256": "0" * 64}]},
     "/nonexistent/dcgm.deb does not exist on the controller"),
]


@pytest.mark.parametrize(("name", "override", "needle"), CASES, ids=[c[0] for c in CASES])
def test_bad_settings_fail_in_preflight_by_name(preflight_runs: dict[str, PlaybookRun], name: str,
                                                override: dict[str, Any], needle: str) -> None:
    r = preflight_runs[f"case: {name}"]
    assert needle in r.failure()
    assert r.recap()["localhost"]["changed"] == 0


def test_configure_writes_the_fields_and_the_unit_drop_in(tmp_path: Path) -> None:
    r = run(tmp_path, "preflight,configure", dcgm_exporter_listen_address="127.0.0.1:9400",
            dcgm_exporter_collect_interval_ms=5000)
    assert r.rc == 0, r.output
    out = r.output
    # The drop-in replaces the package's ExecStart and log file.
    assert ("+ExecStart=/usr/bin/dcgm-exporter -f /etc/dcgm-exporter/llmhost-counters.csv "
            "-a 127.0.0.1:9400 -c 5000") in out
    assert "+ExecStart=\n" in out and "+StandardOutput=journal" in out and "+Restart=on-failure" in out
    fields = [line[1:].split(",")[0] for line in out.splitlines() if line.startswith("+DCGM_FI_")]
    assert len(fields) == 19 and len(set(fields)) == 19
    for wanted in ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                   "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_THERMAL_VIOLATION"):
        assert wanted in fields
    assert not Path("/etc/dcgm-exporter/llmhost-counters.csv").exists()


def test_the_dashboards_and_rules_use_only_exported_fields() -> None:
    """Every DCGM_FI_* series a dashboard panel or alert rule reads is in the default field list."""
    import re

    import yaml

    defaults = {c[0] for c in yaml.safe_load((REPO / "roles/dcgm_exporter/vars/main.yml").read_text())[
        "_dcgm_exporter_default_counters"]}
    used: set[str] = set()
    for path in [*(REPO / "monitoring/grafana/dashboards").glob("*.json"),
                 *(REPO / "monitoring/prometheus/rules").glob("*.yml")]:
        used |= set(re.findall(r"DCGM_FI_[A-Z0-9_]+", path.read_text()))
    assert used, "no dashboard or rule reads a DCGM field"
    assert used <= defaults, sorted(used - defaults)
