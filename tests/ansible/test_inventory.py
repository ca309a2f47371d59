"""Inventories: what a user writes in an inventory file is what the hosts get, and
there is no default inventory, so a bare `ansible-playbook site.yml` provisions
nothing (least of all this machine as a GPU server) and says what to pass."""

from __future__ import annotations

import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.ansible._helpers import BIN, REPO, PlaybookRun, ansible_env, ansible_playbook, load_yaml

PLAYBOOKS = ["site.yml", "playbooks/gpu.yml", "playbooks/serving.yml", "playbooks/monitoring.yml"]
GUARD_MESSAGE = "No hosts in the groups inference, gateway or monitoring of the inventory"


def inventory_list(inventory: str) -> dict[str, Any]:
    proc = subprocess.run([str(BIN / "ansible-inventory"), "-i", inventory, "--list"], cwd=REPO,
                          env=ansible_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def group_hosts(listing: dict[str, Any], group: str) -> list[str]:
    hosts = list(listing.get(group, {}).get("hosts", []))
    for child in listing.get(group, {}).get("children", []):
        hosts += group_hosts(listing, child)
    return hosts


# -- what the inventory file says wins ---------------------------------------------------


def test_example_inventory_puts_the_gateway_in_front_of_loopback_triton() -> None:
    """inventory/example.yml: every host of the group inference gets the group's vars as
    rendered by Ansible with everything the repository ships: API keys for the gateway
    (from a vault), metrics on the network, and Triton left on its loopback default."""
    listing = inventory_list("inventory/example.yml")
    hosts = group_hosts(listing, "inference")
    assert sorted(hosts) == ["gpu-node-01", "gpu-node-02"], listing
    hostvars = listing["_meta"]["hostvars"]
    for host in hosts:
        assert hostvars[host]["gateway_api_keys"] == "{{ vault_gateway_api_keys }}", (host, hostvars[host])
        assert hostvars[host]["llmhost_metrics_bind_address"] == "0.0.0.0", (host, hostvars[host])
        assert hostvars[host]["gateway_metrics_token"] == "{{ vault_gateway_metrics_token }}", (host, hostvars[host])
        assert hostvars[host]["llmhost_profile"] == "gpu", (host, hostvars[host])
        # Not set: Triton keeps 127.0.0.1, and no acknowledgement of a public Triton is given.
        assert "llmhost_bind_address" not in hostvars[host], (host, hostvars[host])
        assert "llmhost_allow_public_triton" not in hostvars[host], (host, hostvars[host])
    model = hostvars["gpu-node-02"]["llmhost_models"][0]
    assert model["name"] == "qwen2.5-7b-instruct" and model["engine_args"]["tensor_parallel_size"] == 2


def test_example_hub_models_are_pinned_to_a_commit() -> None:
    """Every Hugging Face model of inventory/example.yml names a commit (40 hex digits),
    which the preflight takes as pinned, not a branch a later download would move."""
    hostvars = inventory_list("inventory/example.yml")["_meta"]["hostvars"]
    hub = [m for v in hostvars.values() for m in v.get("llmhost_models") or [] if m.get("source") == "huggingface"]
    assert hub, hostvars
    for model in hub:
        assert re.fullmatch(r"[0-9a-f]{40}", str(model.get("revision"))), model


def test_the_repository_ships_no_group_or_host_vars() -> None:
    """Ansible ranks group_vars/all.yml beside an inventory or playbook above the group vars
    written in the inventory file: shipped there, the roles' defaults silently replaced them."""
    dirs = [REPO / d / kind for d in ("", "inventory", "playbooks") for kind in ("group_vars", "host_vars")]
    shipped = [str(d.relative_to(REPO)) for d in dirs if d.exists()]
    assert not shipped, f"vars directories that outrank inventory files: {shipped}"


def test_the_variables_reference_is_loaded_by_nothing() -> None:
    """docs/variables.yml documents the knobs; no playbook, role or make target loads it
    (as extra vars, vars_files or include_vars), so it can override nothing."""
    assert isinstance(load_yaml(REPO / "docs" / "variables.yml"), dict)
    loads = re.compile(r"(@|vars_files|include_vars|file:)[^\n]*variables\.yml")
    sources = [*REPO.glob("*.yml"), *REPO.glob("playbooks/*.yml"), *REPO.glob("roles/*/tasks/*.yml"),
               *REPO.glob("mk/*.mk"), REPO / "Makefile", REPO / "ansible.cfg", *REPO.glob("lab/*")]
    readers = [str(p.relative_to(REPO)) for p in sources if p.is_file() and loads.search(p.read_text())]
    assert not readers, readers


# -- no default inventory ---------------------------------------------------------------


def run_without_inventory(playbook: str) -> PlaybookRun:
    return ansible_playbook(playbook)


@pytest.fixture(scope="module")
def bare_runs() -> dict[str, PlaybookRun]:
    env_before = os.environ.pop("ANSIBLE_INVENTORY", None)
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            return dict(zip(PLAYBOOKS, pool.map(run_without_inventory, PLAYBOOKS), strict=True))
    finally:
        if env_before is not None:
            os.environ["ANSIBLE_INVENTORY"] = env_before


def test_ansible_cfg_names_no_inventory() -> None:
    proc = subprocess.run([str(BIN / "ansible-config"), "dump", "--only-changed", "--format", "json"], cwd=REPO,
                          env={k: v for k, v in ansible_env().items() if k != "ANSIBLE_INVENTORY"},
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    changed = {item["name"]: item for item in json.loads(proc.stdout) if "name" in item}
    assert "DEFAULT_HOST_LIST" not in changed, changed.get("DEFAULT_HOST_LIST")


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_without_an_inventory_nothing_runs_and_the_message_says_what_to_pass(
    bare_runs: dict[str, PlaybookRun], playbook: str
) -> None:
    run = bare_runs[playbook]
    assert run.rc != 0, run.output
    failure = run.failure()
    assert GUARD_MESSAGE in failure and "nothing was changed" in failure, failure
    assert "-i inventory/<yours>.yml site.yml" in failure and "-i inventory/localhost.yml" in failure, failure
    # Only the check ran: on Ansible's implicit localhost, changing nothing, and no other play started.
    assert run.recap() == {"localhost": {"ok": 0, "changed": 0, "unreachable": 0, "failed": 1, "skipped": 0,
                                         "rescued": 0, "ignored": 0}}, run.output
    plays = [line.rstrip("* ") for line in run.output.splitlines() if line.startswith("PLAY [")]
    assert plays == ["PLAY [Check the inventory]"], run.output


def test_an_inventory_with_no_llmhost_groups_is_refused_too(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all:\n  children:\n    webservers:\n      hosts:\n        web-01:\n"
                         "          ansible_host: 192.0.2.1\n")
    run = ansible_playbook("-i", str(inventory), "site.yml")
    assert GUARD_MESSAGE in run.failure() and str(inventory) in run.failure(), run.output
    assert "web-01" not in run.recap(), run.output


def test_this_machine_is_provisioned_when_named(tmp_path: Path) -> None:
    """-i inventory/localhost.yml gets past the check and on into the plays (stopped early:
    --check, and tags that select no task of the roles)."""
    run = ansible_playbook("-i", "inventory/localhost.yml", "--check", "--tags", "llmhost-no-such-tag",
                           "--skip-tags", "preflight", "site.yml")
    assert run.rc == 0, run.output
    assert GUARD_MESSAGE not in run.output
    assert "PLAY [Prometheus and Grafana on the monitoring hosts]" in run.output, run.output
    assert run.recap()["localhost"]["changed"] == 0 and run.recap()["localhost"]["failed"] == 0, run.output
