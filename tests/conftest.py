"""Shared fixtures: the tiny model (made once per session). Helpers are in tests/harness.

`make test` runs the tests in three pytest-xdist workers (``--dist loadscope``) with the
scheduler below. The system tests share one booted host per worker, so they are one
unit of work; the e2e tests are one too, so that only one worker at a time runs
tritonserver and vLLM for them. Both are collected first, so one worker spends the run
on each; every other module is a unit of its own, and the third worker takes them from
the start, the others after their unit.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import cpugroups

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
# the rolls), and the cores are busy for the whole run. So each worker's processes (its
# pytest worker and all it starts: tritonserver, vLLM, Ansible, the booted hosts) have a
# CPU weight by the tests it runs: the system tests' the most, the e2e tests' less, the
# modules that fill in the least, which still keeps an Ansible run of forty hosts well
# within its timeout while the others are busy. Each weight is a cgroup's cpu.shares
# (tests/harness/cpugroups.py: nice values weigh only within a session, and the booted
# hosts and many servers run in sessions of their own). Where there is no such group,
# the worker's nice value stands in: NICENESS of the same share.
CPU_WEIGHTS = {"tests/system": 2048, "tests/e2e": 1024}
OTHER_CPU_WEIGHT = 512
NICENESS = {2048: 0, 1024: 3, 512: 5}


def cpu_weight(nodeid: str) -> int:
    """The CPU weight of a test's worker while it runs the test (cpu.shares)."""
    return CPU_WEIGHTS.get(work_unit(nodeid), OTHER_CPU_WEIGHT)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a test's fixtures start anything: this worker at the test's CPU weight."""
    weight = cpu_weight(item.nodeid)
    if _cpu_group is None or not _cpu_group.weigh(weight):
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, NICENESS[weight])


# A test that measures something for the record (the rolling test's request counts)
# keeps it as a user property named FIGURE; xdist carries those back from its workers,
# and they are printed at the end of the run, passed or failed.
FIGURE = "figure"


def figures(reports: list[Any]) -> list[str]:
    """"NODEID: TEXT" for each figure recorded by a test's call (in the order of the reports)."""
    return [f"{report.nodeid}: {value}" for report in reports if getattr(report, "when", None) == "call"
            for name, value in getattr(report, "user_properties", ()) if name == FIGURE]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    reports = [r for reports in terminalreporter.stats.values() for r in reports]
    lines = figures(reports)
    if lines:
        terminalreporter.section("figures recorded by the tests")
        for line in lines:
            terminalreporter.write_line(line)
    cpu = cpugroups.summary(reports)
    if cpu:
        terminalreporter.section("CPU and wall seconds by folder and module")
        for line in cpu:
            terminalreporter.write_line(line)


# Each worker (and everything it starts) in control groups of its own
# (tests/harness/cpugroups.py); every report carries the CPU used since the last one.
_cpu_group: cpugroups.Group | None = None
_cpu_mark = 0.0


def pytest_sessionstart(session: pytest.Session) -> None:
    global _cpu_group, _cpu_mark
    _cpu_group = cpugroups.Group.join(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}")
    _cpu_mark = _cpu_group.seconds() if _cpu_group else 0.0


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _cpu_group is not None:
        _cpu_group.leave()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    global _cpu_mark
    report = yield
    if _cpu_group is not None:
        now = _cpu_group.seconds()
        report.user_properties.append((cpugroups.CPU_SECONDS, round(now - _cpu_mark, 3)))
        _cpu_mark = now
    return report


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


@pytest.fixture(autouse=True)
def _no_pip_in_the_test_process() -> Any:
    """pip imported in a worker turns off setuptools' own distutils for the rest of its life
    (setuptools' _distutils_hack), and every later first import of vLLM then fails in
    torch's import of setuptools. Tests that need pip run it in a process of its own."""
    had_pip = "pip" in sys.modules
    yield
    if not had_pip and "pip" in sys.modules:
        pytest.fail("this test imported pip into the test process; run pip in a subprocess "
                    "or read its version with importlib.metadata")
