"""Role conventions beyond test_argument_specs.py: no argument spec without a default,
spec defaults equal to defaults/main.yml, `_<role>_` private values, phased tasks,
handlers with listen:, and a variables reference that agrees with the role defaults."""

from __future__ import annotations

from typing import Any

import pytest

from tests.ansible._helpers import REPO, ROLES, load_yaml, role_names

ROLES_UNDER_TEST = role_names()


def test_the_serving_roles_exist() -> None:
    assert {"llmhost", "python_env", "triton", "model_repository"} <= set(ROLES_UNDER_TEST)
    assert not {"tritonserver", "triton_service"} & set(ROLES_UNDER_TEST)


def _defaults(role: str) -> dict[str, Any]:
    data = load_yaml(ROLES / role / "defaults" / "main.yml") or {}
    assert isinstance(data, dict), f"{role}/defaults/main.yml must be a mapping"
    return data


def _options(role: str) -> dict[str, Any]:
    specs = load_yaml(ROLES / role / "meta" / "argument_specs.yml")
    options = specs["argument_specs"]["main"].get("options") or {}
    assert isinstance(options, dict)
    return options


@pytest.mark.parametrize("role", ROLES_UNDER_TEST)
def test_every_argument_spec_is_a_default(role: str) -> None:
    extra = sorted(set(_options(role)) - set(_defaults(role)))
    assert not extra, f"roles/{role}: argument specs without a default in defaults/main.yml: {extra}"


@pytest.mark.parametrize("role", ROLES_UNDER_TEST)
def test_argument_specs_have_type_description_and_the_same_default(role: str) -> None:
    defaults = _defaults(role)
    for name, spec in _options(role).items():
        assert spec.get("type"), f"roles/{role}: {name} has no type"
        assert spec.get("description"), f"roles/{role}: {name} has no description"
        assert "default" in spec, f"roles/{role}: {name} documents no default"
        assert spec["default"] == defaults[name], (
            f"roles/{role}: {name} defaults to {defaults[name]!r} but its argument spec says {spec['default']!r}"
        )


@pytest.mark.parametrize("role", ROLES_UNDER_TEST)
def test_private_vars_carry_the_role_prefix(role: str) -> None:
    path = ROLES / role / "vars" / "main.yml"
    if not path.exists():
        return
    bad = [k for k in (load_yaml(path) or {}) if not k.startswith(f"_{role}_")]
    assert not bad, f"roles/{role}/vars/main.yml: private values must be named _{role}_*: {bad}"


@pytest.mark.parametrize("role", ROLES_UNDER_TEST)
def test_tasks_are_split_into_tagged_phases(role: str) -> None:
    main = load_yaml(ROLES / role / "tasks" / "main.yml")
    tags = {tag for task in main for tag in task.get("tags", [])}
    assert "preflight" in tags, f"roles/{role}/tasks/main.yml has no preflight phase"
    for task in main:
        keys = {"ansible.builtin.import_tasks", "ansible.builtin.include_tasks"}
        assert keys & set(task), f"roles/{role}/tasks/main.yml should only import or include phases: {task}"


@pytest.mark.parametrize("role", ROLES_UNDER_TEST)
def test_handlers_listen_on_topics(role: str) -> None:
    path = ROLES / role / "handlers" / "main.yml"
    if not path.exists():
        return
    for handler in load_yaml(path):
        assert handler.get("listen"), f"roles/{role}: handler {handler.get('name')!r} has no listen:"


def test_variables_reference_agrees_with_role_defaults() -> None:
    """docs/variables.yml documents the knobs with the roles' default values."""
    defaults: dict[str, Any] = {}
    for role in ROLES_UNDER_TEST:
        defaults.update(_defaults(role))
    reference = load_yaml(REPO / "docs" / "variables.yml")
    unknown = sorted(set(reference) - set(defaults))
    assert not unknown, f"docs/variables.yml lists variables no role knows: {unknown}"
    differ = {k: (v, defaults[k]) for k, v in reference.items() if defaults[k] != v}
    assert not differ, f"docs/variables.yml disagrees with the role defaults (value, default): {differ}"


def test_demo_vars_are_known_variables() -> None:
    defaults: dict[str, Any] = {}
    for role in ROLES_UNDER_TEST:
        defaults.update(_defaults(role))
    demo = load_yaml(REPO / "inventory" / "demo.yml")
    assert demo["llmhost_profile"] == "cpu"
    # Generated models only (no downloads): one that chats and calls tools, one that embeds.
    assert [(m["source"], m["name"]) for m in demo["llmhost_models"]] == [("tiny", "tiny"), ("tiny", "embed")]
    assert demo["llmhost_models"][0]["settings"]["tool_parser"] == "hermes"
    assert demo["llmhost_models"][1]["engine_args"]["runner"] == "pooling"
    assert not sorted(set(demo) - set(defaults))


def test_no_role_reaches_out_of_itself() -> None:
    """Paths outside a role come from variables (llmhost_source_dir, ansible.cfg's
    directory), never from role_path with '..'."""
    offenders = [str(p.relative_to(REPO)) for p in sorted(ROLES.rglob("*"))
                 if p.is_file() and "role_path" in p.read_text(errors="replace")]
    assert not offenders, f"role_path used in: {offenders}"


@pytest.mark.parametrize("role", ROLES_UNDER_TEST)
def test_handler_topics_are_named_after_roles(role: str) -> None:
    """A role notifies `<role> ...` topics: its own handlers, or those that listen to
    it (roles/triton restarts on `python_env venv changed`)."""
    names = set(role_names())
    for path in sorted((ROLES / role).glob("handlers/*.yml")) + sorted((ROLES / role).glob("tasks/*.yml")):
        for text in [str(t) for t in _topics(load_yaml(path) or [])]:
            assert text.split(" ")[0] in names, f"{path.relative_to(REPO)}: topic {text!r} names no role"


def _topics(tasks: list[Any]) -> list[Any]:
    out: list[Any] = []
    for task in tasks:
        if not isinstance(task, dict):
            continue
        for key in ("notify", "listen"):
            value = task.get(key)
            out += value if isinstance(value, list) else [value] if value else []
        for key in ("block", "rescue", "always"):
            out += _topics(task.get(key) or [])
    return out
