"""The vLLM side: one AsyncLLM engine in an asyncio loop on its own thread.

Requests are scheduled onto that loop from Triton's execute() thread; every
result goes out through a ``Sink`` (implemented by the Triton I/O thread), so the
loop never blocks on a round trip to tritonserver.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmhost.backend.config import ModelConfig
from llmhost.backend.errors import RequestError
from llmhost.backend.metrics import ServingMetrics
from llmhost.backend.request import GenerateJob

# Defaults we set for a server unless model.json says otherwise.
ENGINE_DEFAULTS: dict[str, Any] = {"disable_log_stats": True}


@dataclass
class Chunk:
    """What one response carries, before it becomes Triton tensors."""

    texts: list[str]
    finish_reasons: list[str]
    num_input_tokens: int
    num_output_tokens: list[int]
    final: bool


class Sink(Protocol):
    active: Active | None

    def send(self, chunk: Chunk) -> None: ...
    def fail(self, message: str) -> None: ...
    def cancelled(self) -> None: ...


@dataclass
class Active:
    """An in-flight request, as the I/O thread sees it for cancellation checks."""

    request_id: str
    task: asyncio.Task[None] | None = None
    last_check: float = field(default_factory=time.monotonic)


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


class EngineRunner:
    def __init__(self, config: ModelConfig, metrics: ServingMetrics, log: Callable[[str], None]) -> None:
        self.config = config
        self.metrics = metrics
        self.log = log
        self.active: dict[str, Active] = {}
        self.active_lock = threading.Lock()
        self.accepting = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._engine: Any = None
        self._tokenizer: Any = None
        self._max_model_len = 0
        self._stop: asyncio.Event | None = None

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                loop.run_until_complete(self._main(ready, failure))
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="llmhost-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        self.accepting = True

    async def _main(self, ready: threading.Event, failure: list[BaseException]) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        from llmhost.backend.stats import stat_logger_factory

        self._stop = asyncio.Event()
        try:
            args = build_engine_args(self.config.engine_args)
            self._engine = AsyncLLM.from_engine_args(args, stat_loggers=[stat_logger_factory(self.metrics)])
            self._tokenizer = self._engine.get_tokenizer()
            self._max_model_len = int(self._engine.model_config.max_model_len)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            failure.append(exc)
            ready.set()
            return
        ready.set()
        await self._stop.wait()
        self._engine.shutdown()
        self._engine = None

    def stop(self, drain_timeout_s: float) -> None:
        """Refuse new work, let in-flight requests finish, abort the rest, shut down."""
        self.accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self.active and time.monotonic() < deadline:
            time.sleep(0.1)
        loop = self._loop
        if loop is None or self._thread is None:
            return
        with self.active_lock:
            leftover = [a.task for a in self.active.values() if a.task is not None]
        if leftover:
            self.log(f"drain time over: aborting {len(leftover)} request(s)")
            for task in leftover:
                loop.call_soon_threadsafe(task.cancel)
            end = time.monotonic() + 10
            while self.active and time.monotonic() < end:
                time.sleep(0.05)
        if self._stop is not None:
            loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)
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

    def cancel(self, active: Active) -> None:
        """Called from another thread when the client went away."""
        loop = self._loop
        if loop is not None and active.task is not None:
            loop.call_soon_threadsafe(active.task.cancel)

    def _prompt_ids(self, job: GenerateJob) -> list[int]:
        tok = self._tokenizer
        if job.messages is not None:
            try:
                text = tok.apply_chat_template(job.messages, tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # noqa: BLE001 - the template itself can reject a conversation
                raise RequestError(f"the model's chat template rejected 'messages': {exc}") from None
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(job.prompt, add_special_tokens=True)
        if not ids:
            raise RequestError("the prompt encodes to no tokens")
        if len(ids) >= self._max_model_len:
            raise RequestError(
                f"prompt is {len(ids)} tokens; the model's max_model_len is {self._max_model_len} "
                f"(the prompt must leave room for at least one output token)"
            )
        return ids

    def _sampling_params(self, job: GenerateJob) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        kwargs = dict(job.sampling)
        structured = kwargs.pop("structured_outputs", None)
        if structured is not None:
            kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
        kind = RequestOutputKind.DELTA if job.stream else RequestOutputKind.FINAL_ONLY
        try:
            return SamplingParams(**kwargs, output_kind=kind)
        except (ValueError, TypeError) as exc:
            raise RequestError(f"invalid sampling parameters: {exc}") from None

    async def _generate(self, active: Active, job: GenerateJob, sink: Sink) -> None:
        metrics = self.metrics
        try:
            ids = self._prompt_ids(job)
            params = self._sampling_params(job)
            n = params.n
            counts = [0] * n
            texts = [""] * n
            reasons = [""] * n
            finished = False
            async for out in self._engine.generate({"prompt_token_ids": ids}, params, active.request_id):
                if job.stream:
                    texts = [""] * n
                for co in out.outputs:
                    texts[co.index] = co.text if job.stream else texts[co.index] + co.text
                    counts[co.index] += len(co.token_ids)
                    if co.finish_reason is not None:
                        reasons[co.index] = str(co.finish_reason)
                if job.stream or out.finished:
                    if out.finished and not job.exclude_input and not job.stream and job.prompt is not None:
                        texts = [job.prompt + t for t in texts]
                    sink.send(Chunk(list(texts), list(reasons), len(ids), list(counts), final=out.finished))
                    finished = out.finished
            if not finished:
                raise RuntimeError("the engine ended the request without a final output")
        except asyncio.CancelledError:
            metrics.inc("vllm:request_cancelled_total")
            sink.cancelled()
        except RequestError as exc:
            metrics.inc("vllm:request_failed_total", label="invalid_request")
            sink.fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - vLLM's own validation and engine errors
            # vLLM validates some inputs itself (e.g. structured-output specs) and
            # raises ValueError subclasses; those are the client's fault.
            if isinstance(exc, ValueError):
                metrics.inc("vllm:request_failed_total", label="invalid_request")
                sink.fail(f"invalid request: {exc}")
            else:
                metrics.inc("vllm:request_failed_total", label="engine_error")
                self.log(f"request {active.request_id} failed: {type(exc).__name__}: {exc}")
                sink.fail(f"engine error: {type(exc).__name__}: {exc}")
        finally:
            with self.active_lock:
                self.active.pop(active.request_id, None)
