"""llmhost.backend.cpus: which CPUs the serving threads move to, and the moving."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from llmhost.backend import cpus


@pytest.mark.parametrize(("allowed", "affinities", "expected"), [
    # vLLM's auto-binding on 2 CPUs: the worker on 0, CPU 1 left to the rest.
    ({0, 1}, [{0, 1}, {0}], {1}),
    # Several workers (tensor parallel), each bound to cores of its own.
    (set(range(8)), [set(range(8)), {0, 1, 2}, {3, 4, 5}], {6, 7}),
    # No worker bound (VLLM_CPU_OMP_THREADS_BIND=nobind): nothing moves.
    ({0, 1}, [{0, 1}, {0, 1}], set()),
    # Workers on every CPU between them: nothing is left, nothing moves.
    ({0, 1}, [{0}, {1}], set()),
    # No engine processes at all.
    ({0, 1, 2, 3}, [], set()),
])
def test_frontend_cpus(allowed: set[int], affinities: list[set[int]], expected: set[int]) -> None:
    assert cpus.frontend_cpus(allowed, affinities) == expected


def test_worker_cpus_ignores_processes_outside_the_allowed_set() -> None:
    # A process bound elsewhere than this stub's CPUs is not one of its workers'.
    assert cpus.worker_cpus({0, 1, 2, 3}, [{2}, {4, 5}, set()]) == {2}


class _Proc:
    def __init__(self, pid: int, name: str = "tritonserver", kids: list[Any] | None = None,
                 affinity: list[int] | None = None) -> None:
        self.pid = pid
        self._name = name
        self._kids = kids or []
        self._affinity = affinity or []

    def children(self, recursive: bool = False) -> list[Any]:
        return self._kids

    def cpu_affinity(self) -> list[int]:
        return self._affinity

    def parent(self) -> Any:
        return self._parent

    def name(self) -> str:
        return self._name


def _fake(monkeypatch: pytest.MonkeyPatch, allowed: set[int], kids: list[_Proc], parent: str) -> dict[int, set[int]]:
    me = _Proc(os.getpid(), "triton_python_backend_stub", kids)
    me._parent = _Proc(4242, parent)  # type: ignore[attr-defined]
    monkeypatch.setattr(cpus.psutil, "Process", lambda: me)
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: allowed)
    pinned: dict[int, set[int]] = {}
    monkeypatch.setattr(cpus, "pin_threads", lambda pid, c: pinned.setdefault(pid, set(c)) and 3)
    return pinned


def test_pin_frontend_moves_the_stub_and_its_tritonserver(monkeypatch: pytest.MonkeyPatch) -> None:
    logs: list[str] = []
    pinned = _fake(monkeypatch, {0, 1}, [_Proc(10, "VLLM::EngineCore", affinity=[0, 1]),
                                         _Proc(11, "VLLM::Worker", affinity=[0])], "tritonserver")
    assert cpus.pin_frontend(logs.append) == {1}
    # The stub and tritonserver to CPU 1; vLLM's unbound EngineCore to the worker's CPU 0.
    assert pinned == {os.getpid(): {1}, 4242: {1}, 10: {0}}
    assert logs == ["CPUs: engine workers on 0; moved tritonserver's 3 threads and this stub's 3 to 1, "
                    "the engine's other 1 process(es) to the workers'"]


@pytest.mark.parametrize(("kids", "parent", "said"), [
    ([_Proc(11, "VLLM::Worker", affinity=[0, 1])], "tritonserver", "not bound to a subset of 0,1"),
    ([_Proc(11, "VLLM::Worker", affinity=[0])], "python3", "not started by tritonserver"),
])
def test_pin_frontend_leaves_everything_alone(monkeypatch: pytest.MonkeyPatch, kids: list[_Proc], parent: str,
                                              said: str) -> None:
    logs: list[str] = []
    pinned = _fake(monkeypatch, {0, 1}, kids, parent)
    assert cpus.pin_frontend(logs.append) == set()
    assert pinned == {}
    assert said in logs[0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to move a thread between")
def test_pin_threads_sets_every_thread_of_a_process() -> None:
    # For real, on a thread of this process (restored afterwards).
    before = os.sched_getaffinity(0)
    target = {min(before)}
    started, stop = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def body() -> None:
        started.set()
        stop.wait(10)
        seen["thread"] = os.sched_getaffinity(0)

    t = threading.Thread(target=body)
    t.start()
    started.wait(10)
    try:
        assert cpus.pin_threads(os.getpid(), target) >= 2
        assert os.sched_getaffinity(0) == target
    finally:
        stop.set()
        t.join()
        cpus.pin_threads(os.getpid(), before)
    assert seen["thread"] == target
    assert cpus.pin_threads(2 ** 22 + 7, target) == 0  # no such process: nothing set, no error
