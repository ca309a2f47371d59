"""Hub models pinned to a commit: a model whose revision is a branch (or none) gets a
warning from the preflight, and with model_repository_require_pinned_revision it is
refused by name; a 40-hex commit passes without either."""

from __future__ import annotations

from typing import Any

import pytest

from tests.ansible._helpers import PlaybookRun, shared_dir
from tests.ansible.test_preflight import assert_fails_naming, preflights

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def models(*revisions: str | None) -> dict[str, Any]:
    out = [{"name": "tiny", "source": "tiny"}]
    for i, revision in enumerate(revisions):
        model = {"name": f"hub-{i}", "source": "huggingface", "repo": "example-org/model"}
        if revision is not None:
            model["revision"] = revision
        out.append(model)
    return {"llmhost_models": out}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PlaybookRun]:
    """The preflight of each test below, all in one ansible-playbook run (see preflights)."""
    pinned = {"model_repository_require_pinned_revision": True}
    return preflights(shared_dir(tmp_path_factory), {
        "branch": models("main", None, COMMIT),
        "pinned": {**models(COMMIT), **pinned},
        "required": {**models("main", COMMIT.upper()), **pinned},
    })


def _warning(output: str) -> str:
    task = output.split("Warn about hub models without a pinned commit]", 1)[1].split("TASK [", 1)[0]
    return " ".join(task.split())


def test_a_branch_or_no_revision_gets_a_warning_naming_the_models(runs: dict[str, PlaybookRun]) -> None:
    run = runs["branch"]
    assert run.rc == 0, run.output
    warning = _warning(run.output)
    assert "llmhost_models hub-0, hub-1 follow a branch" in warning, warning
    assert "hub-2" not in warning


def test_pinned_models_pass_without_a_warning(runs: dict[str, PlaybookRun]) -> None:
    run = runs["pinned"]
    assert run.rc == 0, run.output
    assert "skipping" in _warning(run.output)


def test_required_pins_refuse_a_branch_by_name(runs: dict[str, PlaybookRun]) -> None:
    run = runs["required"]
    assert_fails_naming(run, "hub-0, hub-1 has no commit hash", "model_repository_require_pinned_revision")
