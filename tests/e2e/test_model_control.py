"""Explicit model control (tritonserver --model-control-mode=explicit, loads and
unloads through the repository API with the admin key), on one real server:

- ENABLE_VLLM_HEALTH_CHECK: killing the EngineCore of a model that has it on makes
  that model unavailable (Triton unloads it: not ready, not READY in the index,
  requests refused) while tritonserver and the other model keep serving;
- load, unload, a failing load (a bad model.json), load again, unload — twice —
  leaves no process, no thread and no /dev/shm segment behind after each unload,
  and tritonserver never aborts;
- stopping the server then leaves no process of ours and no segment.

The tests of this module run in order and share the server; the last one stops it.
It is the explicit-model-control server of tests/e2e/conftest.py, which
tests/e2e/test_metrics_contract.py uses before this module (its models unloaded
again): one start for both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests

from llmhost.backend.health import UNHEALTHY_MESSAGE
from llmhost.server.reaping import end_processes
from tests.e2e._client import generate
from tests.e2e._servers import ExplicitServers
from tests.harness import repository as repo
from tests.harness.server import Server, process_name, wait_gone

PROMPT = "def main():"
GONE_BOUND_S = 120  # an unloaded model's processes end within this (vLLM needs seconds to stop)
NOT_READY_BOUND_S = 120  # a dead engine's model reads not ready within this


@dataclasses.dataclass
class _State:
    server: Server
    triton_pid: int
    shm_before: set[str]
    stuck: str = ""  # why the server was ended: a load held by Triton's stub-launch hang


def _load(st: _State, name: str) -> requests.Response:
    """repository.load, and when Triton's stub-launch hang (an upstream bug of the
    python backend 24.10 under CPU starvation, docs/testing.md) holds the server for
    good, the server is ended, its processes before their resource trackers, and this
    and the module's later tests are skipped saying so: what they check needs a server
    that did not hit the hang."""
    if st.stuck:
        pytest.skip(st.stuck)
    try:
        return repo.load(st.server, name)
    except repo.StuckLoad as exc:
        st.stuck = f"skipped: {exc}"
        print(f"\n{st.stuck}", file=sys.stderr, flush=True)
        kids = st.server.descendants()
        with contextlib.suppress(psutil.Error):
            end_processes([*kids, psutil.Process(st.server.proc.pid)], grace_s=5)
        st.server.proc.wait(timeout=30)
        pytest.skip(st.stuck)


@pytest.fixture(scope="module")
def state(explicit_servers: ExplicitServers) -> Iterator[_State]:
    shared = explicit_servers.get()
    srv = shared.server
    st = _State(srv, repo.tritonserver(srv).pid, shared.shm_before)
    yield st
    if srv.proc.poll() is None:  # the last test did not get to stop it
        kids = srv.descendants()
        srv.stop()
        wait_gone(kids)


@pytest.fixture(autouse=True)
def _not_stuck(state: _State) -> None:
    if state.stuck:
        pytest.skip(state.stuck)


def _same_tritonserver(st: _State) -> None:
    """tritonserver neither aborted nor was restarted by `llmhost serve`."""
    assert st.server.proc.poll() is None, st.server.log_tail()
    assert repo.tritonserver(st.server).pid == st.triton_pid, st.server.log_tail()
    log = st.server.log.read_text(errors="replace")
    for sign in ("lock_exception", "core dumped", "terminate called"):
        assert sign not in log, st.server.log_tail()


def _wait_back_to(st: _State, pids: set[int], what: str) -> None:
    """After an unload: every process that was not there before it began is gone."""
    extra: set[int] = set()

    def settled() -> bool:
        nonlocal extra
        extra = repo.live_pids(st.server) - pids
        return not extra

    assert repo.wait_until(settled, GONE_BOUND_S), f"{what}: processes left: {repo.describe(extra)}"


def _engine_core(pids: set[int]) -> psutil.Process:
    cores = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if "EngineCore" in process_name(p):
                cores.append(p)
        except psutil.NoSuchProcess:
            pass
    assert len(cores) == 1, repo.describe(pids)
    return cores[0]


def _load_serve_unload(st: _State, name: str, base: set[int], what: str) -> None:
    """Load NAME, answer one request, unload it: back to the processes of BASE."""
    r = _load(st, name)
    assert r.status_code == 200, (what, r.text)
    assert generate(dataclasses.replace(st.server, name=name), text_input=PROMPT, max_tokens=4)["_status"] == 200
    r = repo.unload(st.server, name)
    assert r.status_code == 200, (what, r.text)
    _wait_back_to(st, base, what)
    assert not repo.ready(st.server, name), what


def test_health_check_on_a_dead_engine_makes_the_model_unavailable(state: _State):
    srv = state.server
    base = repo.live_pids(srv)
    repo.add_model(srv, "tiny_hc", params={"REPORT_CUSTOM_METRICS": "true", "ENABLE_VLLM_HEALTH_CHECK": "true"})
    r = _load(state, "tiny_hc")
    assert r.status_code == 200, r.text
    hc = dataclasses.replace(srv, name="tiny_hc")
    assert generate(hc, text_input=PROMPT, max_tokens=4)["_status"] == 200
    assert repo.ready(srv, "tiny_hc") and repo.index(srv)["tiny_hc"]["state"] == "READY"

    _engine_core(repo.live_pids(srv) - base).send_signal(signal.SIGKILL)
    assert repo.wait_until(lambda: not repo.ready(srv, "tiny_hc"), NOT_READY_BOUND_S), srv.log_tail()
    assert repo.index(srv)["tiny_hc"]["state"] != "READY"
    refused = generate(hc, text_input=PROMPT, max_tokens=4)
    assert refused["_status"] >= 400, refused
    # Triton's own "unknown model" once the unload is done; ours just before it.
    error = refused.get("error", "")
    assert "tiny_hc" in error or UNHEALTHY_MESSAGE in error, refused
    log = srv.log.read_text(errors="replace")
    assert "ENABLE_VLLM_HEALTH_CHECK: the engine is unhealthy" in log, srv.log_tail()
    # The server was not stopped, and the other model still serves.
    _same_tritonserver(state)
    assert repo.ready(srv, srv.name) and generate(srv, text_input=PROMPT, max_tokens=4)["_status"] == 200
    _wait_back_to(state, base, "the unhealthy model's unload")


def test_load_unload_and_failing_loads_leave_nothing_behind(state: _State):
    srv = state.server
    base = repo.live_pids(srv)  # the served model's stub and EngineCore
    shm_base = repo.shm_segments()
    threads: list[int] = []
    repo.add_model(srv, "tiny_cycle", params={"REPORT_CUSTOM_METRICS": "true"})
    repo.add_model(srv, "tiny_bad", params={"REPORT_CUSTOM_METRICS": "true"}, model_json='{"model": ')
    for round_ in (1, 2):
        _load_serve_unload(state, "tiny_cycle", base, f"round {round_}, first load")

        r = _load(state, "tiny_bad")
        assert r.status_code >= 400, (round_, r.text)
        assert "model.json" in r.text, r.text  # the load error names the bad file
        _wait_back_to(state, base, f"round {round_}, failing load")
        _same_tritonserver(state)

        _load_serve_unload(state, "tiny_cycle", base, f"round {round_}, load after the failing one")
        left = repo.leftover_segments(shm_base)
        assert not left, f"round {round_}: /dev/shm segments left: {sorted(left)}"
        threads.append(repo.tritonserver(srv).num_threads())
        _same_tritonserver(state)
    # Threads of tritonserver: a round leaves none behind (the second ends with no more than the first).
    assert threads[1] <= threads[0], threads
    assert repo.ready(srv, srv.name)


def test_a_repository_laid_out_for_nvidias_vllm_backend_loads_unchanged(state: _State, tiny_model: Path):
    """vllm_backend's own sample layout: config.pbtxt with only the backend and a
    KIND_MODEL instance group (no name, no parameters), model.json in the version
    directory, nothing at the model level; its client's request shape (text_input,
    sampling_parameters as a JSON string, exclude_input_in_output)."""
    srv = state.server
    base = repo.live_pids(srv)
    model = repo.repository(srv) / "nv_layout"
    if model.exists():
        shutil.rmtree(model)
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'backend: "vllm"\n\ninstance_group [\n  {\n    count: 1\n    kind: KIND_MODEL\n  }\n]\n')
    (model / "1" / "model.json").write_text(json.dumps(
        {"model": str(tiny_model), "enforce_eager": True, "dtype": "bfloat16", "max_model_len": 512}, indent=4))
    r = _load(state, "nv_layout")
    assert r.status_code == 200, r.text
    nv = dataclasses.replace(srv, name="nv_layout")
    out = generate(nv, text_input=PROMPT, exclude_input_in_output=True, return_num_output_tokens=True,
                   sampling_parameters=json.dumps({"temperature": 0, "max_tokens": 5, "ignore_eos": True}))
    assert out["_status"] == 200, out
    assert out["num_output_tokens"] == 5 and not out["text_output"].startswith(PROMPT), out
    assert not (model / "model.json").exists()  # nothing was written at the model level
    r = repo.unload(srv, "nv_layout")
    assert r.status_code == 200, r.text
    _wait_back_to(state, base, "the vllm_backend-layout model's unload")


def test_stopping_the_server_leaves_no_process_and_no_segment(state: _State):
    srv = state.server
    kids = srv.descendants()
    assert srv.stop() == 0, srv.log_tail()
    left = wait_gone(kids)
    assert not left, f"processes left after the stop: {repo.describe({p.pid for p in left})}"
    segments = repo.leftover_segments(state.shm_before)
    assert not segments, f"/dev/shm segments left after the stop: {sorted(segments)}"
