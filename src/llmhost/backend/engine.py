"""The vLLM side: one AsyncLLM engine in an asyncio loop on its own thread.

Requests are scheduled onto that loop from Triton's execute() thread; every
result goes out through a ``Sink`` (implemented by the Triton I/O thread), so the
loop never blocks on a round trip to tritonserver.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from llmhost.backend.config import ModelConfig
from llmhost.backend.errors import RequestError
from llmhost.backend.failures import ENGINE_DEAD, ENGINE_ERROR, INVALID_REQUEST, SHUTTING_DOWN, classify
from llmhost.backend.images import no_images_here
from llmhost.backend.kept_counts import add_count
from llmhost.backend.lora import find_adapter, lora_request
from llmhost.backend.metrics import ENGINE_HANGS, ServingMetrics
from llmhost.backend.outputs import Position, position, positions
from llmhost.backend.prompts import (
    UTF8_MAX_BYTES,
    PromptEncoder,
    content_rendering,
    derived_prompt_bytes,
    longest_token_chars,
)
from llmhost.backend.replies import ChatParsing
from llmhost.backend.request import GenerateJob, RequestLimits, client_label
from llmhost.backend.tokens import tokens_answer
from llmhost.backend.watchdog import (
    WATCH_INTERVAL_S,
    EngineWatch,
    FollowerWatch,
    StallWatch,
    client_message,
    connected_peers,
    engine_death_cause,
    resolve_followers,
    stop_tritonserver,
    watch_outputs,
)
from llmhost.server.stopfile import mark_drained, stop_file_from_env, stop_requested

# Defaults we set for a server unless model.json says otherwise.
ENGINE_DEFAULTS: dict[str, Any] = {"disable_log_stats": True}
# After the engine died: how long requests in flight get to end before the server is stopped.
DEAD_DRAIN_S = 5.0
# How long a final response may wait for vLLM's statistics of the step that produced
# it (see _stats_caught_up); a bound, reached only if the counts ever disagree.
STATS_WAIT_S = 0.2
# Experiment switch (docs/performance.md, "What is left on the H100"): `uvloop` runs the
# engine thread's loop on uvloop, as vLLM's own server does; unset or `asyncio`, the
# standard loop. Read once, when the engine starts.
EVENT_LOOP_ENV = "LLMHOST_EVENT_LOOP"
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def new_event_loop(kind: str | None = None) -> asyncio.AbstractEventLoop:
    """The engine thread's loop: KIND (default: $LLMHOST_EVENT_LOOP) `uvloop` or `asyncio`."""
    kind = (os.environ.get(EVENT_LOOP_ENV, "") if kind is None else kind).strip().lower() or "asyncio"
    if kind == "uvloop":
        import uvloop  # not a dependency of ours: the experiment needs it installed

        return uvloop.new_event_loop()
    if kind != "asyncio":
        raise EngineStartError(f"{EVENT_LOOP_ENV}={kind!r}: expected 'asyncio' or 'uvloop'")
    return asyncio.new_event_loop()


@dataclass
class Chunk:
    """What one response carries, before it becomes Triton tensors (outputs.py).

    Per completion: its text and its tokens (count and, when asked, log
    probabilities) since the previous response; its finish reason ("" while it
    runs) and cumulative log probability so far."""

    texts: list[str]
    finish_reasons: list[str]
    num_input_tokens: int
    num_output_tokens: list[int]
    final: bool
    # Empty unless return_cumulative_logprob; None where vLLM gave none.
    cumulative_logprobs: list[float | None] = field(default_factory=list)
    # Empty unless return_logprobs; None per completion when the request gave no
    # 'logprobs' sampling parameter (sent as JSON null).
    logprobs: list[list[Position] | None] = field(default_factory=list)
    # When the engine's output became this chunk (time.monotonic()): the backend's
    # response delay is measured from here to the hand-over of the response.
    made: float = field(default_factory=time.monotonic)
    # An embedding model's answer: the prompt's embedding (None for generated text).
    embedding: list[float] | None = None
    # The prompt's log probabilities (the prompt_logprobs sampling parameter), in the
    # first response only: per prompt token, its own entry first, then the top k; the
    # first token has no log probability (null), only its text.
    prompt_logprobs: list[Position] | None = None
    # A chat parsed by vLLM's tool and reasoning parsers (llmhost.backend.replies): per
    # completion, its streamed deltas since the previous response, or its whole message
    # (one item) in the final response of a request not streamed; None: plain text.
    messages: list[list[dict[str, Any]]] | None = None


class Sink(Protocol):
    active: Active | None

    def send(self, chunk: Chunk) -> None: ...
    def fail(self, message: str, reason: str = ENGINE_ERROR) -> None:
        """End the request with MESSAGE; REASON is vllm:request_failed_total's label
        (failures.py): whether the client's input, the server, or its state is at fault."""
    def cancelled(self) -> None: ...


@dataclass
class Active:
    """An in-flight request, as the I/O thread sees it for cancellation checks."""

    request_id: str
    task: asyncio.Task[None] | None = None
    last_check: float = field(default_factory=time.monotonic)
    # When the request was handed to vLLM's engine (time.monotonic()); None before
    # (tokenizing, fetching images): what the hang check counts as the engine's work.
    handed_over: float | None = None


def request_label(request_id: str, client_id: str) -> str:
    """How the log names a request: our engine id and the client's own id."""
    return f"request {request_id} ({client_label(client_id)})"


def build_engine_args(raw: dict[str, Any]) -> Any:
    """AsyncEngineArgs from model.json; nested config objects may be given as JSON objects."""
    import dataclasses

    from vllm import AsyncEngineArgs

    from llmhost.backend.config import ConfigError

    known = {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}
    args: dict[str, Any] = {}
    for key, value in {**ENGINE_DEFAULTS, **raw}.items():
        f = known.get(key)
        if f is None:
            raise ConfigError(f"model.json: '{key}' is not a vLLM engine argument")
        if isinstance(value, dict):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                try:
                    value = type(default)(**value)
                except (TypeError, ValueError) as exc:
                    raise ConfigError(f"model.json: bad '{key}': {exc}") from None
        args[key] = value
    return AsyncEngineArgs(**args)


class EngineStartError(RuntimeError):
    """The engine did not come up; the message says why, for the load error."""


def describe_failure(exc: BaseException, limit: int = 600) -> str:
    """One line naming an exception for the load error (its traceback goes to the log).

    pydantic's errors (vLLM's config validation) span lines and end each with the
    input and a documentation link: only what they say is kept."""
    lines = []
    for line in str(exc).splitlines():
        line = line.split(" [type=", 1)[0].strip()
        if line and not line.startswith("For further information visit"):
            lines.append(line)
    text = " ".join(lines)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class EngineRunner:
    def __init__(self, config: ModelConfig, metrics: ServingMetrics, log: Callable[[str], None],
                 log_error: Callable[[str], None] | None = None,
                 stop_server: Callable[[Callable[[str], None]], bool] | None = None,
                 stop_file: Path | None = None, server_pid: int | None = None,
                 on_drained: Callable[[], None] | None = None, stats: bool = True,
                 on_engine_death: Callable[[str], bool] | None = None,
                 death_message: str | None = None, hang_count_file: Path | None = None) -> None:
        self.config = config
        # Where this instance keeps its hang count across the server's restarts (kept_counts.py).
        self._hang_count_file = hang_count_file
        # False: no stat logger of ours (the model's metrics are off), so vLLM
        # gathers no statistics unless model.json asks it to log them.
        self._stats = stats
        # The clients' error once the engine died, in place of client_message's.
        self._death_message = death_message
        # Called once (off the engine loop) with the cause when the engine dies; True
        # when it handled it (the health check unloaded the model), so the server
        # is not stopped.
        self._on_engine_death = on_engine_death
        # Output tokens seen in vLLM's outputs, all requests together (_stats_caught_up).
        self._tokens_seen = 0
        self._stats_lag_logged = False
        self.metrics = metrics
        self.log = log
        self.log_error = log_error or log
        self.active: dict[str, Active] = {}
        self.active_lock = threading.Lock()
        self.accepting = False
        # Set (to the client's error message) once vLLM's engine died after start.
        self.dead_message: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._engine: Any = None
        self._tokenizer: Any = None
        self._max_model_len = 0
        self._stop: asyncio.Event | None = None
        self._encoder: PromptEncoder | None = None  # made on the engine loop at the first request
        self._multimodal = False  # vLLM's model config says the model takes images
        self._pooling = False  # vLLM's model config says the model pools (embeddings), not generates
        self._architectures: list[str] = []  # the model's, as vLLM's model config names them
        self._chat: ChatParsing | None = None  # the model's tool and reasoning parsers (replies.py)
        self._limits: RequestLimits | None = None
        self._stop_server = stop_server or stop_tritonserver
        self._watch = EngineWatch()
        self._stall = StallWatch(config.settings.engine_hang_timeout_s)
        # Set once the engine is up, for a model spread over several hosts.
        self._followers: FollowerWatch | None = None
        # Draining: set once the server is stopping (stopfile) or the model unloads.
        self._stop_file = stop_file if stop_file is not None else stop_file_from_env()
        self._server_pid = os.getppid() if server_pid is None else server_pid
        self._drain_deadline: float | None = None
        self._drain_timeout_s = 0.0
        self._abort_message: str | None = None
        # Called once (off the engine loop) when the server is stopping and nothing
        # is in flight any more: by default, the drained mark (llmhost.server.stopfile).
        self._on_drained = on_drained or self.mark_drained
        self._server_stopping = False
        self._drained_marked = False

    # -- lifecycle ------------------------------------------------------------
    @property
    def model_config(self) -> Any:
        """The running engine's vLLM ModelConfig; None before it started or once it stopped."""
        engine = self._engine
        return engine.model_config if engine is not None else None

    def start(self) -> None:
        """Build the engine on its own thread; raises EngineStartError (naming the
        cause) whatever goes wrong before the engine is up."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                loop = new_event_loop()
                asyncio.set_event_loop(loop)
                self._loop = loop
                try:
                    loop.run_until_complete(self._main(ready, failure))
                finally:
                    loop.close()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, or logged
                if ready.is_set() and not failure:
                    self.log_error(f"the engine thread failed: {describe_failure(exc)}\n"
                                   f"{''.join(traceback.format_exception(exc))}")
                else:
                    failure.append(exc)
            finally:
                if not ready.is_set():
                    if not failure:
                        failure.append(EngineStartError("the engine thread ended before the engine was up"))
                    ready.set()

        self._thread = threading.Thread(target=run, name="llmhost-engine", daemon=True)
        self._thread.start()
        while not ready.wait(1.0):
            if not self._thread.is_alive():  # cannot end without setting ready; never wait forever
                failure.append(EngineStartError("the engine thread ended before the engine was up"))
                break
        if failure:
            self._thread.join(timeout=60)
            self._thread = None
            exc = failure[0]
            if isinstance(exc, EngineStartError):
                raise exc
            self.log_error(f"vLLM's engine did not start: {describe_failure(exc)}\n"
                           f"{''.join(traceback.format_exception(exc))}")
            raise EngineStartError(f"vLLM's engine did not start: {describe_failure(exc)}") from None
        self.accepting = True

    async def _main(self, ready: threading.Event, failure: list[BaseException]) -> None:
        self._stop = asyncio.Event()
        try:
            # Imported here, inside the try: an install missing one of vLLM's
            # dependencies fails at this import, and must fail the load too.
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.async_llm import AsyncLLM

            from llmhost.backend.stats import stat_logger_factory

            args = build_engine_args(self.config.engine_args)
            settings = self.config.settings
            followers = resolve_followers(settings.followers)
            if settings.host_ip:
                os.environ["VLLM_HOST_IP"] = settings.host_ip
            # Read by vLLM when it starts EngineCore (and, for tensor parallel, its workers).
            os.environ[START_METHOD_ENV] = self.config.settings.engine_start_method
            # As vLLM's own server: the usage context picks the scheduler's defaults
            # (max_num_seqs, max_num_batched_tokens) for the device. The default,
            # ENGINE_CONTEXT, has none and falls back to 128 sequences and 2,048
            # batched tokens, where vLLM's server runs 1,024 and 8,192 on an H100.
            self._engine = AsyncLLM.from_engine_args(args, usage_context=UsageContext.OPENAI_API_SERVER,
                                                     stat_loggers=[stat_logger_factory(self.metrics)]
                                                     if self._stats else None)
            self._tokenizer = self._engine.get_tokenizer()
            self._max_model_len = int(self._engine.model_config.max_model_len)
            self._multimodal = bool(getattr(self._engine.model_config, "is_multimodal_model", False))
            self._pooling = getattr(self._engine.model_config, "runner_type", "generate") == "pooling"
            self._architectures = [str(a) for a in getattr(self._engine.model_config, "architectures", None) or []]
            self._chat = ChatParsing(self._tokenizer, self._engine.model_config, self.config.settings.tool_parser,
                                     str(self.config.engine_args.get("reasoning_parser") or ""))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            failure.append(exc)
            if self._engine is not None:  # built, then something after failed: no EngineCore left behind
                self._shutdown_engine()
            ready.set()
            return
        if self._stall.timeout_s > 0 and not watch_outputs(self._engine, self._stall.progressed):
            # Without the engine's own outputs, a long request not streamed shows no
            # progress until it ends: judging by the requests alone would stop a
            # healthy server.
            self._stall.timeout_s = 0
            self.log("engine_hang_timeout_s is off: this vLLM's client has no get_output_async to watch")
        loop_type = type(asyncio.get_running_loop())
        if not loop_type.__module__.startswith("asyncio"):  # the experiment switch: say which loop runs
            self.log(f"engine event loop: {loop_type.__module__}.{loop_type.__qualname__}")
        if followers:
            self._followers = FollowerWatch(followers, settings.follower_grace_s)
            self.log(f"the engine is up with its followers {', '.join(followers)}; watching their connections")
        ready.set()
        watchdog = asyncio.create_task(self._watchdog(), name="llmhost-engine-watchdog")
        await self._stop.wait()
        watchdog.cancel()
        self._shutdown_engine()

    def _shutdown_engine(self) -> None:
        engine, self._engine = self._engine, None
        t0 = time.monotonic()
        try:
            engine.shutdown()
        except Exception as exc:  # noqa: BLE001 - a dead engine may fail to shut down; nothing is left to do
            self.log(f"vLLM's engine shutdown: {describe_failure(exc)}")
        self.log(f"vLLM's engine stopped in {time.monotonic() - t0:.1f} s")

    # -- watchdog -------------------------------------------------------------
    async def _watchdog(self) -> None:
        """About once a second: vLLM's own verdict on its engine, whether it made
        progress with the requests it holds, whether the server is being stopped
        (stopfile), and whether a drain's time is over."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            cause = self._watch.check(self._engine)
            if cause is not None:
                await self._engine_died(cause)
                return
            if self._followers is not None:
                peers = await asyncio.get_running_loop().run_in_executor(None, connected_peers, os.getpid())
                cause = self._followers.check(peers)
                if cause is not None:
                    await self._engine_died(cause, "lost a follower")
                    return
            with self.active_lock:
                handed_over = [a.handed_over for a in self.active.values() if a.handed_over is not None]
            cause = self._stall.check(handed_over)
            if cause is not None:
                self.metrics.inc(ENGINE_HANGS)
                try:
                    add_count(self._hang_count_file)
                except OSError as exc:
                    self.log_error(f"keeping the hang count in {self._hang_count_file} failed "
                                   f"({exc.strerror or exc}): it starts from 0 again after the restart")
                await self._engine_died(cause, "hung")
                return
            if not self._server_stopping and stop_requested(self._stop_file, self._server_pid):
                self._server_stopping = True
                self.begin_drain(self.config.settings.drain_timeout_s, "tritonserver is stopping")
            if (self._drain_deadline is not None and self._abort_message is None and self.active
                    and time.monotonic() >= self._drain_deadline):
                self._abort_leftovers()
            if self._server_stopping and not self._drained_marked and not self.active:
                self._drained_marked = True
                await asyncio.get_running_loop().run_in_executor(None, self._report_drained)

    def _report_drained(self) -> None:
        try:
            self._on_drained()
        except Exception as exc:  # noqa: BLE001 - the stop then waits for the drain timeout instead
            self.log_error(f"marking the drain as done failed: {describe_failure(exc)}")

    def mark_drained(self) -> None:
        """Leave the drained mark beside the stop file (llmhost.server.stopfile)."""
        if self._stop_file is not None:
            mark_drained(self._stop_file, self._server_pid)

    # -- draining -------------------------------------------------------------
    def begin_drain(self, timeout_s: float, why: str) -> None:
        """Refuse new requests; those in flight get TIMEOUT_S to finish (from the
        first call: a later one only shortens it). Thread-safe."""
        deadline = time.monotonic() + timeout_s
        first = self._drain_deadline is None
        self.accepting = False
        if first or deadline < (self._drain_deadline or deadline):
            self._drain_deadline, self._drain_timeout_s = deadline, timeout_s
        if first:
            self.log(f"draining ({why}): {len(self.active)} request(s) in flight get up to {timeout_s:g} s "
                     "to finish; new ones are refused")

    def _abort_leftovers(self) -> None:
        """On the engine loop: end every request still in flight with the
        shutting-down error (their clients see why, not a stream cut short)."""
        with self.active_lock:
            leftover = [a.task for a in self.active.values() if a.task is not None]
        if self._abort_message is None:
            self._abort_message = (f"the model is shutting down: the request was aborted after the drain timeout "
                                   f"of {self._drain_timeout_s:g} s; retry on another instance")
        if leftover:
            self.log(f"drain time over: aborting {len(leftover)} request(s)")
        for task in leftover:
            task.cancel()

    def engine_dead_message(self) -> str | None:
        """The client's error message if vLLM's engine has died, else None (checks
        the engine itself: vLLM may fail a request before the watchdog's next poll)."""
        if self.dead_message is None and self._engine is not None:
            cause = engine_death_cause(self._engine)
            if cause is not None:
                self.dead_message = self._death_message or client_message(
                    cause, self.config.settings.exit_server_on_engine_death)
                self.accepting = False
        return self.dead_message

    def fail_if_engine_dead(self, sink: Sink) -> bool:
        """Answer SINK with the engine-dead error (True) if the engine has died."""
        message = self.engine_dead_message()
        if message is None:
            return False
        self.metrics.inc("vllm:request_failed_total", label=ENGINE_DEAD)
        sink.fail(message, ENGINE_DEAD)
        return True

    async def _engine_died(self, cause: str, what: str = "died") -> None:
        restart = self.config.settings.exit_server_on_engine_death
        self.accepting = False
        if self.dead_message is None:
            self.dead_message = self._death_message or client_message(cause, restart)
        with self.active_lock:
            tasks = [a.task for a in self.active.values() if a.task is not None]
        self.log_error(f"vLLM's engine {what}: {cause}. Failing {len(tasks)} request(s) in flight and every new one"
                       + ("; stopping tritonserver so that its supervisor restarts it" if restart else
                          " until the server is restarted (exit_server_on_engine_death is false)")
                       + (" unless the health check unloads the model" if self._on_engine_death else ""))
        # Requests that vLLM has not failed yet are cancelled; each answers with
        # the engine-dead error (fail_if_engine_dead in _generate).
        for task in tasks:
            task.cancel()
        deadline = time.monotonic() + DEAD_DRAIN_S
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            self.log_error(f"{len(self.active)} request(s) did not end after the engine died")
        loop = asyncio.get_running_loop()
        if self._on_engine_death is not None and await loop.run_in_executor(None, self._on_engine_death, cause):
            return  # the model unloads itself (ENABLE_VLLM_HEALTH_CHECK, health.py)
        if restart:
            # The callback may wait for the I/O threads to hand the errors to
            # tritonserver first: off the loop.
            await loop.run_in_executor(None, self._stop_server, self.log_error)

    def stop(self, drain_timeout_s: float) -> None:
        """Refuse new work, let in-flight requests finish (within the drain begun
        when the server started stopping, if it did), abort the rest, shut down."""
        if self.dead_message is not None:
            drain_timeout_s = 0  # nothing can finish on a dead engine
        self.begin_drain(drain_timeout_s, "the model is unloading")
        deadline = self._drain_deadline or time.monotonic()
        while self.active and time.monotonic() < deadline:
            time.sleep(0.1)
        loop = self._loop
        if loop is None or self._thread is None:
            return
        if self.active:
            loop.call_soon_threadsafe(self._abort_leftovers)
            end = time.monotonic() + 10
            while self.active and time.monotonic() < end:
                time.sleep(0.05)
        if self._stop is not None:
            loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            self.log_error("the engine thread did not end within 60 s of the stop")
        self._thread = None

    # -- requests -------------------------------------------------------------
    def submit(self, job: GenerateJob, sink: Sink) -> Active:
        """Schedule a request (thread-safe). Returns its Active record."""
        loop = self._loop
        assert loop is not None
        active = Active(request_id=uuid.uuid4().hex)
        sink.active = active
        with self.active_lock:
            self.active[active.request_id] = active

        def create() -> None:
            active.task = loop.create_task(self._generate(active, job, sink))

        loop.call_soon_threadsafe(create)
        return active

    def submit_here(self, job: GenerateJob, sink: Sink) -> Active:
        """Start a request from a coroutine on the engine's own loop (the engine
        socket): its task exists when this returns."""
        active = Active(request_id=uuid.uuid4().hex)
        sink.active = active
        with self.active_lock:
            self.active[active.request_id] = active
        active.task = asyncio.get_running_loop().create_task(self._generate(active, job, sink))
        return active

    def loop(self) -> asyncio.AbstractEventLoop:
        """The engine's event loop (once started)."""
        assert self._loop is not None, "the engine is not running"
        return self._loop

    def cancel(self, active: Active) -> None:
        """Called from another thread when the client went away."""
        loop = self._loop
        if loop is not None and active.task is not None:
            loop.call_soon_threadsafe(active.task.cancel)

    @property
    def limits(self) -> RequestLimits | None:
        """The engine's bounds on a request (None until the engine is up)."""
        if self._limits is None and self._tokenizer is not None and self._max_model_len:
            configured = self.config.settings.max_prompt_bytes
            if configured:
                self._limits = RequestLimits(self._max_model_len, configured)
            else:
                chars = longest_token_chars(self._tokenizer)
                self._limits = RequestLimits(
                    self._max_model_len, derived_prompt_bytes(self._max_model_len, chars),
                    f"llmhost.max_prompt_bytes; by default max_model_len {self._max_model_len} "
                    f"x {chars} characters of the longest token x {UTF8_MAX_BYTES} bytes")
        return self._limits

    async def _prompt_ids(self, job: GenerateJob) -> list[int]:
        """Token ids of the job's prompt, tokenized (and templated) on the worker pool."""
        if self._encoder is None:
            engine, multimodal = self._engine, self._multimodal
            self._encoder = PromptEncoder(
                self._tokenizer, self._max_model_len, self.config.settings.tokenizer_threads,
                lambda: content_rendering(self._tokenizer, engine.model_config, multimodal))
        return await self._encoder.encode(job)

    async def _prompt(self, job: GenerateJob) -> tuple[dict[str, Any], int]:
        """vLLM's prompt for the job (token ids, and the images of a multimodal
        request) and the prompt's length in tokens before any image is expanded."""
        ids = await self._prompt_ids(job)
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if job.images:
            if not self._multimodal:
                raise no_images_here(self._architectures)
            assert self._encoder is not None  # made by _prompt_ids
            prompt["multi_modal_data"] = {"image": await self._encoder.images(job.images)}
        return prompt, len(ids)

    def _sampling_params(self, job: GenerateJob, prompt_len: int, parsed: dict[str, Any] | None = None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        kwargs = dict(job.sampling)
        # As vLLM's own server: max_tokens (given or the default) is lowered to
        # what the prompt leaves of the context.
        kwargs["max_tokens"] = min(kwargs["max_tokens"], self._max_model_len - prompt_len)
        structured = kwargs.pop("structured_outputs", None)
        if job.return_cumulative_logprob and kwargs.get("logprobs") is None:
            # vLLM sums the log probabilities only while it computes them: the
            # sampled token's alone (0 more) costs least.
            kwargs["logprobs"] = 0
        kind = RequestOutputKind.DELTA if job.stream else RequestOutputKind.FINAL_ONLY
        parsed = dict(parsed or {})
        try:
            if "structured_outputs" in parsed:  # vLLM's parsers built it (replies.py)
                kwargs["structured_outputs"] = parsed.pop("structured_outputs")
            elif structured is not None:
                kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
            kwargs.update(parsed)
            return SamplingParams(**kwargs, output_kind=kind)
        except Exception as exc:  # vLLM's validation of the parameters
            reason, message = classify(exc)
            if reason == INVALID_REQUEST:
                raise RequestError(f"invalid sampling parameters: {message.removeprefix('invalid request: ')}"
                                   ) from None
            raise

    @staticmethod
    def _blank(n: int, want_logprobs: bool) -> tuple[list[str], list[int], list[list[Position] | None]]:
        """Texts, token counts and log probabilities of N completions for one response."""
        return [""] * n, [0] * n, [[] if want_logprobs else None for _ in range(n)]

    async def _stats_caught_up(self) -> None:
        """Before a final response leaves: wait until vLLM's statistics cover every
        output token seen so far, so that the metrics pushed ahead of the response
        (model.py) count it. vLLM records a step's statistics after handing out its
        outputs, in the same pass of its output loop, so this is nearly always true
        at once; a step that stopped on a stop string awaits the abort in between."""
        if self.metrics.generation_recorded >= self._tokens_seen:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STATS_WAIT_S
        while self.metrics.generation_recorded < self._tokens_seen:
            if loop.time() >= deadline:
                if not self._stats_lag_logged:
                    self._stats_lag_logged = True
                    self.log(f"metrics lag: vLLM's statistics recorded {self.metrics.generation_recorded} output "
                             f"token(s) of {self._tokens_seen} seen; a final response went without waiting longer")
                # Counted from here on: a difference that stays costs no later response a wait.
                self._tokens_seen = self.metrics.generation_recorded
                return
            await asyncio.sleep(0.001)

    def _prompt_positions(self, ids: list[int], prompt_logprobs: list[Any]) -> list[Position]:
        """vLLM's prompt log probabilities as plain data: the first token (none in vLLM's
        list) with its text and a null log probability, then one position per token. As
        vLLM's server does, -inf becomes -9999.0."""
        first: Position = ({str(ids[0]): {"logprob": None, "rank": None,
                                          "decoded_token": self._tokenizer.decode([ids[0]])}} if ids else {})
        out = [first]
        for top in prompt_logprobs[1:]:
            entry = position(top)
            for value in entry.values():
                if value["logprob"] == float("-inf"):
                    value["logprob"] = -9999.0
            out.append(entry)
        return out

    async def _embed(self, active: Active, prompt: dict[str, Any], prompt_len: int, sink: Sink) -> None:
        """The prompt's embedding (vLLM's pooling runner), as one final response. A model
        that generates text has none: the request is the client's error."""
        if not self._pooling:
            raise RequestError("this model generates text and has no embeddings; serve an "
                               "embedding model (engine_args runner: pooling) for them")
        from vllm.pooling_params import PoolingParams

        final = None
        active.handed_over = time.monotonic()
        async for out in self._engine.encode(prompt, PoolingParams(task="embed"), active.request_id):
            final = out
        if final is None or not final.finished:
            raise RuntimeError("the engine ended the request without a final output")
        engine_prompt = getattr(final, "prompt_token_ids", None)
        vector = [float(v) for v in final.outputs.data.tolist()]
        sink.send(Chunk([""], ["stop"], len(engine_prompt) if engine_prompt else prompt_len, [0], final=True,
                        embedding=vector))

    async def _generate(self, active: Active, job: GenerateJob, sink: Sink) -> None:
        metrics = self.metrics
        counts: list[int] = []  # output tokens of each completion, as sent to the sink
        try:
            if job.tokens is not None:  # the tokenizer's answer alone (llmhost.backend.tokens)
                ids = await self._prompt_ids(job)
                answer = tokens_answer(job, ids, self._tokenizer, self._max_model_len)
                sink.send(Chunk([answer], ["stop"], len(ids), [0], final=True))
                return
            replies = None
            if self._chat is not None and not (self._pooling or job.embed):
                replies = self._chat.replies(job, int(job.sampling.get("n") or 1))
            prompt, prompt_len = await self._prompt(job)
            if self._pooling or job.embed:
                await self._embed(active, prompt, prompt_len, sink)
                return
            reasoning: dict[str, Any] = {}
            if replies is not None:
                params = self._sampling_params(job, prompt_len, replies.adjust(prompt["prompt_token_ids"]))
                if self._chat is not None and self._chat.reasoning_parser:
                    reasoning["reasoning_ended"] = replies.reasoning_ended()
            else:
                params = self._sampling_params(job, prompt_len)
            n = params.n
            counts = [0] * n
            reasons = [""] * n
            cumulative: list[float | None] = [None] * n
            # As vLLM's server: a chat that hides the thinking (include_reasoning false) on a
            # model with a tool or reasoning parser gets no per-token log probabilities,
            # whose token texts would show it.
            hidden = (not job.include_reasoning and job.messages is not None and self._chat is not None
                      and self._chat.parser_cls is not None)
            want_logprobs = job.return_logprobs and job.sampling.get("logprobs") is not None and not hidden
            finished = False
            want_prompt = job.sampling.get("prompt_logprobs") is not None
            prompt_positions: list[Position] | None = None
            texts, step, tops = self._blank(n, want_logprobs)
            said: list[list[dict[str, Any]]] = [[] for _ in range(n)]  # parsed deltas or messages (replies)
            ids: list[list[int]] = [[] for _ in range(n)]  # a request not streamed: each completion's tokens
            # The adapter, when the request names one (checked again: the model's adapters are fixed at load).
            lora = ({"lora_request": lora_request(find_adapter(job.lora_name, self.config.adapters))}
                    if job.lora_name is not None else {})
            active.handed_over = time.monotonic()
            async for out in self._engine.generate(prompt, params, active.request_id, **lora, **reasoning):
                # The prompt as the engine counts it: a multimodal model's image
                # placeholders are expanded there (vLLM's server counts them as prompt
                # tokens in its usage too).
                engine_prompt = getattr(out, "prompt_token_ids", None)
                if engine_prompt:
                    prompt_len = len(engine_prompt)
                if want_prompt and getattr(out, "prompt_logprobs", None):
                    want_prompt = False
                    prompt_positions = self._prompt_positions(engine_prompt or [], out.prompt_logprobs)
                # A stream's outputs are deltas (DELTA), one response each; else vLLM
                # gives the whole request once (FINAL_ONLY), kept until it finished. A
                # completion absent from an output made no progress in it.
                for co in out.outputs:
                    i = co.index
                    texts[i] += co.text
                    step[i] += len(co.token_ids)
                    self._tokens_seen += len(co.token_ids)
                    if co.finish_reason is not None:
                        reasons[i] = str(co.finish_reason)
                    if co.cumulative_logprob is not None:
                        cumulative[i] = float(co.cumulative_logprob)
                    top = tops[i]
                    if top is not None:
                        top.extend(positions(co.logprobs))
                    if replies is not None and job.stream:
                        delta = replies.delta(i, co.text, list(co.token_ids), co.finish_reason is not None)
                        if delta is not None:
                            said[i].append(delta)
                        if co.finish_reason is not None:
                            reasons[i] = replies.stream_finish(i, reasons[i])
                    elif replies is not None:
                        ids[i] += co.token_ids
                if out.finished and self._stats and self.config.settings.fresh_metrics:
                    await self._stats_caught_up()
                if not (job.stream or out.finished):
                    continue
                counts = [a + b for a, b in zip(counts, step, strict=True)]
                if out.finished and not job.exclude_input and not job.stream and job.prompt is not None:
                    texts = [job.prompt + t for t in texts]
                if replies is not None and not job.stream:
                    for i in range(n):
                        message, reasons[i] = replies.message(i, texts[i], ids[i], reasons[i] or "stop")
                        said[i] = [message]
                sink.send(Chunk(texts, list(reasons), prompt_len, step, final=out.finished,
                                cumulative_logprobs=list(cumulative) if job.return_cumulative_logprob else [],
                                logprobs=tops if job.return_logprobs else [], prompt_logprobs=prompt_positions,
                                messages=said if replies is not None else None))
                prompt_positions = None
                said = [[] for _ in range(n)]
                finished = out.finished
                texts, step, tops = self._blank(n, want_logprobs)
            if not finished:
                raise RuntimeError("the engine ended the request without a final output")
        except asyncio.CancelledError:
            if self.fail_if_engine_dead(sink):  # cancelled by the watchdog, or the engine died meanwhile
                return
            if self._abort_message is not None:  # the drain's time ran out
                metrics.inc("vllm:request_failed_total", label=SHUTTING_DOWN)
                sink.fail(self._abort_message, SHUTTING_DOWN)
                return
            metrics.inc("vllm:request_cancelled_total")
            # Tokens handed to the client so far (a request not streamed gets its
            # tokens only at the end: 0).
            self.log(f"{request_label(active.request_id, job.client_id)} cancelled: its client went away "
                     f"after {sum(counts)} output token(s) sent to it")
            sink.cancelled()
        except Exception as exc:  # noqa: BLE001 - ours and vLLM's validation, and engine errors
            if not isinstance(exc, RequestError) and self.fail_if_engine_dead(sink):
                return  # EngineDeadError and whatever failed with the engine
            # Client errors (ours, and vLLM's own validation, e.g. an invalid
            # regex) are invalid_request; the rest are the server's (failures.py).
            reason, message = classify(exc)
            metrics.inc("vllm:request_failed_total", label=reason)
            if reason == ENGINE_ERROR:
                self.log(f"{request_label(active.request_id, job.client_id)} failed: {type(exc).__name__}: {exc}\n"
                         f"{''.join(traceback.format_exception(exc))}")
            sink.fail(message, reason)
        finally:
            with self.active_lock:
                self.active.pop(active.request_id, None)
