"""Shared fixtures: the tiny model (made once per session). Helpers are in tests/harness.

`make test` runs the tests in two pytest-xdist workers (``--dist loadscope``) with the
scheduler below. The system tests share one booted host per worker, so they are one
unit of work; the e2e tests are one too, so that only one worker at a time runs
tritonserver and vLLM on this machine's cores (two e2e workers side by side starved a
server's start past its 300 s). Both are collected first, so one worker spends the run
on each; every other module is a unit of its own and fills in after them.
"""

from __future__ import annotations

import contextlib
import os
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


# The system tests' unit is the run's longest path (one booted host, then two more and
# the rolls), and every core is busy for the whole run. So the processes of every other
# test (its pytest worker and what it starts: tritonserver, vLLM, Ansible) run at a
# lower CPU priority and take what the system tests leave; the booted hosts inherit the
# system tests' worker's. Without root a process cannot raise its priority again: then
# it stays as it is.
LOWER_PRIORITY = 5


def niceness(nodeid: str) -> int:
    """The nice value the processes of a test run at: 0 for the system tests, else LOWER_PRIORITY."""
    return 0 if work_unit(nodeid) == TOGETHER[0] else LOWER_PRIORITY


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a test's fixtures start anything: this process at the test's niceness,
    which the processes it starts inherit."""
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, niceness(item.nodeid))


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


@pytest.fixture(scope="session", autouse=True)
def _vllm_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One vLLM cache folder for every server this worker starts (`llmhost serve` and
    `vllm serve` keep a VLLM_CACHE_ROOT they are given), as a host keeps one for all its
    starts: vLLM inspects a model's class in a process of its own (another import of
    vLLM, about 10 s of CPU) only where its cache has no entry for that class yet."""
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.getbasetemp() / "vllm-cache"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmhost.tiny.model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)
