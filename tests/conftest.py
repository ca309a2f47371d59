"""Shared fixtures: the tiny model (made once per session). Helpers are in tests/harness.

`make test` runs the tests in three pytest-xdist workers (``--dist loadscope``) with the
scheduler below. The system tests share one booted host per worker, so they are one
unit of work; the two-host module, which rolls changes over its hosts for good, is a
unit of its own (its worker boots and converges a host of its own); the e2e tests are
one unit too, so that one worker at a time runs tritonserver and vLLM for them. The
three go out first, one to each worker; every other module is a unit of its own and
fills in after them.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

from tests.harness import cpuacct

# The units of work of several tests each (a folder, or a module whose tests share a
# fixture no other worker may touch), in the order they are handed out; node ids are
# relative to the repository's root. A module named here is taken out of its folder's
# unit. In one process (TEST_WORKERS=0) the units run in this order too: the two-host
# module, which leaves its host changed for good, after the other system tests that
# then share that host.
UNITS = ("tests/system", "tests/system/test_gateway_two_hosts.py", "tests/e2e")
# The units whose tests drive booted hosts.
BOOTED_HOSTS = UNITS[:2]


def work_unit(nodeid: str) -> str:
    """The unit of work of a test: the most specific entry of UNITS it is in, else its file."""
    path = nodeid.split("::", 1)[0]
    within = [unit for unit in UNITS if path == unit or path.startswith(unit + "/")]
    return max(within, key=len) if within else path


def handed_out_first(nodeid: str) -> int:
    """A test's place in the collection: the units of UNITS in their order, then the rest."""
    unit = work_unit(nodeid)
    return UNITS.index(unit) if unit in UNITS else len(UNITS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: handed_out_first(item.nodeid))  # stable: the order within each part stays


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


# The booted hosts' units are the run's longest paths, and the cores are busy for most of
# the run. So the processes of every other test (its pytest worker and what it starts:
# tritonserver, vLLM, Ansible) run at a lower CPU priority and take what the booted hosts
# leave: the e2e tests a little lower, the modules that fill in after them lower still.
# The booted hosts inherit their worker's priority. Without root a process cannot raise
# its priority again: then it stays as it is.
E2E_PRIORITY = 2
LOWER_PRIORITY = 5


def niceness(nodeid: str) -> int:
    """The nice value the processes of a test run at: 0 for the system tests, E2E_PRIORITY
    for the e2e tests, else LOWER_PRIORITY."""
    unit = work_unit(nodeid)
    if unit in BOOTED_HOSTS:
        return 0
    return E2E_PRIORITY if unit == "tests/e2e" else LOWER_PRIORITY


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
    reports = [r for reports in terminalreporter.stats.values() for r in reports]
    lines = figures(reports)
    if lines:
        terminalreporter.section("figures recorded by the tests")
        for line in lines:
            terminalreporter.write_line(line)
    cpu = cpuacct.summary(reports)
    if cpu:
        terminalreporter.section("CPU and wall seconds by folder and module")
        for line in cpu:
            terminalreporter.write_line(line)


# Each worker's CPU (and that of everything it starts) in a cpuacct group of its own
# (tests/harness/cpuacct.py); every report carries what was used since the last one.
_cpu_group: cpuacct.Group | None = None
_cpu_mark = 0.0


def pytest_sessionstart(session: pytest.Session) -> None:
    global _cpu_group, _cpu_mark
    _cpu_group = cpuacct.Group.join(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}")
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
        report.user_properties.append((cpuacct.CPU_SECONDS, round(now - _cpu_mark, 3)))
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
