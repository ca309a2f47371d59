"""Ending leftover processes without leaking their shared memory.

vLLM's engine and workers create POSIX shared memory (the executor's message queues,
hundreds of MiB on CPU hosts, /dev/shm/psm_*) and named semaphores
(/dev/shm/sem.mp-*). Python's multiprocessing resource tracker, a helper process of
theirs, unlinks what they leave behind once every process that shares it has ended
(it reads end-of-file then). Killed at the same time as them, it leaks all of it:
memory that stays taken until the host reboots. So the processes are ended first,
stopped ones woken so that SIGTERM reaches them, and the trackers are given time to
clean up and leave on their own before they too are killed.
"""

from __future__ import annotations

import contextlib
import signal

import psutil

TRACKER_MODULE = "multiprocessing.resource_tracker"


def is_resource_tracker(proc: psutil.Process) -> bool:
    try:
        return any(TRACKER_MODULE in arg for arg in proc.cmdline())
    except psutil.Error:
        return False


def end_processes(procs: list[psutil.Process], grace_s: float = 10.0, tracker_grace_s: float = 10.0) -> None:
    """SIGTERM PROCS (SIGCONT too, for a stopped one), SIGKILL what is left after
    GRACE_S; the resource trackers among them get TRACKER_GRACE_S more to unlink what
    the others left and exit, and only then SIGKILL."""
    trackers = [p for p in procs if is_resource_tracker(p)]
    others = [p for p in procs if p not in trackers]
    for p in others:
        with contextlib.suppress(psutil.Error):
            p.terminate()
            p.send_signal(signal.SIGCONT)
    _, alive = psutil.wait_procs(others, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    _, alive = psutil.wait_procs(trackers, timeout=tracker_grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


def kill_processes(procs: list[psutil.Process], tracker_grace_s: float = 10.0) -> None:
    """SIGKILL PROCS at once, except their resource trackers, which get TRACKER_GRACE_S
    to unlink what the others left and exit first."""
    end_processes(procs, grace_s=0.0, tracker_grace_s=tracker_grace_s)
