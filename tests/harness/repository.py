"""Triton's model repository API (explicit model control) against a `llmhost serve`
started with ``--triton-arg=--model-control-mode=explicit``: model directories made
from the one serve rendered, load / unload / index with the admin key, and what a
server leaves behind (its processes, /dev/shm segments)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import requests

from llmhost.server.admin_key import HEADER, read_key
from llmhost.server.reaping import is_resource_tracker, kill_processes
from tests.harness.server import Server

LOAD_TIMEOUT_S = 600  # a vLLM engine on a busy 2-core machine; a bound, not a target
# The python backend's shared-memory regions get this prefix on the servers these
# tests start, so that a leftover is told from another server's segment.
SHM_PREFIX = "llmhost_e2e_shm"


def explicit_args(shm_prefix: str = SHM_PREFIX, load: str = "tiny") -> list[str]:
    """`llmhost serve` arguments: explicit model control, MODEL loaded at start."""
    return ["--triton-arg=--model-control-mode=explicit", f"--triton-arg=--load-model={load}",
            f"--triton-arg=--backend-config=python,shm-region-prefix-name={shm_prefix}"]


def workdir_of(server: Server) -> Path:
    """serve's --workdir (the harness passes <its workdir>/triton)."""
    return server.log.parent / "triton"


def repository(server: Server) -> Path:
    return workdir_of(server) / "models"


def admin_headers(server: Server) -> dict[str, str]:
    return {HEADER: read_key(workdir_of(server) / "admin-key")}


def add_model(server: Server, name: str, params: dict[str, str] | None = None,
              engine_args: dict[str, Any] | None = None, model_json: str | None = None) -> Path:
    """A copy of the served model's directory as model NAME: config.pbtxt's parameters
    replaced by PARAMS (none when None), ENGINE_ARGS merged into model.json, or
    MODEL_JSON written as model.json's text instead."""
    src = repository(server) / server.name
    dst = repository(server) / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    config = (dst / "config.pbtxt").read_text()
    config = config.replace(f'name: "{server.name}"', f'name: "{name}"')
    config = re.sub(r"parameters: \{\s*key: \"[A-Z_]+\"\s*value: \{[^}]*\}\s*\}", "", config)
    for key, value in (params or {}).items():
        config += f'\nparameters: {{\n  key: "{key}"\n  value: {{ string_value: "{value}" }}\n}}\n'
    (dst / "config.pbtxt").write_text(config)
    if model_json is not None:
        (dst / "model.json").write_text(model_json)
    elif engine_args:
        data = json.loads((dst / "model.json").read_text())
        data.update(engine_args)
        (dst / "model.json").write_text(json.dumps(data, indent=2))
    return dst


# A load that has not answered in this long hit Triton 24.10's stub-launch hang
# (docs/testing.md): its loading thread waits for a stub that initialised and waits on.
STUCK_LOAD_S = 300


class StuckLoad(RuntimeError):
    """A load that Triton's stub-launch hang holds for good: the server must go."""


def load(server: Server, name: str) -> requests.Response:
    """Load NAME. A load with no answer in STUCK_LOAD_S whose stub has started its
    engine may be slow (a busy machine): it gets until LOAD_TIMEOUT_S to leave LOADING.
    One still loading then, or whose stub started nothing, is in Triton's stub-launch
    hang: it is ended by killing that model's stub (its resource tracker last, so no
    shared memory leaks), which fails the launch, and tried once more. Either says so
    on standard error."""
    url = f"{server.http}/v2/repository/models/{name}/load"
    try:
        return requests.post(url, headers=admin_headers(server), timeout=STUCK_LOAD_S)
    except requests.ReadTimeout:
        pass

    def loading() -> bool:
        return index(server).get(name, {}).get("state") == "LOADING"

    stubs = [p for p in server.descendants() if _is_stub_of(p, name)]
    started = [p for stub in stubs for p in _children(stub) if not is_resource_tracker(p)]
    if started:
        print(f"repository.load: {name} did not load in {STUCK_LOAD_S} s but its stub started "
              f"{[p.pid for p in started]}; waiting for the load", file=sys.stderr, flush=True)
        wait_until(lambda: not loading(), LOAD_TIMEOUT_S - STUCK_LOAD_S)
    if loading():
        stubs = [p for p in server.descendants() if _is_stub_of(p, name)]
        print(f"repository.load: {name} did not load (Triton's stub-launch hang); killing its stub(s) "
              f"{[p.pid for p in stubs]} and loading it again", file=sys.stderr, flush=True)
        kill_processes([p for stub in stubs for p in [*_children(stub), stub]])
        wait_until(lambda: not loading(), 120)
    try:
        return requests.post(url, headers=admin_headers(server), timeout=STUCK_LOAD_S)
    except requests.ReadTimeout:
        raise StuckLoad(f"{name} did not load again after its stub was killed: tritonserver is left in "
                        "Triton's stub-launch hang (docs/testing.md)") from None


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _is_stub_of(proc: psutil.Process, name: str) -> bool:
    """Whether PROC is the python backend stub of a model NAME (its model.py's path names it)."""
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return False
    return bool(cmdline) and "triton_python_backend_stub" in cmdline[0] and any(
        f"/{name}/" in arg for arg in cmdline[1:2])


def unload(server: Server, name: str) -> requests.Response:
    return requests.post(f"{server.http}/v2/repository/models/{name}/unload", headers=admin_headers(server),
                         timeout=LOAD_TIMEOUT_S)


def index(server: Server) -> dict[str, dict[str, Any]]:
    """The repository index by model name (state READY, UNAVAILABLE, ...)."""
    r = requests.post(f"{server.http}/v2/repository/index", headers=admin_headers(server), json={}, timeout=30)
    r.raise_for_status()
    return {m["name"]: m for m in r.json()}


def ready(server: Server, name: str) -> bool:
    try:
        return requests.get(f"{server.http}/v2/models/{name}/ready", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def wait_until(check: Any, timeout_s: float, every_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every_s)
    return bool(check())


def tritonserver(server: Server) -> psutil.Process:
    procs = [p for p in server.descendants() if p.name() == "tritonserver"]
    assert len(procs) == 1, procs
    return procs[0]


def live_pids(server: Server) -> set[int]:
    """Every process under `llmhost serve` that is not a zombie."""
    out = set()
    for p in server.descendants():
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def describe(pids: set[int]) -> list[str]:
    out = []
    for pid in sorted(pids):
        try:
            p = psutil.Process(pid)
            out.append(f"{pid} {' '.join(p.cmdline())[:160] or p.name()}")
        except psutil.NoSuchProcess:
            out.append(f"{pid} (gone)")
    return out


def shm_segments() -> set[str]:
    return set(os.listdir("/dev/shm"))


def mapped_segments() -> set[str]:
    """/dev/shm names some live process maps (any user's we can read)."""
    out: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        out.update(m.group(1) for m in re.finditer(r"/dev/shm/(\S+)", text))
    return out


def leftover_segments(before: set[str], prefix: str = SHM_PREFIX, settle_s: float = 20.0) -> set[str]:
    """Segments new since BEFORE that are ours (the python backend's, by PREFIX) or
    that no live process maps (a leak), and still there after SETTLE_S. The segments of
    other servers running on this machine at the same time (another test worker's) are
    mapped by them, or gone again once their process ended and its resource tracker
    cleaned up: neither is a leak. That cleanup took over 5 s once on a busy machine (a
    multiprocessing semaphore, sem.mp-*, of another process), so SETTLE_S is 20 s."""
    deadline = time.monotonic() + settle_s
    while True:
        new = shm_segments() - before
        mapped = mapped_segments() if new else set()
        left = {s for s in new if (s.startswith(prefix) or s not in mapped) and (Path("/dev/shm") / s).exists()}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.5)
