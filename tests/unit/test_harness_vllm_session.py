"""The `vllm serve` harness (tests/harness/vllm_server.py) lists the processes of a
server's session while other processes come and go: one that ends between being listed
and being asked its session is not one of them, and is no error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness import vllm_server


def test_a_process_that_ended_while_listed_is_left_out(monkeypatch: pytest.MonkeyPatch):
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True) as leader:
        try:
            real_getsid = os.getsid
            asked: list[int] = []

            def getsid(pid: int) -> int:
                asked.append(pid)
                if pid != leader.pid:  # every other process ended just now
                    raise ProcessLookupError(3, "No such process")
                return real_getsid(pid)

            monkeypatch.setattr(vllm_server.os, "getsid", getsid)
            found = vllm_server._session(leader)
            assert [p.pid for p in found] == [leader.pid]
            assert len(asked) > 1  # the other processes were asked too, and left out
        finally:
            leader.kill()
