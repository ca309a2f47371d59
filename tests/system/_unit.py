"""The booted host's tritonserver unit as the system tests see it: its endpoint,
readiness, properties, processes (by control group), memory and the shared
memory segments its user owns."""

from __future__ import annotations

import time

from tests.harness.booted import BootedHost
from tests.harness.endpoint import Endpoint
from tests.system._converge import Converged

UNIT = "tritonserver"
# How long the play itself waits for tritonserver (roles/triton/vars: _triton_service_live_wait_s):
# one start of triton_service_ready_timeout_s (600 s) that hangs, RestartSec (10 s), the next start.
PLAY_WAIT_S = 2 * 600 + 10 + 30
USER = "llmhost"
MODEL = "tiny"


def endpoint(c: Converged, model: str = MODEL) -> Endpoint:
    return Endpoint(name=model, http=c.triton_http, grpc=f"127.0.0.1:{c.ports['grpc']}",
                    metrics=c.triton_metrics)


def wait_ready(url: str, model: str = MODEL, timeout_s: float = 300) -> bool:
    """True once MODEL's ready endpoint answers 200 (within TIMEOUT_S)."""
    ep = Endpoint(name=model, http=url, grpc="", metrics="")
    deadline = time.monotonic() + timeout_s
    while not ep.model_ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(1)
    return True


def wait_active(host: BootedHost, unit: str = UNIT, timeout_s: float = 30) -> str:
    """The unit's ActiveState once it is "active", or the last one seen after TIMEOUT_S.
    A start is over once the unit's start check has seen the server answer (it asks once
    a second), so a server answers a moment before its unit is active."""
    deadline = time.monotonic() + timeout_s
    while (state := props(host, "ActiveState", unit=unit)["ActiveState"]) != "active" and time.monotonic() < deadline:
        time.sleep(0.5)
    return state


def props(host: BootedHost, *names: str, unit: str = UNIT) -> dict[str, str]:
    return host.unit_props(unit, *names)


def unit_pids(host: BootedHost, unit: str = UNIT) -> set[int]:
    """Every process in the unit's control group (any cgroup layout)."""
    return host.unit_pids(unit)


def processes(host: BootedHost, user: str | None = None) -> dict[int, str]:
    """pid -> command line of every process in the host (of USER only, if given)."""
    r = host.exec("ps -eo pid=,user:32=,args=", check=True)
    out: dict[int, str] = {}
    for line in r.stdout.splitlines():
        pid, owner, args = [*line.split(None, 2), ""][:3]
        if user is None or owner == user:
            out[int(pid)] = args
    return out


def unit_rss_mib(host: BootedHost, unit: str = UNIT) -> float:
    """Resident memory of every process in the unit's control group."""
    pids = unit_pids(host, unit)
    if not pids:
        return 0.0
    r = host.exec(["ps", "-o", "rss=", "-p", ",".join(map(str, sorted(pids)))])
    return sum(int(x) for x in r.stdout.split()) / 1024


def shm_segments(host: BootedHost, user: str = USER) -> set[str]:
    """Names of the POSIX shared memory segments and semaphores in /dev/shm owned by USER."""
    r = host.exec(f"find /dev/shm -mindepth 1 -maxdepth 1 -user {user} -printf '%f\\n'")
    return set(r.stdout.split())
