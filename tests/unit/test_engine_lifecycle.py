"""EngineRunner's lifecycle without vLLM: whatever fails before the engine is up
fails start() (never a hang) naming the cause; after start, an engine that vLLM
reports dead is noticed by the watchdog, every request in flight and every new
one gets the engine-dead error (metric reason engine_dead), and the server is
asked to stop once; the decision parts (cause, parent check, restart limit) on
their own."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from llmhost.backend import engine as engine_mod
from llmhost.backend import watchdog
from llmhost.backend.config import parse_model_config
from llmhost.backend.engine import EngineRunner, EngineStartError
from llmhost.backend.metrics import ENGINE_HANGS, ServingMetrics
from llmhost.backend.request import GenerateJob
from llmhost.server import stopfile
from llmhost.server.serve import RestartLimit, exit_reason
from llmhost.server.stopfile import announce_stop

BOUND_S = 120  # a bound that tells a hang from an answer (importing vLLM's packages on a busy host), not a speed target


# -- fakes ----------------------------------------------------------------------


class FakeManager:
    def __init__(self) -> None:
        self.exits: dict[str, int] = {}

    def finished_procs(self) -> dict[str, int]:
        return dict(self.exits)


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 50 + 1 for c in text]

    def apply_chat_template(self, messages: Any, tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        return " ".join(m["content"] for m in messages)


class FakeEngine:
    """Stands in for vLLM's AsyncLLM: ``errored`` and the engine processes' exit codes
    are set by the test; ``generate`` yields one delta, then waits forever (as a
    request does whose engine died before vLLM failed it), or raises once errored
    when ``fail_when_dead``, or raises ``fail_with`` (an engine error of one request)."""

    instances: ClassVar[list[FakeEngine]] = []
    fail_tokenizer = False

    def __init__(self) -> None:
        self.errored = False
        self.fail_when_dead = False
        self.fail_with: Exception | None = None
        self.shutdowns = 0
        self.manager = FakeManager()
        self.engine_core = SimpleNamespace(resources=SimpleNamespace(engine_manager=self.manager))
        self.model_config = SimpleNamespace(max_model_len=64)
        self.generating = threading.Event()
        self.usage_context: Any = None
        self.start_method: str | None = None
        FakeEngine.instances.append(self)

    @classmethod
    def from_engine_args(cls, args: Any, usage_context: Any = None, stat_loggers: Any = None) -> FakeEngine:
        engine = cls()
        engine.usage_context = usage_context
        engine.stat_loggers = stat_loggers
        engine.start_method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
        return engine

    def get_tokenizer(self) -> FakeTokenizer:
        if FakeEngine.fail_tokenizer:
            raise OSError("tokenizer.json is unreadable")
        return FakeTokenizer()

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        out = SimpleNamespace(outputs=[SimpleNamespace(index=0, text="x", token_ids=[1], finish_reason=None,
                                                       cumulative_logprob=None, logprobs=None)],
                              finished=False)
        yield out
        self.generating.set()
        if self.fail_with is not None:
            raise self.fail_with
        while not (self.errored and self.fail_when_dead):
            await asyncio.sleep(0.01)
        raise RuntimeError("EngineCore encountered an issue. See stack trace (above) for the root cause.")

    def die(self, exits: dict[str, int]) -> None:
        self.manager.exits = exits
        self.errored = True

    def shutdown(self, timeout: float | None = None) -> None:
        self.shutdowns += 1


class Sink:
    def __init__(self) -> None:
        self.active: Any = None
        self.chunks: list[Any] = []
        self.errors: list[str] = []
        self.was_cancelled = False
        self.done = threading.Event()

    def send(self, chunk: Any) -> None:
        self.chunks.append(chunk)
        if chunk.final:
            self.done.set()

    def fail(self, message: str, reason: str = "engine_error") -> None:
        self.errors.append(message)
        self.done.set()

    def cancelled(self) -> None:
        self.was_cancelled = True
        self.done.set()


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, msg: str) -> None:
        self.lines.append(msg)

    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The engine module sees a fake AsyncLLM, stat logger and engine arguments."""
    mod = types.ModuleType("vllm.v1.engine.async_llm")
    mod.AsyncLLM = FakeEngine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", mod)
    stats = types.ModuleType("llmhost.backend.stats")
    stats.stat_logger_factory = lambda metrics: object()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llmhost.backend.stats", stats)
    monkeypatch.setattr(engine_mod, "build_engine_args", lambda raw: SimpleNamespace(**raw))
    FakeEngine.instances = []
    FakeEngine.fail_tokenizer = False
    yield


def make_runner(restart: bool = True, drain_timeout_s: float = 30, stop_file: Path | None = None,
                server_pid: int = 4242, runner_kwargs: dict[str, Any] | None = None,
                **settings: Any) -> tuple[EngineRunner, Log, Log, list[int], ServingMetrics]:
    config = parse_model_config({"model": "/nowhere", "llmhost": {"exit_server_on_engine_death": restart,
                                                                  "drain_timeout_s": drain_timeout_s, **settings}})
    info, error, stops = Log(), Log(), []
    metrics = ServingMetrics()

    def stop_server(log: Any) -> bool:
        stops.append(1)
        return True

    runner = EngineRunner(config, metrics, info, error, stop_server=stop_server,
                          stop_file=stop_file or Path("/nonexistent/llmhost-stopping"), server_pid=server_pid,
                          **(runner_kwargs or {}))
    return runner, info, error, stops, metrics


def assert_server_stopped_once(stops: list[int]) -> None:
    waited = threading.Event()
    for _ in range(BOUND_S * 10):
        if stops:
            break
        waited.wait(0.1)
    assert stops == [1], "the server was not asked to stop"


def start_in_thread(runner: EngineRunner) -> list[BaseException | None]:
    """start() on a thread, so a hang fails the test instead of blocking it."""
    result: list[BaseException | None] = []

    def go() -> None:
        try:
            runner.start()
            result.append(None)
        except BaseException as exc:  # noqa: BLE001
            result.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert result, "start() did not return: the load would hang"
    return result


def job(client_id: str = "") -> GenerateJob:
    return GenerateJob(prompt="hello", messages=None, stream=True, exclude_input=True, sampling={"max_tokens": 8},
                       client_id=client_id)


def submit(runner: EngineRunner, monkeypatch: pytest.MonkeyPatch, client_id: str = "") -> Sink:
    # Only the engine-facing part is under test here: sampling parameters are vLLM's.
    monkeypatch.setattr(runner, "_sampling_params", lambda j, *a: SimpleNamespace(n=1))
    sink = Sink()
    runner.submit(job(client_id), sink)
    return sink


def failed(metrics: ServingMetrics, reason: str) -> float:
    return metrics._counters.get(("vllm:request_failed_total", reason), 0.0)


# -- start failures -----------------------------------------------------------------


def test_import_error_of_vllm_fails_start_naming_it(monkeypatch: pytest.MonkeyPatch):
    # The GPU host's case: a missing dependency fails `from vllm.v1.engine.async_llm import AsyncLLM`.
    class MissingDependency:
        @staticmethod
        def find_spec(name: str, path: Any = None, target: Any = None) -> None:
            if name == "vllm.v1.engine.async_llm":
                raise ImportError("libcudart.so.12: cannot open shared object file: No such file or directory")

    monkeypatch.delitem(sys.modules, "vllm.v1.engine.async_llm", raising=False)
    monkeypatch.setattr(sys, "meta_path", [MissingDependency, *sys.meta_path])
    runner, _, error, _, _ = make_runner()
    [exc] = start_in_thread(runner)
    assert isinstance(exc, EngineStartError)
    assert str(exc) == ("vLLM's engine did not start: ImportError: libcudart.so.12: cannot open shared object "
                        "file: No such file or directory"), exc
    assert "Traceback" not in str(exc)
    assert "ImportError" in error.text() and "Traceback" in error.text()  # the whole story goes to the log
    assert not runner.accepting


def test_engine_build_error_fails_start_naming_it(fake_vllm: None, monkeypatch: pytest.MonkeyPatch):
    def reject(raw: dict[str, Any]) -> Any:
        raise ValueError("max_model_len 99999 is larger than the model's 512")

    monkeypatch.setattr(engine_mod, "build_engine_args", reject)
    runner, _, _, _, _ = make_runner()
    [exc] = start_in_thread(runner)
    assert str(exc) == "vLLM's engine did not start: ValueError: max_model_len 99999 is larger than the model's 512"


def test_failure_after_the_engine_is_built_shuts_it_down(fake_vllm: None):
    FakeEngine.fail_tokenizer = True
    runner, _, _, _, _ = make_runner()
    [exc] = start_in_thread(runner)
    assert "OSError: tokenizer.json is unreadable" in str(exc)
    assert [e.shutdowns for e in FakeEngine.instances] == [1], "the EngineCore would be left behind"


@pytest.mark.parametrize("how", ["returns", "exits"])
def test_an_engine_thread_that_ends_any_other_way_fails_start(fake_vllm: None, monkeypatch: pytest.MonkeyPatch,
                                                              how: str):
    async def returns(self: EngineRunner, ready: Any, failure: Any) -> None:
        return None

    async def exits(self: EngineRunner, ready: Any, failure: Any) -> None:
        raise SystemExit(3)

    monkeypatch.setattr(EngineRunner, "_main", returns if how == "returns" else exits)
    runner, _, _, _, _ = make_runner()
    [exc] = start_in_thread(runner)
    assert isinstance(exc, EngineStartError)
    expected = "the engine thread ended before the engine was up" if how == "returns" else "SystemExit: 3"
    assert expected in str(exc)


def test_a_healthy_start_accepts_and_stops(fake_vllm: None):
    runner, _, _, stops, _ = make_runner()
    assert start_in_thread(runner) == [None]
    # vLLM's server's scheduler defaults for the device, not the generic 128 sequences.
    assert FakeEngine.instances[0].usage_context.name == "OPENAI_API_SERVER"
    assert runner.accepting and runner.engine_dead_message() is None
    runner.stop(drain_timeout_s=1)
    assert not runner.accepting and FakeEngine.instances[0].shutdowns == 1 and not stops


@pytest.mark.parametrize(("settings", "expected"), [({}, "spawn"), ({"engine_start_method": "fork"}, "fork")])
def test_the_engine_process_starts_the_way_the_setting_says(fake_vllm: None, monkeypatch: pytest.MonkeyPatch,
                                                            settings: dict[str, str], expected: str):
    # vLLM reads the start method when it starts EngineCore: it must be set before.
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "not-set-by-us")
    runner, _, _, _, _ = make_runner(**settings)
    assert start_in_thread(runner) == [None]
    assert FakeEngine.instances[0].start_method == expected
    runner.stop(drain_timeout_s=1)


# -- death after start --------------------------------------------------------------


def test_watchdog_fails_requests_in_flight_and_new_ones_then_stops_the_server(
        fake_vllm: None, monkeypatch: pytest.MonkeyPatch):
    runner, _, error, stops, metrics = make_runner()
    assert start_in_thread(runner) == [None]
    engine = FakeEngine.instances[0]
    sink = submit(runner, monkeypatch)
    assert engine.generating.wait(BOUND_S), "the request never reached the engine"
    engine.die({"EngineCore_DP0": -signal.SIGKILL})  # vLLM's monitor saw its process die; the request hangs
    assert sink.done.wait(BOUND_S), "the request in flight hung after the engine died"
    assert sink.errors == ["the model's engine stopped (EngineCore_DP0 was killed by SIGKILL); "
                           "the server is restarting; retry shortly"]
    assert not sink.was_cancelled
    assert_server_stopped_once(stops)
    assert not runner.accepting and runner.engine_dead_message() == sink.errors[0]  # what execute() answers now
    assert failed(metrics, "engine_dead") == 1 and failed(metrics, "engine_error") == 0
    assert "vLLM's engine died: EngineCore_DP0 was killed by SIGKILL" in error.text()
    runner.stop(drain_timeout_s=30)
    assert runner._thread is None and engine.shutdowns == 1


def test_a_request_vllm_fails_before_the_watchdog_looks_is_engine_dead(fake_vllm: None,
                                                                       monkeypatch: pytest.MonkeyPatch):
    runner, _, _, _, metrics = make_runner()
    assert start_in_thread(runner) == [None]
    engine = FakeEngine.instances[0]
    engine.fail_when_dead = True
    sink = submit(runner, monkeypatch)
    assert engine.generating.wait(BOUND_S)
    engine.die({"EngineCore_DP0": 1})
    assert sink.done.wait(BOUND_S)
    assert sink.errors == ["the model's engine stopped (EngineCore_DP0 exited with 1); "
                           "the server is restarting; retry shortly"]
    assert failed(metrics, "engine_dead") == 1 and failed(metrics, "engine_error") == 0
    runner.stop(drain_timeout_s=30)


def test_without_exit_server_on_engine_death_the_server_is_left_running(fake_vllm: None,
                                                                        monkeypatch: pytest.MonkeyPatch):
    runner, _, error, stops, _ = make_runner(restart=False)
    assert start_in_thread(runner) == [None]
    engine = FakeEngine.instances[0]
    sink = submit(runner, monkeypatch)
    assert engine.generating.wait(BOUND_S)
    engine.die({})
    assert sink.done.wait(BOUND_S)
    assert sink.errors == ["the model's engine stopped (vLLM reports its engine dead); "
                           "the model stays unavailable until its server is restarted"]
    runner.stop(drain_timeout_s=30)
    assert not stops
    assert "exit_server_on_engine_death is false" in error.text()


@pytest.mark.parametrize("unload_refused", [False, True])
def test_with_the_health_check_a_dead_engine_unloads_the_model_instead(fake_vllm: None,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     unload_refused: bool):
    """ENABLE_VLLM_HEALTH_CHECK: the watchdog asks Triton to unload the model and does
    not stop the server; where Triton refuses (not explicit model control), the server
    is stopped as exit_server_on_engine_death says."""
    from llmhost.backend.health import UNHEALTHY_MESSAGE, SelfUnload

    unloads: list[str] = []

    def unload(name: str) -> None:
        unloads.append(name)
        if unload_refused:
            raise RuntimeError("explicit model load / unload is not allowed if polling is enabled")

    logs = Log()
    health = SelfUnload("tiny", unload, logs, logs)
    runner, _, _, stops, _ = make_runner(runner_kwargs={"on_engine_death": health,
                                                        "death_message": UNHEALTHY_MESSAGE})
    assert start_in_thread(runner) == [None]
    engine = FakeEngine.instances[0]
    sink = submit(runner, monkeypatch)
    assert engine.generating.wait(BOUND_S)
    engine.die({"EngineCore_DP0": -signal.SIGKILL})
    assert sink.done.wait(BOUND_S)
    assert sink.errors == [UNHEALTHY_MESSAGE]
    waited = threading.Event()
    for _ in range(BOUND_S * 10):
        if unloads and (stops or not unload_refused):
            break
        waited.wait(0.1)
    waited.wait(0.5)  # a stop that should not come would come within this
    assert unloads == ["tiny"]
    assert stops == ([1] if unload_refused else [])
    assert health("again") is (not unload_refused) and unloads == ["tiny"]  # asked once only
    assert ("--model-control-mode=explicit" in logs.text()) is unload_refused
    assert runner.engine_dead_message() == UNHEALTHY_MESSAGE
    runner.stop(drain_timeout_s=30)


@pytest.mark.parametrize("stats", [True, False])
def test_the_stat_logger_is_given_only_when_metrics_are_on(fake_vllm: None, stats: bool):
    runner, *_ = make_runner(runner_kwargs={"stats": stats})
    assert start_in_thread(runner) == [None]
    assert (FakeEngine.instances[0].stat_loggers is not None) is stats
    runner.stop(drain_timeout_s=30)


# -- one request's end: cancelled, failed -------------------------------------------


@pytest.mark.parametrize(("client_id", "label"), [("cancel-me-7", "(client id 'cancel-me-7')"), ("", "(no client id)")])
def test_a_cancelled_request_logs_both_ids_at_info(fake_vllm: None, monkeypatch: pytest.MonkeyPatch,
                                                   client_id: str, label: str):
    """The client went away (the I/O thread saw is_cancelled()): the info log names our
    engine id and the client's request id, and how far the stream had got."""
    runner, info, error, _, metrics = make_runner()
    assert start_in_thread(runner) == [None]
    engine = FakeEngine.instances[0]
    sink = submit(runner, monkeypatch, client_id=client_id)
    assert engine.generating.wait(BOUND_S)
    runner.cancel(sink.active)
    assert sink.done.wait(BOUND_S)
    assert sink.was_cancelled and not sink.errors
    assert metrics._counters.get(("vllm:request_cancelled_total", None), 0.0) == 1
    assert (f"request {sink.active.request_id} {label} cancelled: its client went away "
            "after 1 output token(s) sent to it") in info.lines
    assert not error.lines
    runner.stop(drain_timeout_s=1)


def test_an_engine_error_logs_both_ids(fake_vllm: None, monkeypatch: pytest.MonkeyPatch):
    runner, info, _, _, metrics = make_runner()
    assert start_in_thread(runner) == [None]
    FakeEngine.instances[0].fail_with = RuntimeError("CUDA error: an illegal memory access")
    sink = submit(runner, monkeypatch, client_id="req\n42")  # a line break of the client's stays escaped
    assert sink.done.wait(BOUND_S)
    assert sink.errors == ["engine error: RuntimeError: CUDA error: an illegal memory access"]
    assert failed(metrics, "engine_error") == 1
    [line] = [ln for ln in info.lines if " failed: " in ln]
    assert line.startswith(f"request {sink.active.request_id} (client id 'req\\n42') failed: "
                           "RuntimeError: CUDA error: an illegal memory access\nTraceback")
    runner.stop(drain_timeout_s=1)


# -- stopping: the stop file, the drain ---------------------------------------------


def test_the_stop_file_starts_the_drain_and_aborts_what_outlives_it(fake_vllm: None, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    """tritonserver is being stopped (its pid in the stop file): new requests are
    refused at once, one in flight gets drain_timeout_s, then ends with the
    shutting-down error (not a stream cut short); the server is not asked to stop."""
    stop_file = tmp_path / "stopping"
    runner, info, _, stops, metrics = make_runner(drain_timeout_s=1, stop_file=stop_file, server_pid=4242)
    assert start_in_thread(runner) == [None]
    engine = FakeEngine.instances[0]
    sink = submit(runner, monkeypatch)  # never ends by itself
    assert engine.generating.wait(BOUND_S)
    announce_stop(stop_file, 4242)
    assert sink.done.wait(BOUND_S), "the request in flight outlived the drain"
    assert sink.errors == ["the model is shutting down: the request was aborted after the drain timeout of 1 s; "
                           "retry on another instance"], sink.errors
    assert not sink.was_cancelled and not runner.accepting
    assert failed(metrics, "shutting_down") == 1 and failed(metrics, "engine_error") == 0
    assert "draining (tritonserver is stopping): 1 request(s) in flight get up to 1 s" in info.text()
    assert not stops and engine.shutdowns == 0  # Triton unloads the model next: finalize -> stop()
    runner.stop(drain_timeout_s=1)
    assert engine.shutdowns == 1


def test_the_drained_mark_comes_once_nothing_is_in_flight(fake_vllm: None, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch):
    """During the server's stop, the backend leaves its drained mark (which lets the
    stopper close idle HTTP connections: llmhost.server.stopserver) only after the last
    request in flight has ended, and only once."""
    stop_file = tmp_path / "stopping"
    runner, _, _, _, _ = make_runner(drain_timeout_s=30, stop_file=stop_file, server_pid=4242)
    assert start_in_thread(runner) == [None]
    engine = FakeEngine.instances[0]
    sink = submit(runner, monkeypatch)  # never ends by itself
    assert engine.generating.wait(BOUND_S)
    announce_stop(stop_file, 4242)
    mark = stopfile.drained_file(stop_file, os.getpid())
    for _ in range(25):  # the watchdog looks once a second: two looks at least
        threading.Event().wait(0.1)
    assert runner._server_stopping and not mark.exists(), "marked drained with a request in flight"
    runner._loop.call_soon_threadsafe(runner._abort_leftovers)
    assert sink.done.wait(BOUND_S)
    deadline = time.monotonic() + BOUND_S
    while not mark.exists() and time.monotonic() < deadline:
        threading.Event().wait(0.1)
    assert stopfile.all_drained(stop_file, 4242, [os.getpid()])
    assert not stopfile.all_drained(stop_file, 4242, [os.getpid(), os.getpid() + 1])  # another backend is not
    mark.unlink()
    for _ in range(15):
        threading.Event().wait(0.1)
    assert not mark.exists(), "marked twice"
    runner.stop(drain_timeout_s=1)


def test_the_stop_file_is_readable_by_the_server_whatever_the_umask(tmp_path: Path):
    """The unit's ExecStop writes it as root under UMask=0077; tritonserver's user reads it."""
    old = os.umask(0o077)
    try:
        announce_stop(tmp_path / "stopping", 7)
    finally:
        os.umask(old)
    assert (tmp_path / "stopping").stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["stopping"]


def test_stop_files_are_removed_before_a_start(tmp_path: Path):
    stop_file = tmp_path / "stopping"
    announce_stop(stop_file, 7)
    stopfile.mark_drained(stop_file, 7, backend_pid=8)
    (tmp_path / "other").write_text("kept")
    stopfile.remove_stop_files(stop_file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_a_stop_file_of_another_server_is_ignored(fake_vllm: None, tmp_path: Path):
    stop_file = tmp_path / "stopping"
    announce_stop(stop_file, 1111)  # left by an earlier instance
    runner, info, _, _, _ = make_runner(stop_file=stop_file, server_pid=4242)
    assert start_in_thread(runner) == [None]
    for _ in range(30):  # the watchdog looks once a second
        threading.Event().wait(0.1)
    assert runner.accepting and "draining" not in info.text()
    runner.stop(drain_timeout_s=1)


def test_stop_keeps_the_deadline_of_a_drain_already_begun(fake_vllm: None, monkeypatch: pytest.MonkeyPatch):
    runner, _, _, _, _ = make_runner()
    assert start_in_thread(runner) == [None]
    runner.begin_drain(0.5, "test")
    first = runner._drain_deadline
    runner.begin_drain(30, "the model is unloading")  # later and longer: the first deadline holds
    assert runner._drain_deadline == first
    runner.stop(drain_timeout_s=30)
    assert runner._drain_deadline == first


@pytest.mark.parametrize(("text", "pid", "expected"), [
    ("4242\n", 4242, True), ("4242", 4243, False), ("", 4242, False), ("junk", 4242, False), (None, 4242, False)])
def test_stop_requested_only_for_this_server(tmp_path: Path, text: str | None, pid: int, expected: bool):
    path = tmp_path / "stopping"
    if text is not None:
        path.write_text(text)
    assert stopfile.stop_requested(path, pid) is expected
    assert stopfile.stop_requested(None, pid) is False


def test_stop_file_comes_from_the_environment():
    assert stopfile.stop_file_from_env({stopfile.STOP_FILE_ENV: "/run/x/stopping"}) == Path("/run/x/stopping")
    assert stopfile.stop_file_from_env({}) is None


# -- the decision parts -------------------------------------------------------------


def test_engine_watch_tells_once():
    engine = SimpleNamespace(errored=False, engine_core=None)
    watch = watchdog.EngineWatch()
    assert watch.check(None) is None
    assert watch.check(engine) is None
    engine.errored = True
    assert watch.check(engine) == "vLLM reports its engine dead"
    assert watch.check(engine) is None  # once


def test_death_cause_names_processes_and_signals():
    engine = FakeEngine()
    assert watchdog.engine_death_cause(engine) is None
    engine.die({"EngineCore_DP0": -9, "EngineCore_DP1": 0})
    assert watchdog.engine_death_cause(engine) == "EngineCore_DP0 was killed by SIGKILL, EngineCore_DP1 exited with 0"

    class Broken:
        @property
        def errored(self) -> bool:
            raise RuntimeError("client torn down")

    assert watchdog.engine_death_cause(Broken()) == "its state could not be read: RuntimeError"


def test_stop_tritonserver_signals_only_a_tritonserver_parent(monkeypatch: pytest.MonkeyPatch):
    sent: list[tuple[int, int]] = []
    log = Log()
    # Our own parent is no tritonserver: nothing is signalled.
    assert not watchdog.stop_tritonserver(log, kill=lambda pid, sig: sent.append((pid, sig)))
    assert not sent and "is not tritonserver" in log.text()
    assert not watchdog.stop_tritonserver(log, ppid=1, kill=lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(watchdog, "parent_comm", lambda pid: "tritonserver")
    assert watchdog.stop_tritonserver(log, ppid=4242, kill=lambda pid, sig: sent.append((pid, sig)))
    assert sent == [(4242, signal.SIGTERM)]


def test_parent_comm_reads_proc():
    assert watchdog.parent_comm(os.getpid()) == open(f"/proc/{os.getpid()}/comm").read().strip()
    assert watchdog.parent_comm(2**22 + 12345) == ""


def test_restart_limit_is_systemds_start_limit():
    limit = RestartLimit(burst=5, interval_s=600)
    assert [limit.allow(t) for t in (0, 10, 20, 30, 40)] == [True] * 5
    assert not limit.allow(50)  # a sixth within 10 minutes
    assert limit.allow(601)  # the first has left the window
    assert not RestartLimit(burst=0).allow(0)


def test_exit_reasons_are_readable():
    assert "without being asked to stop" in exit_reason(0)
    assert exit_reason(-signal.SIGKILL) == "was killed by SIGKILL"
    assert exit_reason(1) == "exited with status 1"


def test_a_failure_is_described_on_one_bounded_line():
    from llmhost.backend.engine import describe_failure

    pydantic_like = ValueError("1 validation error for ModelConfig\n  Value error, Model architectures ['X'] are "
                               "not supported for now. [type=value_error, input_value={'model': '/srv/m'}]\n"
                               "    For further information visit https://errors.pydantic.dev/2/v/value_error\n")
    assert describe_failure(pydantic_like) == ("ValueError: 1 validation error for ModelConfig Value error, Model "
                                               "architectures ['X'] are not supported for now.")
    assert describe_failure(RuntimeError("x" * 5000)) == "RuntimeError: " + "x" * 597 + "..."
    assert describe_failure(KeyboardInterrupt()) == "KeyboardInterrupt"


# -- metrics current when a final response leaves ------------------------------------


def test_a_final_response_waits_for_the_statistics_of_its_step():
    """vLLM records a step's statistics after handing out its outputs; when something
    is awaited in between (an abort on a stop string), the final response waits for
    them, so the metrics pushed ahead of it count its tokens."""
    import asyncio

    runner, info, *_ = make_runner()
    metrics = runner.metrics
    runner._tokens_seen = 7

    async def scenario() -> tuple[int, int]:
        async def record_later() -> None:
            for _ in range(5):
                await asyncio.sleep(0)
            metrics.record_iteration(prompt_tokens=3, generation_tokens=7, ttfts=[], itls=[], preempted=0,
                                     finished=[])

        task = asyncio.ensure_future(record_later())
        await runner._stats_caught_up()
        seen_when_released = metrics.generation_recorded
        await task
        return seen_when_released, runner._tokens_seen

    assert asyncio.run(scenario()) == (7, 7)
    assert "metrics lag" not in info.text()


def test_statistics_that_never_come_hold_a_response_once_and_briefly():
    import asyncio
    import time

    runner, info, *_ = make_runner()
    runner._tokens_seen = 5  # never recorded
    t0 = time.monotonic()
    asyncio.run(runner._stats_caught_up())
    assert time.monotonic() - t0 < 5  # bounded (STATS_WAIT_S), not a hang
    assert "metrics lag: vLLM's statistics recorded 0 output token(s) of 5 seen" in info.text()
    assert runner._tokens_seen == 0  # counted afresh: the next final response does not wait
    runner._tokens_seen += 2
    runner.metrics.record_iteration(prompt_tokens=1, generation_tokens=2, ttfts=[], itls=[], preempted=0,
                                    finished=[])
    asyncio.run(runner._stats_caught_up())
    assert info.text().count("metrics lag") == 1


# -- a hung engine ----------------------------------------------------------------------


class SteppingEngine(FakeEngine):
    """A FakeEngine whose engine core hands back a batch of outputs every 20 ms, read by
    an output loop as vLLM's client reads them (``engine_core.get_output_async``), until
    ``hung`` is set. Its requests get one delta and then nothing: as a long request that
    is not streamed looks from outside."""

    def __init__(self) -> None:
        super().__init__()
        self.hung = threading.Event()
        self.engine_core.get_output_async = self._next_outputs
        self._loop_task: asyncio.Task[None] | None = None

    async def _next_outputs(self) -> Any:
        while self.hung.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.02)
        return SimpleNamespace(outputs=[])

    async def _output_loop(self) -> None:
        while True:
            await self.engine_core.get_output_async()

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._output_loop())
        async for out in super().generate(prompt, params, request_id):
            yield out

    def shutdown(self, timeout: float | None = None) -> None:
        if self._loop_task is not None:
            self._loop_task.get_loop().call_soon_threadsafe(self._loop_task.cancel)
        super().shutdown(timeout)


def hangs(metrics: ServingMetrics) -> float:
    return metrics._counters.get((ENGINE_HANGS, None), 0.0)


def test_an_engine_that_stops_stepping_is_failed_counted_and_the_server_stopped(
        fake_vllm: None, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sys.modules["vllm.v1.engine.async_llm"], "AsyncLLM", SteppingEngine)
    runner, _, error, stops, metrics = make_runner(engine_hang_timeout_s=1)
    assert start_in_thread(runner) == [None]
    engine = FakeEngine.instances[0]
    assert isinstance(engine, SteppingEngine)
    sink = submit(runner, monkeypatch)
    assert engine.generating.wait(BOUND_S), "the request never reached the engine"
    # Still stepping: a request with no output of its own for several timeouts is no hang.
    assert not sink.done.wait(3.5), sink.errors
    assert hangs(metrics) == 0 and not stops
    engine.hung.set()
    assert sink.done.wait(BOUND_S), "the request in flight hung with its engine"
    assert sink.errors == ["the model's engine stopped (it made no progress for 1 s with 1 request in flight); "
                           "the server is restarting; retry shortly"]
    assert_server_stopped_once(stops)
    assert hangs(metrics) == 1
    assert failed(metrics, "engine_dead") == 1 and failed(metrics, "engine_error") == 0
    assert not runner.accepting and runner.engine_dead_message() == sink.errors[0]  # what execute() answers now
    assert "vLLM's engine hung: it made no progress for 1 s with 1 request in flight" in error.text()
    runner.stop(drain_timeout_s=30)
    assert runner._thread is None and engine.shutdowns == 1


def test_the_hang_check_is_off_where_vllm_has_no_outputs_to_watch(fake_vllm: None):
    runner, info, _, _, _ = make_runner(engine_hang_timeout_s=5)
    assert start_in_thread(runner) == [None]  # FakeEngine's engine core has no get_output_async
    assert runner._stall.timeout_s == 0
    assert "engine_hang_timeout_s is off" in info.text()
    runner.stop(drain_timeout_s=30)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_stall_watch_judges_only_the_time_the_engine_had_work():
    clock = Clock()
    watch = watchdog.StallWatch(5, clock)
    clock.now += 3600  # idle for an hour: no work, no hang
    assert watch.check([]) is None
    assert watch.check([clock.now]) is None  # a request just handed over is not judged by the idle hour
    handed = clock.now
    clock.now += 4
    assert watch.check([handed]) is None
    watch.progressed()  # a step: the clock starts again
    clock.now += 4
    assert watch.check([handed, clock.now]) is None
    clock.now += 1
    assert watch.check([handed, clock.now]) == "it made no progress for 5 s with 2 requests in flight"
    clock.now += 60
    assert watch.check([handed]) is None  # once


def test_stall_watch_with_timeout_zero_is_off():
    clock = Clock()
    watch = watchdog.StallWatch(0, clock)
    handed = clock.now
    clock.now += 10**6
    assert watch.check([handed]) is None


def test_watch_outputs_reports_each_batch_and_passes_it_on():
    seen: list[int] = []

    async def get_output_async() -> str:
        return "outputs"

    engine = SimpleNamespace(engine_core=SimpleNamespace(get_output_async=get_output_async))
    assert watchdog.watch_outputs(engine, lambda: seen.append(1))
    assert asyncio.run(engine.engine_core.get_output_async()) == "outputs"
    assert asyncio.run(engine.engine_core.get_output_async()) == "outputs"
    assert seen == [1, 1]
    assert not watchdog.watch_outputs(SimpleNamespace(engine_core=SimpleNamespace()), lambda: None)
    assert not watchdog.watch_outputs(SimpleNamespace(), lambda: None)


def test_a_hung_engines_error_is_unavailable_at_the_gateway():
    from llmhost.gateway.upstreams.client import classify

    message = watchdog.client_message(watchdog.hang_cause(300, 3), restarting=True)
    assert message == ("the model's engine stopped (it made no progress for 300 s with 3 requests in flight); "
                       "the server is restarting; retry shortly")
    assert classify(message).status == 503


@pytest.mark.parametrize(("value", "problem"), [(-1, ">= 0"), ("300", "a number"), (True, "a number")])
def test_engine_hang_timeout_must_be_a_number_of_seconds(value: Any, problem: str):
    from llmhost.backend.config import ConfigError

    with pytest.raises(ConfigError, match=f"llmhost.engine_hang_timeout_s must be {problem}"):
        parse_model_config({"model": "/m", "llmhost": {"engine_hang_timeout_s": value}})
    assert parse_model_config({"model": "/m"}).settings.engine_hang_timeout_s == 300
    off = parse_model_config({"model": "/m", "llmhost": {"engine_hang_timeout_s": 0}})
    assert off.settings.engine_hang_timeout_s == 0
