"""One version: pyproject.toml's, the CHANGELOG's top release, and what `llmhost --version` prints."""

from __future__ import annotations

import re

import pytest
import tomllib

from llmhost.cli import main
from tests.harness.paths import ROOT

RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.M)


def test_the_changelog_starts_with_a_dated_release_that_pyproject_names():
    text = (ROOT / "CHANGELOG.md").read_text()
    first = re.search(r"^## .*$", text, re.M)
    assert first is not None and RELEASE.match(first.group(0)), f"the top section is no release: {first}"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert RELEASE.match(first.group(0)).group(1) == version  # type: ignore[union-attr]


def test_llmhost_version_prints_the_top_release(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    top = RELEASE.search((ROOT / "CHANGELOG.md").read_text())
    assert top is not None
    assert capsys.readouterr().out.strip() == f"llmhost {top.group(1)}"
