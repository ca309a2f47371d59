"""Every role default is declared in the role's meta/argument_specs.yml, and every
declared option has a default or is required (so Ansible validates each one). A
role of internal task files (roles/common) has one spec per entry point and no main."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.harness.paths import ROOT

ROLES = sorted(p for p in (ROOT / "roles").iterdir() if p.is_dir())


@pytest.mark.parametrize("role", ROLES, ids=[r.name for r in ROLES])
def test_defaults_and_argument_specs_agree(role: Path):
    defaults_file = role / "defaults" / "main.yml"
    specs_file = role / "meta" / "argument_specs.yml"
    assert specs_file.is_file(), f"{role.name} has no meta/argument_specs.yml"
    defaults = yaml.safe_load(defaults_file.read_text()) or {} if defaults_file.is_file() else {}
    entry_points = yaml.safe_load(specs_file.read_text())["argument_specs"]
    assert "main" in entry_points or not (role / "tasks" / "main.yml").exists(), f"{role.name}: no main spec"
    specs = {name: spec for entry in entry_points.values() for name, spec in (entry.get("options") or {}).items()}
    missing = sorted(set(defaults) - set(specs))
    assert not missing, f"{role.name}: defaults without an argument spec: {missing}"
    for name, spec in specs.items():
        assert spec.get("description"), f"{role.name}: {name} has no description"
        assert "type" in spec, f"{role.name}: {name} has no type"
        if name in defaults:
            assert "default" in spec or spec.get("required"), f"{role.name}: {name} default not declared"
