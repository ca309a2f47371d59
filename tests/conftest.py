"""Shared fixtures: the tiny model (made once per session). Helpers are in tests/harness.

`make test` runs the tests in two pytest-xdist workers (``--dist loadgroup``). The
system tests share one booted host per worker, so they form one group, and it is
collected first: one worker spends the run on them while the other takes every
other module. Every other module is a group of its own, so a module's server
starts once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
SYSTEM_DIR = TESTS_DIR / "system"


def _is_system(item: pytest.Item) -> bool:
    return SYSTEM_DIR in Path(str(item.path)).resolve().parents


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # tryfirst: xdist reads the xdist_group markers in its own hook of this name.
    items.sort(key=lambda item: not _is_system(item))  # stable: the order within each part stays
    for item in items:
        group = "system" if _is_system(item) else Path(str(item.path)).resolve().relative_to(TESTS_DIR).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmhost.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)
