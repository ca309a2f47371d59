"""How `make test` splits the tests between its workers (tests/conftest.py): the system
tests one unit, the e2e tests one unit, handed out first in that order; every other test
file a unit of its own; the CPU weight of each. And the figures tests record, printed at
the end."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import (
    CPU_WEIGHTS,
    FIGURE,
    LAST,
    NICENESS,
    OTHER_CPU_WEIGHT,
    collection_order,
    cpu_weight,
    figures,
    handed_out_first,
    work_unit,
)


def test_system_and_e2e_tests_are_one_unit_each_and_other_files_their_own():
    system = {work_unit("tests/system/test_faults.py::test_a"), work_unit("tests/system/test_provision.py::b")}
    assert system == {"tests/system"}
    assert work_unit("tests/e2e/test_shutdown.py::test_a[x]") == work_unit("tests/e2e/test_lora.py::b") == "tests/e2e"
    assert work_unit("tests/unit/test_gateway.py::test_a") == "tests/unit/test_gateway.py"
    assert work_unit("tests/ansible/test_triton.py::test_a") != work_unit("tests/ansible/test_gateway.py::test_a")
    assert work_unit("tests/e2e_like/test_x.py::a") == "tests/e2e_like/test_x.py"


def test_system_first_then_e2e_then_the_rest():
    ids = ["tests/unit/test_a.py::x", "tests/e2e/test_b.py::y", "tests/ansible/test_c.py::z",
           "tests/system/test_d.py::w"]
    assert sorted(ids, key=handed_out_first) == ["tests/system/test_d.py::w", "tests/e2e/test_b.py::y",
                                                 "tests/unit/test_a.py::x", "tests/ansible/test_c.py::z"]


def test_the_module_that_rolls_the_session_host_runs_last_among_the_system_tests():
    ids = ["tests/system/test_gateway_two_hosts.py::test_roll", "tests/e2e/test_b.py::y",
           "tests/system/test_provision.py::a", "tests/unit/test_a.py::x", "tests/system/test_security.py::b"]
    assert LAST == ("tests/system/test_gateway_two_hosts.py",)
    assert sorted(ids, key=collection_order) == [
        "tests/system/test_provision.py::a", "tests/system/test_security.py::b",
        "tests/system/test_gateway_two_hosts.py::test_roll", "tests/e2e/test_b.py::y", "tests/unit/test_a.py::x"]


def test_the_system_tests_weigh_the_most_the_e2e_tests_less_the_rest_the_least():
    system = cpu_weight("tests/system/test_gateway_two_hosts.py::test_roll")
    assert system == cpu_weight("tests/system/test_faults.py::test_a") == CPU_WEIGHTS["tests/system"]
    e2e = cpu_weight("tests/e2e/test_shutdown.py::a")
    assert system > e2e > OTHER_CPU_WEIGHT > 0
    for nodeid in ("tests/ansible/test_gateway.py::b", "tests/unit/test_x.py::c",
                   "tests/system_like/test_x.py::d", "tests/e2e_like/test_x.py::e"):
        assert cpu_weight(nodeid) == OTHER_CPU_WEIGHT, nodeid
    # Without control groups a nice value stands in, lower for a larger weight.
    assert sorted(NICENESS) == sorted({system, e2e, OTHER_CPU_WEIGHT})
    assert NICENESS[system] < NICENESS[e2e] < NICENESS[OTHER_CPU_WEIGHT]


def test_figures_come_from_the_call_of_each_test_in_order():
    reports = [
        SimpleNamespace(nodeid="t.py::setup_only", when="setup", user_properties=[(FIGURE, "not from a setup")]),
        SimpleNamespace(nodeid="t.py::roll", when="call", user_properties=[(FIGURE, "failed requests: 0 of 9"),
                                                                           ("other", "not a figure")]),
        SimpleNamespace(nodeid="t.py::none", when="call", user_properties=[]),
        SimpleNamespace(nodeid="t.py::roll", when="call", user_properties=[(FIGURE, "truncated streams: 0")]),
        SimpleNamespace(nodeid="t.py::warning"),  # a report of another kind: no phase, no properties
    ]
    assert figures(reports) == ["t.py::roll: failed requests: 0 of 9", "t.py::roll: truncated streams: 0"]
