"""The monitoring roles: argument specs match the defaults, the Ansible style holds,
and preflight refuses bad settings with the variable's name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.paths import ROOT

ROLES = ("node_exporter", "prometheus", "grafana", "smoke")
PHASES = ("preflight", "install", "configure", "service")
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("role", ROLES)
def test_every_default_has_an_argument_spec(role: str):
    base = ROOT / "roles" / role
    defaults = load(base / "defaults" / "main.yml")
    options = load(base / "meta" / "argument_specs.yml")["argument_specs"]["main"]["options"]
    assert set(defaults) == set(options)
    for name, spec in options.items():
        assert name.startswith(f"{role}_"), name
        assert spec.get("description"), name
        assert spec["default"] == defaults[name], name


@pytest.mark.parametrize("role", ROLES)
def test_private_vars_are_prefixed(role: str):
    assert all(k.startswith(f"_{role}_") for k in load(ROOT / "roles" / role / "vars" / "main.yml"))


@pytest.mark.parametrize("role", ROLES)
def test_phases_are_tagged_and_handlers_listen(role: str):
    base = ROOT / "roles" / role
    main = load(base / "tasks" / "main.yml")
    tagged = {t["tags"][0] for t in main}
    assert tagged <= set(PHASES) and {"preflight", "configure", "service"} <= tagged
    for t in main:
        assert t["ansible.builtin.import_tasks"] == f"{t['tags'][0]}.yml"
    for h in load(base / "handlers" / "main.yml"):
        assert h["listen"].startswith(f"{role} ")


@pytest.mark.parametrize("role", ROLES)
def test_templates_carry_the_managed_header(role: str):
    for t in (ROOT / "roles" / role / "templates").glob("*.j2"):
        if t.name == "targets.yml.j2":
            continue  # data for the prometheus.yml template, not a file on the host
        assert t.read_text().startswith("{{ ansible_managed | comment }}"), t
    for t in (ROOT / "monitoring").rglob("*.j2"):
        assert t.read_text().startswith("{{ ansible_managed | comment }}"), t


def preflight(role: str, tmp_path: Path, **extra: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", "localhost,", str(Path(__file__).parent / "preflight.yml"),
         "-e", json.dumps({"role_under_test": role, "ansible_python_interpreter": sys.executable, **extra})],
        text=True, capture_output=True, cwd=ROOT, env=env, timeout=300, check=False,
    )


def test_grafana_needs_an_admin_password(tmp_path: Path):
    r = preflight("grafana", tmp_path)
    assert r.returncode != 0
    assert "grafana_admin_password is required when grafana_enabled is true" in r.stdout
    ok = preflight("grafana", tmp_path, grafana_admin_password="correct-horse-battery")
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert "correct-horse-battery" not in ok.stdout + ok.stderr


def test_grafana_disabled_needs_no_password(tmp_path: Path):
    r = preflight("grafana", tmp_path, grafana_enabled=False)
    assert r.returncode == 0, r.stdout[-3000:]


def test_grafana_deb_source_needs_a_deb(tmp_path: Path):
    r = preflight("grafana", tmp_path, grafana_admin_password="correct-horse-battery", grafana_source="deb",
                  grafana_deb_path=str(tmp_path / "missing.deb"))
    assert r.returncode != 0 and "grafana_deb_path" in r.stdout


def test_node_exporter_rejects_a_bad_listen_address(tmp_path: Path):
    r = preflight("node_exporter", tmp_path, node_exporter_web_listen_address="9100")
    assert r.returncode != 0 and "node_exporter_web_listen_address must be HOST:PORT" in r.stdout
    r = preflight("node_exporter", tmp_path, node_exporter_extra_args=["--collector.systemd --oops"])
    assert r.returncode != 0 and "node_exporter_extra_args" in r.stdout


def test_prometheus_rejects_a_timeout_longer_than_the_interval(tmp_path: Path):
    r = preflight("prometheus", tmp_path, prometheus_scrape_interval="5s")
    assert r.returncode != 0
    assert "prometheus_scrape_timeout (10s) must not be longer than prometheus_scrape_interval (5s)" in r.stdout
