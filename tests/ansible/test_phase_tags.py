"""Every phase runs alone with its tag: each role's preflight carries every phase
tag of the role (as prometheus-community's node_exporter does), so that what the
later phases read is there; and the serving playbook runs with `--tags install`
and with `--tags configure` alone in check mode on this machine (demo settings),
as test_preflight.py runs `--tags preflight`."""

from __future__ import annotations

import pytest

from tests.ansible._helpers import ROLES, ansible_playbook, load_yaml, role_names


@pytest.mark.parametrize("role", role_names())
def test_preflight_carries_every_phase_tag(role: str) -> None:
    main = load_yaml(ROLES / role / "tasks" / "main.yml")
    phases = {tag for task in main for tag in task.get("tags", [])} - {"preflight", "always"}
    preflight = [t for t in main if "preflight" in t.get("tags", [])]
    assert len(preflight) == 1, f"roles/{role}/tasks/main.yml: one preflight phase"
    missing = sorted(phases - set(preflight[0]["tags"]))
    assert not missing, f"roles/{role}: the preflight lacks the phase tags {missing}"


@pytest.mark.parametrize("tag", ["install", "configure"])
def test_serving_phase_runs_alone_in_check_mode(tag: str) -> None:
    run = ansible_playbook("-i", "inventory/localhost.yml", "-e", "@inventory/demo.yml",
                           "--tags", tag, "--check", "playbooks/serving.yml")
    assert run.rc == 0, run.output
    recap = run.recap()["localhost"]
    assert recap["failed"] == 0, run.output
    assert recap["ok"] > 0, run.output
