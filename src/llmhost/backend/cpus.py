"""Keeping Triton's serving threads off a CPU engine's cores (KIND_CPU).

vLLM's CPU backend binds each worker's OpenMP threads to cores of its own
(``VLLM_CPU_OMP_THREADS_BIND``, "auto" by default) and leaves the rest of the
process's CPUs, at least one, to "the other processes": the engine's scheduler and
whatever serves the requests. It does not move those there. Left anywhere, the
serving threads that handle every token (tritonserver's frontend, this stub's
response threads) land on the worker's cores too, and every time slice they take
there stalls the engine's step: on the 2-core machine the worker ran 10-11 s of
15 and the Triton path's tokens/s fell by a third (docs/performance.md).

Once the engine is up, ``pin_frontend`` reads which CPUs the engine's workers were
bound to, and moves this stub's threads and its parent tritonserver's onto the
others. Threads made later inherit the mask of the thread that makes them. The
engine's other processes (vLLM's EngineCore, the scheduler) go to the workers'
CPUs: the scheduler and the workers take turns every step, and on the serving
CPUs the scheduler waited behind the serving threads (docs/performance.md).
It runs only with the model setting ``pin_frontend_cpus: true`` (opt-in). Nothing
moves when the workers are not bound (``nobind``), when they took every CPU, or
when the parent is not a tritonserver.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

_TRITONSERVER = "tritonserver"


def worker_cpus(allowed: set[int], affinities: Iterable[set[int]]) -> set[int]:
    """The CPUs the engine's bound workers use: every descendant's affinity that is
    a strict subset of ALLOWED (an unbound process keeps all of them)."""
    bound: set[int] = set()
    for cpus in affinities:
        if cpus and cpus < allowed:
            bound |= cpus
    return bound


def frontend_cpus(allowed: set[int], affinities: Iterable[set[int]]) -> set[int]:
    """The CPUs left to the serving threads; empty when nothing should move (no
    bound worker, or the workers cover every allowed CPU)."""
    bound = worker_cpus(allowed, affinities)
    if not bound:
        return set()
    return allowed - bound


def _descendants(me: psutil.Process) -> list[tuple[int, set[int]]]:
    """(pid, affinity) of every process the engine started."""
    out = []
    for proc in me.children(recursive=True):
        try:
            out.append((proc.pid, set(proc.cpu_affinity())))
        except psutil.Error:
            continue  # gone meanwhile
    return out


def pin_threads(pid: int, cpus: set[int]) -> int:
    """Sets every thread of PID to CPUS; returns how many were set."""
    done = 0
    try:
        tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            done += 1
        except (ProcessLookupError, PermissionError):
            continue  # a thread that ended meanwhile, or one we may not move
    return done


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def pin_frontend(log: Callable[[str], None]) -> set[int]:
    """Moves this process's threads and its tritonserver parent's onto the CPUs the
    engine's workers do not use. Returns those CPUs (empty: nothing moved)."""
    me = psutil.Process()
    allowed = set(os.sched_getaffinity(0))
    engine = _descendants(me)
    cpus = frontend_cpus(allowed, [a for _, a in engine])
    if not cpus:
        log(f"CPUs: the engine's workers are not bound to a subset of {_cpu_list(allowed)}; "
            "the serving threads stay where they are")
        return set()
    parent = me.parent()
    if parent is None or parent.name() != _TRITONSERVER:
        log("CPUs: not started by tritonserver; the serving threads stay where they are")
        return set()
    workers = allowed - cpus
    mine = pin_threads(me.pid, cpus)
    theirs = pin_threads(parent.pid, cpus)
    # The engine's unbound processes (the scheduler) join the workers.
    unbound = [pid for pid, a in engine if a == allowed]
    for pid in unbound:
        pin_threads(pid, workers)
    log(f"CPUs: engine workers on {_cpu_list(workers)}; moved tritonserver's {theirs} threads and this "
        f"stub's {mine} to {_cpu_list(cpus)}, the engine's other {len(unbound)} process(es) to the workers'")
    return cpus
