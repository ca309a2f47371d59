"""Shared fixtures: the tiny model (made once per session). Helpers are in tests/harness.

`make test` runs the tests in two pytest-xdist workers (``--dist loadscope``) with the
scheduler below. The system tests share one booted host per worker, so they are one
unit of work; the e2e tests are one too, so that only one worker at a time runs
tritonserver and vLLM on this machine's cores (two e2e workers side by side starved a
server's start past its 300 s). Both are collected first, so one worker spends the run
on each; every other module is a unit of its own and fills in after them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

# Folders whose tests are one unit of work each, in the order they are handed out
# (node ids are relative to the repository's root).
TOGETHER = ("tests/system", "tests/e2e")


def work_unit(nodeid: str) -> str:
    """The unit of work of a test: its folder for the folders in TOGETHER, else its file."""
    path = nodeid.split("::", 1)[0]
    return next((folder for folder in TOGETHER if path.startswith(folder + "/")), path)


# Modules that leave the session's booted host changed for good (rolling.yml rolls a
# new llmhost build and engine argument onto it): last within their unit of work.
LAST = ("tests/system/test_gateway_two_hosts.py",)


def handed_out_first(nodeid: str) -> int:
    """A test's place in the collection: the system tests, the e2e tests, then the rest."""
    unit = work_unit(nodeid)
    return TOGETHER.index(unit) if unit in TOGETHER else len(TOGETHER)


def collection_order(nodeid: str) -> tuple[int, bool]:
    """Where a test goes: by handed_out_first, and within that the modules in LAST last."""
    return handed_out_first(nodeid), nodeid.split("::", 1)[0] in LAST


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: collection_order(item.nodeid))  # stable: the order within each part stays


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadscope``: units of work as ``work_unit`` says. (xdist's own
    ``loadgroup`` marks cannot be used: xdist 3.8 renames node ids in a way pytest 9
    no longer reads.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Together(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Together(config, log)


# A test that measures something for the record (the rolling test's request counts)
# keeps it as a user property named FIGURE; xdist carries those back from its workers,
# and they are printed at the end of the run, passed or failed.
FIGURE = "figure"


def figures(reports: list[Any]) -> list[str]:
    """"NODEID: TEXT" for each figure recorded by a test's call (in the order of the reports)."""
    return [f"{report.nodeid}: {value}" for report in reports if getattr(report, "when", None) == "call"
            for name, value in getattr(report, "user_properties", ()) if name == FIGURE]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    lines = figures([r for reports in terminalreporter.stats.values() for r in reports])
    if lines:
        terminalreporter.section("figures recorded by the tests")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmhost.tiny.model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)
