"""On the real server (KIND_CPU): the serving threads stay off the engine workers' cores."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from tests.harness.server import Server


def _threads_affinity(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(t.name))) for t in Path(f"/proc/{pid}/task").iterdir()}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="vLLM binds its worker to all CPUs of a 1-CPU machine")
def test_tritonserver_and_stub_run_off_the_workers_cores(server: Server) -> None:
    tritonserver = psutil.Process(server.proc.pid)
    while tritonserver.name() != "tritonserver":  # llmhost serve may start it through a wrapper
        kids = tritonserver.children()
        assert kids, "no tritonserver process under llmhost serve"
        tritonserver = kids[0]
    procs = tritonserver.children(recursive=True)
    stubs = [p for p in procs if p.name().startswith("triton_python")]
    workers = [p for p in procs if "Worker" in p.name()]
    cores = [p for p in procs if "EngineCor" in p.name()]
    assert stubs and workers and cores, [p.name() for p in procs]
    worker_cpus = set().union(*(set(w.cpu_affinity()) for w in workers))
    allowed = set(os.sched_getaffinity(0))
    assert worker_cpus < allowed, "vLLM bound its worker to every CPU: nothing left to move the frontend to"
    for proc in (tritonserver, *stubs):
        masks = _threads_affinity(proc.pid)
        # Every thread, those made after the move too (the HTTP/gRPC frontends start
        # after the model loads), runs on the CPUs the workers do not use.
        assert masks == {frozenset(allowed - worker_cpus)}, (proc.name(), masks)
    for proc in cores:  # vLLM's scheduler takes turns with the workers, on their CPUs
        assert _threads_affinity(proc.pid) == {frozenset(worker_cpus)}, proc.name()
    assert "CPUs: engine workers on" in server.log.read_text(errors="replace")
