"""How `make test` splits the tests between its workers (tests/conftest.py): the system
tests one unit, the two-host module one of its own, the e2e tests one unit, handed out
first in that order; every other test file a unit of its own. And the figures tests
record, printed at the end."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import (
    E2E_PRIORITY,
    FIGURE,
    LOWER_PRIORITY,
    figures,
    handed_out_first,
    niceness,
    work_unit,
)


def test_system_two_host_and_e2e_tests_are_one_unit_each_and_other_files_their_own():
    system = {work_unit("tests/system/test_faults.py::test_a"), work_unit("tests/system/test_provision.py::b")}
    assert system == {"tests/system"}
    two_hosts = {work_unit("tests/system/test_gateway_two_hosts.py::test_roll"),
                 work_unit("tests/system/test_gateway_two_hosts.py::test_b[x]")}
    assert two_hosts == {"tests/system/test_gateway_two_hosts.py"}
    assert work_unit("tests/e2e/test_shutdown.py::test_a[x]") == work_unit("tests/e2e/test_lora.py::b") == "tests/e2e"
    assert work_unit("tests/unit/test_gateway.py::test_a") == "tests/unit/test_gateway.py"
    assert work_unit("tests/ansible/test_triton.py::test_a") != work_unit("tests/ansible/test_gateway.py::test_a")
    assert work_unit("tests/e2e_like/test_x.py::a") == "tests/e2e_like/test_x.py"
    assert work_unit("tests/system/test_gateway_two_hosts_like.py::a") == "tests/system"


def test_system_first_then_the_two_host_module_then_e2e_then_the_rest():
    ids = ["tests/unit/test_a.py::x", "tests/e2e/test_b.py::y", "tests/ansible/test_c.py::z",
           "tests/system/test_gateway_two_hosts.py::test_roll", "tests/system/test_d.py::w"]
    assert sorted(ids, key=handed_out_first) == [
        "tests/system/test_d.py::w", "tests/system/test_gateway_two_hosts.py::test_roll", "tests/e2e/test_b.py::y",
        "tests/unit/test_a.py::x", "tests/ansible/test_c.py::z"]


def test_the_booted_hosts_run_at_the_normal_cpu_priority_e2e_a_little_lower_the_rest_lower():
    assert niceness("tests/system/test_gateway_two_hosts.py::test_roll") == 0
    assert niceness("tests/system/test_faults.py::test_a") == 0
    assert 0 < E2E_PRIORITY < LOWER_PRIORITY
    assert niceness("tests/e2e/test_shutdown.py::a") == E2E_PRIORITY
    for nodeid in ("tests/ansible/test_gateway.py::b", "tests/unit/test_x.py::c",
                   "tests/system_like/test_x.py::d", "tests/e2e_like/test_x.py::e"):
        assert niceness(nodeid) == LOWER_PRIORITY, nodeid


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
