"""A test worker's control groups (tests/harness/cpugroups.py): joined, counted and
weighted, and the seconds added up by folder and module from the reports."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from tests.harness.cpugroups import CPU_SECONDS, GROUP_PREFIX, Group, folder_of, summary, totals


def _report(nodeid: str, cpu: float | None, duration: float) -> SimpleNamespace:
    props = [] if cpu is None else [(CPU_SECONDS, cpu)]
    return SimpleNamespace(nodeid=nodeid, user_properties=[("figure", "x"), *props], duration=duration)


def _hierarchies(root: Path, *names: str) -> Path:
    for name in names:
        (root / name).mkdir(parents=True)
    return root


def test_a_worker_joins_groups_of_its_own_reads_its_counter_and_sets_its_weight(tmp_path: Path):
    group = Group.join("gw0-1", root=_hierarchies(tmp_path, "cpuacct", "cpu"))
    assert group is not None
    assert group.accounting == tmp_path / "cpuacct" / f"{GROUP_PREFIX}gw0-1"
    assert group.weighting == tmp_path / "cpu" / f"{GROUP_PREFIX}gw0-1"
    for path in (group.accounting, group.weighting):
        assert (path / "cgroup.procs").read_text() == f"{os.getpid()}\n"
    (group.accounting / "cpuacct.usage").write_text("2500000000\n")
    assert group.seconds() == 2.5
    assert group.weigh(2048)
    assert (group.weighting / "cpu.shares").read_text() == "2048\n"
    group.leave(root=tmp_path)
    assert (tmp_path / "cpu" / "cgroup.procs").read_text() == f"{os.getpid()}\n"


def test_without_a_cpu_hierarchy_it_is_counted_but_not_weighted(tmp_path: Path):
    group = Group.join("gw1-2", root=_hierarchies(tmp_path, "cpuacct"))
    assert group is not None and group.weighting is None
    assert not group.weigh(512)


def test_no_group_where_the_hierarchy_cannot_be_written(tmp_path: Path):
    assert Group.join("gw0-1", root=tmp_path / "not-there") is None


def test_seconds_add_up_by_folder_and_by_module():
    reports = [
        _report("tests/e2e/test_a.py::t1", 10.0, 12.0),
        _report("tests/e2e/test_a.py::t2", 5.5, 1.0),
        _report("tests/e2e/test_b.py::t", 1.0, 2.0),
        _report("tests/unit/test_c.py::t[x]", 0.5, 0.25),
        _report("tests/unit/test_c.py::t[y]", None, 0.0),  # neither: left out
    ]
    folders, modules, tests = totals(reports)
    assert folders == {"tests/e2e": [16.5, 15.0], "tests/unit": [0.5, 0.25]}
    assert modules == {"tests/e2e/test_a.py": [15.5, 13.0], "tests/e2e/test_b.py": [1.0, 2.0],
                       "tests/unit/test_c.py": [0.5, 0.25]}
    assert tests["tests/e2e/test_a.py::t1"] == [10.0, 12.0] and "tests/unit/test_c.py::t[y]" not in tests
    assert folder_of("tests/e2e/test_a.py::t1") == "tests/e2e"
    lines = summary(reports, top=2)
    assert lines[1].split() == ["16", "15", "tests/e2e"]  # the most CPU first
    assert lines[3].split() == ["17", "15", "all"]
    modules_at = lines.index(next(x for x in lines if x.endswith("module (the 2 that used the most CPU)")))
    assert [line.split()[-1] for line in lines[modules_at + 1:modules_at + 3]] == ["tests/e2e/test_a.py",
                                                                                 "tests/e2e/test_b.py"]
    assert lines[-3].endswith("test (the 2 that used the most CPU)")
    assert [line.split()[-1] for line in lines[-2:]] == ["tests/e2e/test_a.py::t1", "tests/e2e/test_a.py::t2"]


def test_nothing_is_printed_without_measurements():
    assert summary([_report("tests/unit/test_c.py::t", None, 3.0)]) == []
