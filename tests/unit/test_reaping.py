"""Ending a process tree leaves no shared memory: llmhost.server.reaping ends the
processes first and their multiprocessing resource tracker last, so the tracker
unlinks what they created. Real processes: a parent that spawns (as vLLM does) a
child creating a POSIX shared memory segment, the parent's tracker watching it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from llmhost.server.reaping import end_processes, is_resource_tracker, kill_processes

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp
    import time
    from multiprocessing import shared_memory

    def child():
        segment = shared_memory.SharedMemory(create=True, size=1 << 20)
        print(segment.name, flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        mp.get_context("spawn").Process(target=child).start()
        time.sleep(600)
""")


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    script = tmp_path / "spawner.py"
    script.write_text(SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    name = parent.stdout.readline().strip()
    assert name and (Path("/dev/shm") / name).exists(), name
    yield parent, name
    if parent.poll() is None:
        kill_processes(_all(parent))
    parent.wait(10)
    (Path("/dev/shm") / name).unlink(missing_ok=True)


def _all(parent: subprocess.Popen[str]) -> list[psutil.Process]:
    root = psutil.Process(parent.pid)
    return [*root.children(recursive=True), root]


def test_the_tree_has_a_resource_tracker(tree: tuple[subprocess.Popen[str], str]):
    parent, _ = tree
    assert [p for p in _all(parent) if is_resource_tracker(p)], [p.cmdline() for p in _all(parent)]


@pytest.mark.parametrize("end", [end_processes, kill_processes], ids=["terminate", "kill"])
def test_ending_the_tree_unlinks_its_segment(tree: tuple[subprocess.Popen[str], str], end):
    parent, name = tree
    procs = _all(parent)
    procs[-1].send_signal(signal.SIGSTOP)  # a stopped process too (a hung engine)
    end(procs)
    parent.wait(10)
    assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not (Path("/dev/shm") / name).exists(), f"{name} leaked"


def test_a_tracker_killed_with_the_others_leaks_the_segment(tree: tuple[subprocess.Popen[str], str]):
    """What the order avoids: the tracker gone before the others, nobody unlinks."""
    parent, name = tree
    procs = _all(parent)
    trackers = [p for p in procs if is_resource_tracker(p)]
    for p in [*trackers, *[p for p in procs if p not in trackers]]:
        p.kill()
    psutil.wait_procs(procs, timeout=10)
    parent.wait(10)
    assert (Path("/dev/shm") / name).exists()
