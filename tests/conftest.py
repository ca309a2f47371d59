"""Shared fixtures: the tiny model (made once per session). Helpers are in tests/harness.

`make test` runs the tests in two pytest-xdist workers (``--dist loadscope``) with the
scheduler below: the system tests share one booted host per worker, so they are one
unit of work, and they are collected first: one worker spends the run on them while
the other takes every other module. Every other module is a unit of its own, so a
module's server starts once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

TESTS_DIR = Path(__file__).resolve().parent
SYSTEM_DIR = TESTS_DIR / "system"
SYSTEM_SCOPE = "tests/system"  # node ids are relative to the repository's root


def _is_system(item: pytest.Item) -> bool:
    return SYSTEM_DIR in Path(str(item.path)).resolve().parents


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not _is_system(item))  # stable: the order within each part stays


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadscope``: the system tests as one unit of work, every other test
    module as one. (xdist's own ``loadgroup`` marks cannot be used: xdist 3.8 renames
    node ids in a way pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SystemTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SYSTEM_SCOPE if path.startswith(SYSTEM_SCOPE + "/") else path

    return SystemTogether(config, log)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmhost.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)
