"""Triton Python-based backend for vLLM: the ``TritonPythonModel`` Triton loads.

Installed as ``<backend-dir>/vllm/model.py`` (a one-line shim importing this), so a
model directory holds only ``config.pbtxt`` (``backend: "vllm"``) and ``model.json``
(in the version directory, as NVIDIA's vllm_backend keeps it, or the model's).

Threads in the stub process:
- Triton's thread calls ``execute()``: parse and validate, schedule, return at once;
- the engine thread runs vLLM's AsyncLLM in an asyncio loop (engine.py);
- the I/O threads do every round trip to tritonserver (sending responses,
  cancellation checks, metric pushes), so neither of the others ever waits on one.
  Each send blocks until tritonserver has taken the response, so several I/O
  threads (``response_threads``) keep several round trips in flight; a stream
  always stays on one thread, which keeps its responses in order. By default every
  engine step of a stream is one response (as NVIDIA's vllm_backend sends). A stream
  with a window (``stream_interval_ms``, the model's or the request's) wakes an I/O
  thread only with its first and final chunks (and errors); the deltas in between
  wait for the thread's tick, at most the window, so a busy engine step does not
  cost one wake-up (and GIL hand-over) per stream.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import itertools
import json
import locale
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from llmhost.backend.coalesce import StreamWindow, coalesce
from llmhost.backend.config import ConfigError, ModelConfig, load_model_config, locate_model_json
from llmhost.backend.engine import Active, Chunk, EngineRunner, EngineStartError
from llmhost.backend.errors import RequestError, safe_message
from llmhost.backend.failures import SHUTTING_DOWN_MESSAGE
from llmhost.backend.health import UNHEALTHY_MESSAGE, SelfUnload
from llmhost.backend.images import IMAGE
from llmhost.backend.kept_counts import count_file, read_count
from llmhost.backend.lora import check_published, find_adapter, with_adapters
from llmhost.backend.metrics import ENGINE_HANGS, RESPONSE_DELAY, ServingMetrics, TritonExporter
from llmhost.backend.outputs import response_outputs
from llmhost.backend.request import (
    BOOL_INPUTS,
    MESSAGES,
    PROMPT_TOKEN_IDS,
    SAMPLING_PARAMETERS,
    TEXT_INPUT,
    client_id,
    client_label,
    parse_request,
)
from llmhost.backend.store_port import store_port_taken
from llmhost.backend.stream_socket import SOCKET_DIR_ENV, StreamSocketServer, make_socket_folder, socket_path
from llmhost.backend.triton_params import ENABLE_VLLM_HEALTH_CHECK, bool_param, metrics_enabled
from llmhost.kv_events.sockets import describe, events_config, remove_description, write_description

INPUTS: list[dict[str, Any]] = [
    {"name": TEXT_INPUT, "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": MESSAGES, "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": PROMPT_TOKEN_IDS, "data_type": "TYPE_INT64", "dims": [-1], "optional": True},
    {"name": SAMPLING_PARAMETERS, "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    *({"name": n, "data_type": "TYPE_BOOL", "dims": [1], "optional": True} for n in BOOL_INPUTS),
    # vllm_backend's: base64-encoded images for a multimodal model (llmhost.backend.images).
    {"name": IMAGE, "data_type": "TYPE_STRING", "dims": [-1], "optional": True},
]
OUTPUTS: list[dict[str, Any]] = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    # An embedding model's answer, and the prompt's log probabilities (llmhost.backend.outputs).
    {"name": "embedding", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "prompt_logprobs", "data_type": "TYPE_STRING", "dims": [1]},
    # A chat's reasoning, content and tool calls, parsed by vLLM's parsers (llmhost.backend.replies).
    {"name": "message", "data_type": "TYPE_STRING", "dims": [-1]},
]
INPUT_NAMES = [i["name"] for i in INPUTS]
# Queue items the I/O thread takes at once. Everything queued, in practice: the
# waiting deltas of a stream merge into one response only within one take, so a
# smaller bound let a backlog grow without end once the engine made more items a
# second than the round trips to tritonserver could carry (about 10,000 a second
# on an H100 host: 256 streams of 11 ms steps make 23,000).
MAX_BATCH = 1 << 20
SEND_BEFORE_STOP_S = 10.0  # after the engine died, how long queued errors may take to leave


def _pb() -> Any:
    import triton_python_backend_utils as pb_utils  # only importable inside the stub

    return pb_utils


def _freeze_startup_heap() -> None:
    """Move everything alive after start-up out of the garbage collector's reach.

    The stub holds vLLM, torch and the tokenizer: hundreds of thousands of
    long-lived objects that every full collection would walk again, holding the
    GIL and stalling the engine and I/O threads (perf showed the stub spending a
    large share of its CPU time in gc_collect_main). vLLM's own API server does
    the same after start-up.
    """
    gc.collect()  # a full collection first, so only what is alive gets frozen
    gc.freeze()


class _MetricsPush:
    """Hands the aggregated metrics' changes to Triton: every ``metrics_interval_s``
    (the first I/O thread), and before a request's final response or error is sent
    (any I/O thread), so that a client reading /metrics right after its response
    finds its request counted. A lock keeps two threads from pushing at once."""

    def __init__(self, metrics: ServingMetrics, exporter: TritonExporter | None, on_final: bool = True) -> None:
        self.metrics = metrics
        self.exporter = exporter
        self.on_final = on_final  # the model's fresh_metrics
        self._lock = threading.Lock()

    def before_final(self, pb: Any) -> None:
        """Before a final response or error: push, unless the model pushes only periodically."""
        if self.on_final:
            self.flush(pb)

    def flush(self, pb: Any) -> None:
        if self.exporter is None:
            return
        with self._lock:
            try:
                self.exporter.apply(self.metrics.deltas())
            except Exception as exc:  # noqa: BLE001
                pb.Logger.log_warn(f"[llmhost] pushing metrics failed: {exc}")


class _TritonSink:
    """Sends one request's results; every call only enqueues work for its I/O thread."""

    __slots__ = ("active", "counted", "done", "flags", "io", "opened", "sender", "window_s")

    def __init__(self, io: _TritonIO, sender: Any, flags: frozenset[str] = frozenset(),
                 window_s: float | None = None) -> None:
        self.io = io
        self.sender = sender
        # The additional outputs asked for (the names of their return_* inputs), and
        # SPARSE_OUTPUTS if they go only where they say something (outputs.py).
        self.flags = flags
        self.counted = False  # a response with num_input_tokens was made
        # This stream's window (s): the request's stream_interval_ms, else the model's.
        self.window_s = io.window.window_s if window_s is None else window_s
        self.active: Active | None = None
        self.done = False
        self.opened = False  # the engine thread queued this stream's first chunk

    def send(self, chunk: Chunk) -> None:
        # Without a window every chunk wakes the I/O thread. With one, only the first
        # and the final chunk do; deltas in between wait for its next tick (they
        # would be held for the window anyway).
        urgent = chunk.final or not self.opened or self.window_s <= 0
        self.opened = True
        self.io.put(("chunk", self, chunk), urgent)

    def fail(self, message: str, reason: str = "") -> None:
        self.io.put(("error", self, message), True)

    def cancelled(self) -> None:
        self.io.put(("error", self, "request cancelled"), True)


class _TritonIO:
    """One thread that talks to tritonserver after execute() returns, for its share of the streams."""

    def __init__(self, runner: EngineRunner, push: _MetricsPush, interval_s: float, metrics_s: float,
                 window_s: float, periodic: bool, name: str) -> None:
        # Work from other threads: a deque (append and popleft are atomic) and an
        # event that only urgent items set, so a busy engine step does not wake
        # this thread once per stream.
        self.items: collections.deque[tuple[str, Any, Any] | None] = collections.deque()
        self.wake = threading.Event()
        self.runner = runner
        self.push = push
        self.interval = interval_s
        self.metrics_s = metrics_s
        self.window = StreamWindow(window_s)
        self.periodic = periodic and push.exporter is not None  # this thread pushes every metrics_s
        self.sinks: dict[str, _TritonSink] = {}
        # Response delays (engine output -> handed to tritonserver) not yet in the metrics.
        self.delays: list[float] = []
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, item: tuple[str, Any, Any] | None, urgent: bool = True) -> None:
        self.items.append(item)
        if urgent:
            self.wake.set()

    def _take(self) -> list[tuple[str, Any, Any] | None]:
        batch: list[tuple[str, Any, Any] | None] = []
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self.items.popleft())
            except IndexError:
                break
        return batch

    def _send_queued(self, pb: Any, final: int) -> bool:
        """Take what is queued and send what the window lets through now. True when
        the stop marker was among it; items queued after the marker go back to the
        queue's front."""
        batch = self._take()
        stop = None in batch
        if stop:
            at = batch.index(None)
            self.items.extendleft(reversed(batch[at + 1:]))
            batch = batch[:at]
        for item in self.window.admit(coalesce(batch)):  # type: ignore[arg-type]
            self._handle(pb, final, item)
        return stop

    def _run(self) -> None:
        pb = _pb()
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        now = time.monotonic()
        last_flush = last_poll = now
        running = True
        while running:
            timeout = self.interval - (now - last_poll)
            if self.periodic:
                # Only the thread that pushes metrics waits for their interval: on
                # the others last_flush never moves, and the timeout would stay
                # negative, a busy loop burning a core while idle.
                timeout = min(timeout, self.metrics_s - (now - last_flush))
            due = self.window.next_due()
            if due is not None:
                # Held deltas do not wake this thread themselves: wake when the
                # first of them is due.
                timeout = min(timeout, due - now)
            if timeout > 0 and not self.items:
                self.wake.wait(timeout)
            # Cleared before taking the items: an urgent put after this point sets
            # it again, so no wake-up is lost.
            self.wake.clear()
            running = not self._send_queued(pb, final)
            now = time.monotonic()
            due = self.window.next_due()
            if due is not None and now >= due:
                self._tick(pb, final, now)
                now = time.monotonic()
            if now - last_poll >= self.interval:
                # Requests that produced nothing lately (non-streaming ones, long
                # prefills, held deltas) still get their cancellation checked.
                for s in list(self.sinks.values()):
                    self._maybe_check(s, now)
                last_poll = now
            if self.delays:
                self.push.metrics.observe(RESPONSE_DELAY, self.delays)
                self.delays = []
            if self.periodic and now - last_flush >= self.metrics_s:
                self.push.flush(pb)
                last_flush = now
        self._send_queued(pb, final)
        for item in self.window.flush():
            self._handle(pb, final, item)
        if self.periodic:
            self.push.flush(pb)

    def _tick(self, pb: Any, final: int, now: float) -> None:
        """Send every held delta that is due by NOW. With many streams that is many
        round trips: an urgent item (a first chunk, a final one, an error) that comes
        in meanwhile goes first, and what is left of the tick goes back to the
        window, so each stream's responses stay in order."""
        items = self.window.flush_due(now)
        i = 0
        while i < len(items):
            self._handle(pb, final, items[i])
            i += 1
            if i < len(items) and self.wake.is_set():
                self.wake.clear()
                self.window.hold_back(items[i:])
                if self._send_queued(pb, final):  # stopping: the main loop sees it next and sends the rest
                    self.items.appendleft(None)
                    self.wake.set()
                items, i = self.window.flush_due(time.monotonic()), 0

    def _handle(self, pb: Any, final: int, item: tuple[str, Any, Any]) -> None:
        kind, sink, payload = item
        try:
            if kind == "chunk":
                if payload.final:
                    self.push.before_final(pb)  # the request's tokens are on /metrics before its client has its answer
                sink.sender.send(self._response(pb, sink, payload), flags=final if payload.final else 0)
                self.delays.append(time.monotonic() - payload.made)
                if payload.final:
                    self._forget(sink)
                else:
                    self._maybe_check(sink, time.monotonic())
            elif kind == "error":
                self.push.before_final(pb)
                sink.sender.send(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(payload)),
                                 flags=final)
                self._forget(sink)
            elif kind == "barrier":
                payload.set()  # everything queued before it has been handed to tritonserver
            elif kind == "track" and not sink.done:
                self.sinks[payload] = sink
        except Exception as exc:  # noqa: BLE001 - a dead client must not stop the thread
            pb.Logger.log_warn(f"[llmhost] sending a response failed: {exc}")
            self._forget(sink)

    def _forget(self, sink: _TritonSink | None) -> None:
        if sink is not None:
            sink.done = True
            self.window.forget(sink)
            if sink.active is not None:
                self.sinks.pop(sink.active.request_id, None)

    def _maybe_check(self, sink: _TritonSink, now: float) -> None:
        active = sink.active
        if active is None or sink.done or now - active.last_check < self.interval:
            return
        active.last_check = now
        if sink.sender.is_cancelled():
            self.runner.cancel(active)
            self.sinks.pop(active.request_id, None)

    @staticmethod
    def _response(pb: Any, sink: _TritonSink, chunk: Chunk) -> Any:
        """The response's tensors: text_output and the additional outputs asked for (outputs.py)."""
        outputs = response_outputs(chunk, sink.flags, sink.counted)
        sink.counted = sink.counted or "num_input_tokens" in outputs
        return pb.InferenceResponse(output_tensors=[pb.Tensor(name, _array(name, values))
                                                    for name, values in outputs.items()])


# The numeric outputs' element types; the rest are STRING tensors.
_DTYPES = {"cumulative_logprob": np.float32, "num_input_tokens": np.uint32, "num_output_tokens": np.uint32,
           "embedding": np.float32}


def _array(name: str, values: list[Any]) -> Any:
    """One output's tensor contents (a missing cumulative log probability is NaN)."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        return _strings(values)
    return np.array([np.nan if v is None else v for v in values], dtype=dtype)


def _strings(values: list[str]) -> Any:
    """A STRING tensor's array."""
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)


class _TritonIOPool:
    """``response_threads`` I/O threads; each new stream goes to the next one in turn."""

    def __init__(self, runner: EngineRunner, metrics: ServingMetrics, settings: Any,
                 exporter: TritonExporter | None) -> None:
        self.push = _MetricsPush(metrics, exporter, settings.fresh_metrics)
        self.shards = [
            _TritonIO(runner, self.push, settings.cancel_check_interval_s, settings.metrics_interval_s,
                      settings.stream_interval_ms / 1000.0, i == 0, f"llmhost-triton-io-{i}")
            for i in range(settings.response_threads)
        ]
        self.exporter = exporter
        self._turn = itertools.count()

    def pick(self) -> _TritonIO:
        return self.shards[next(self._turn) % len(self.shards)]

    def wait_sent(self, timeout_s: float) -> bool:
        """Wait until every response queued so far has been handed to tritonserver
        (a barrier item behind them on each thread); False on timeout."""
        events = []
        for shard in self.shards:
            event = threading.Event()
            shard.put(("barrier", None, event), urgent=True)
            events.append(event)
        deadline = time.monotonic() + timeout_s
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in events)

    def stop(self) -> None:
        for shard in self.shards:
            shard.put(None)
        for shard in self.shards:
            shard.thread.join(timeout=30)


def instance_name(args: dict[str, Any]) -> str:
    """This model instance's name, as Triton's initialize() args give it (the model's
    name where they lack it): its engine socket, its metric series, its kept counts."""
    return str(args.get("model_instance_name") or args["model_name"])


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config: Any) -> Any:
        cfg = auto_complete_model_config
        have_in = {i["name"] for i in cfg.as_dict().get("input", [])}
        have_out = {o["name"] for o in cfg.as_dict().get("output", [])}
        for spec in INPUTS:
            if spec["name"] not in have_in:
                cfg.add_input(spec)
        for spec in OUTPUTS:
            if spec["name"] not in have_out:
                cfg.add_output(spec)
        # vLLM batches by itself and streams: Triton must neither batch nor wait
        # for a single response.
        cfg.set_max_batch_size(0)
        cfg.set_model_transaction_policy({"decoupled": True})
        return cfg

    def initialize(self, args: dict[str, Any]) -> None:
        # `import vllm` fails with UnicodeDecodeError in the stub's isolated
        # interpreter unless the C locale is made UTF-8 first.
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
        pb = _pb()
        self.log = pb.Logger
        model_config = json.loads(args["model_config"])
        if not pb.using_decoupled_model_transaction_policy(model_config):
            raise pb.TritonModelException("the vllm backend needs a decoupled model: set model_transaction_policy "
                                          "{ decoupled: true } in config.pbtxt")
        self.config = self._load_config(pb, args)
        if taken := store_port_taken(self.config.engine_args):
            raise pb.TritonModelException(taken)
        self._apply_placement(args)
        self._publish_kv_events(args)
        self.metrics = ServingMetrics()
        # Hangs counted before the server's last restarts (kept_counts.py).
        hang_count_file = count_file("engine_hangs", args["model_name"], instance_name(args))
        if hangs := read_count(hang_count_file):
            self.metrics.inc(ENGINE_HANGS, hangs)
        # config.pbtxt's parameters, as NVIDIA's vllm_backend reads them (triton_params.py).
        report_metrics = metrics_enabled(model_config, self.config.engine_args)
        self.health: SelfUnload | None = None
        if bool_param(model_config, ENABLE_VLLM_HEALTH_CHECK):
            self.health = SelfUnload(args["model_name"], pb.unload_model,
                                     lambda m: pb.Logger.log_info(f"[llmhost] {m}"),
                                     lambda m: pb.Logger.log_error(f"[llmhost] {m}"))
        self.runner = EngineRunner(self.config, self.metrics, lambda m: pb.Logger.log_info(f"[llmhost] {m}"),
                                   lambda m: pb.Logger.log_error(f"[llmhost] {m}"),
                                   stop_server=self._stop_server_when_sent, on_drained=self._drained_when_sent,
                                   stats=report_metrics, on_engine_death=self.health,
                                   death_message=UNHEALTHY_MESSAGE if self.health else None,
                                   hang_count_file=hang_count_file)
        try:
            self.runner.start()  # bounded: whatever fails before the engine is up ends here
        except EngineStartError as exc:
            self.runner = None
            raise pb.TritonModelException(str(exc)) from None
        # Metric families are made only after the engine is up and dropped in
        # finalize(): made earlier they crash the stub at exit.
        exporter = self._exporter(pb, args) if report_metrics else None
        if args.get("model_instance_kind", "CPU") == "CPU" and self.config.settings.pin_frontend_cpus:
            from llmhost.backend.cpus import pin_frontend

            pin_frontend(lambda m: pb.Logger.log_info(f"[llmhost] {m}"))
        self.io = _TritonIOPool(self.runner, self.metrics, self.config.settings, exporter)
        # Every series, the hangs kept from before a restart among them, on /metrics once the model is ready.
        self.io.push.flush(pb)
        self.engine_socket = self._open_engine_socket(pb, args)
        _freeze_startup_heap()
        pb.Logger.log_info(f"[llmhost] model {args['model_name']} ready "
                           f"(max_model_len {self.runner._max_model_len}, "
                           f"default max_tokens {self.config.settings.default_max_tokens}, "
                           f"{self.config.settings.response_threads} response threads, "
                           f"stream interval {self.config.settings.stream_interval_ms:g} ms, "
                           f"metrics {'on' if exporter is not None else 'off'}, "
                           f"health check {'on' if self.health else 'off'})")

    @staticmethod
    def _engine_socket_path(args: dict[str, Any]) -> Path | None:
        """This instance's engine socket, where $LLMHOST_ENGINE_SOCKET_DIR names a folder (stream_socket.py)."""
        import os

        directory = os.environ.get(SOCKET_DIR_ENV, "").strip()
        if not directory:
            return None
        return socket_path(Path(directory), args["model_name"], str(args.get("model_version", "1")),
                           instance_name(args))

    def _publish_kv_events(self, args: dict[str, Any]) -> None:
        """With the ``kv_events`` setting and an engine socket: the engine publishes its
        KV-cache events beside the socket (kv_events.py), unless model.json gives its
        own kv_events_config."""
        path = self._engine_socket_path(args)
        if not self.config.settings.kv_events or path is None or "kv_events_config" in self.config.engine_args:
            return
        make_socket_folder(path)  # the engine binds its events there before the engine socket is served
        self.config = dataclasses.replace(self.config, engine_args={**self.config.engine_args,
                                                                    "kv_events_config": events_config(path)})

    def _open_engine_socket(self, pb: Any, args: dict[str, Any]) -> StreamSocketServer | None:
        """This instance's engine socket (where a folder for them is set), and the
        description of its KV-cache events where the engine publishes them beside it."""
        path = self._engine_socket_path(args)
        if path is None:
            return None
        server = StreamSocketServer(self.runner, self.config.settings, path,
                                    lambda m: pb.Logger.log_info(f"[llmhost] {m}"), self.config.adapters)
        if not server.open():
            return None
        engine_config = self.runner.model_config
        if self.config.engine_args.get("kv_events_config") == events_config(path) and engine_config is not None:
            write_description(path, describe(path, engine_config))
        return server

    @staticmethod
    def _exporter(pb: Any, args: dict[str, Any]) -> TritonExporter | None:
        """The metric families on Triton's /metrics; None where the server has metrics
        off (``--allow-metrics=false``), as vllm_backend then goes on without them."""
        try:
            return TritonExporter(pb, args["model_name"], args.get("model_version", "1"), instance_name(args))
        except pb.TritonModelException as exc:
            if "metrics not supported" not in str(exc):
                raise
            pb.Logger.log_info("[llmhost] the server has metrics off: this model reports none")
            return None

    @staticmethod
    def _load_config(pb: Any, args: dict[str, Any]) -> ModelConfig:
        """model.json of the version Triton loads, else of the model (config.py)."""
        model_dir = Path(args["model_repository"]) if "model_repository" in args else Path(".")
        try:
            path, ignored = locate_model_json(model_dir, str(args.get("model_version", "1")))
            config, lora_note = with_adapters(load_model_config(path), path)
            check_published(json.loads(args.get("model_config") or "{}"), config.adapters)
        except ConfigError as exc:
            raise pb.TritonModelException(str(exc)) from None
        if lora_note:
            pb.Logger.log_info(f"[llmhost] {lora_note}")
        for other in ignored:
            pb.Logger.log_warn(f"[llmhost] {other} is ignored: {path} takes precedence")
        pb.Logger.log_info(f"[llmhost] settings from {path}")
        return config

    def _apply_placement(self, args: dict[str, Any]) -> None:
        import os

        kind = args.get("model_instance_kind", "CPU")
        tp = int(self.config.engine_args.get("tensor_parallel_size", 1))
        pp = int(self.config.engine_args.get("pipeline_parallel_size", 1))
        if kind == "GPU":
            if tp * pp > 1:
                raise _pb().TritonModelException(
                    f"tensor_parallel_size x pipeline_parallel_size = {tp * pp}: use instance_group kind "
                    "KIND_MODEL for a model spanning several GPUs (KIND_GPU pins one GPU per instance)")
            os.environ["CUDA_VISIBLE_DEVICES"] = str(args.get("model_instance_device_id", "0"))
        elif kind == "MODEL" and self.config.settings.visible_gpus:
            # The model's own GPUs (the stub is this model's process alone): vLLM's
            # engine and workers inherit them. Without, two models would both take
            # the first GPUs the server sees.
            os.environ["CUDA_VISIBLE_DEVICES"] = self.config.settings.visible_gpus

    def _stop_server_when_sent(self, log: Any) -> bool:
        """After the engine died: stop tritonserver only once the errors of the
        requests it failed have reached tritonserver (else a client may see its
        stream end without the error while the server shuts down)."""
        from llmhost.backend.watchdog import stop_tritonserver

        io = getattr(self, "io", None)
        if io is not None:
            if not io.wait_sent(SEND_BEFORE_STOP_S):
                log(f"responses still queued after {SEND_BEFORE_STOP_S:g} s; stopping tritonserver anyway")
            # The failed requests and the hang count reach /metrics before the stop,
            # not only at the next periodic push.
            io.push.flush(_pb())
        return stop_tritonserver(log)

    def _drained_when_sent(self) -> None:
        """The server is stopping and nothing is in flight: mark this backend drained
        once the last responses have reached tritonserver (the stopper then closes
        the HTTP connections left idle: llmhost.server.stopserver)."""
        io = getattr(self, "io", None)
        runner = getattr(self, "runner", None)
        if io is not None:
            io.wait_sent(SEND_BEFORE_STOP_S)
        if runner is not None:
            runner.mark_drained()

    def execute(self, requests: list[Any]) -> None:
        pb = _pb()
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        settings = self.config.settings
        # ENABLE_VLLM_HEALTH_CHECK: the engine's state is read before each batch, as
        # vllm_backend does; a dead engine unloads the model (health.py).
        unhealthy = self.health is not None and self.runner.engine_dead_message() is not None
        if unhealthy:
            threading.Thread(target=self.health, args=("found dead before a request",),  # type: ignore[arg-type]
                             name="llmhost-health-unload", daemon=True).start()
        for request in requests:
            sender = request.get_response_sender()
            if not self.runner.accepting:
                dead = self.runner.engine_dead_message()
                self.metrics.inc("vllm:request_failed_total", label="engine_dead" if dead else "shutting_down")
                error = (pb.TritonError(UNHEALTHY_MESSAGE, pb.TritonError.UNAVAILABLE) if unhealthy
                         else pb.TritonError(dead or SHUTTING_DOWN_MESSAGE))
                sender.send(pb.InferenceResponse(output_tensors=[], error=error), flags=final)
                continue
            cid = ""
            try:
                cid = client_id(request.request_id())
                inputs = {}
                for name in INPUT_NAMES:
                    tensor = pb.get_input_tensor_by_name(request, name)
                    inputs[name] = tensor.as_numpy() if tensor is not None else None
                job = parse_request(inputs, request.parameters(), settings, self.runner.limits)
                job.client_id = cid
                if job.lora_name is not None:
                    find_adapter(job.lora_name, self.config.adapters)
            except RequestError as exc:
                self.metrics.inc("vllm:request_failed_total", label="invalid_request")
                sender.send(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(safe_message(str(exc)))),
                            flags=final)
                continue
            except Exception as exc:  # noqa: BLE001 - no exception may reach a client with its traceback
                self._internal_error(pb, sender, final, exc, cid)
                continue
            try:
                window_s = None if job.stream_interval_ms is None else job.stream_interval_ms / 1000.0
                sink = _TritonSink(self.io.pick(), sender, job.returns(), window_s)
                active = self.runner.submit(job, sink)
                sink.io.put(("track", sink, active.request_id), urgent=False)
            except Exception as exc:  # noqa: BLE001 - as above
                self._internal_error(pb, sender, final, exc, cid)
        return None

    def _internal_error(self, pb: Any, sender: Any, final: int, exc: BaseException, cid: str) -> None:
        """A failure of ours (not the client's input): the traceback goes to the log,
        the client gets one line without it."""
        self.metrics.inc("vllm:request_failed_total", label="engine_error")
        pb.Logger.log_error(f"[llmhost] a request ({client_label(cid)}) failed: "
                            f"{''.join(traceback.format_exception(exc))}")
        try:
            sender.send(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(
                safe_message(f"internal error: {type(exc).__name__}; the server log has the details"))), flags=final)
        except Exception as send_exc:  # noqa: BLE001 - the client may be gone
            pb.Logger.log_warn(f"[llmhost] sending an error failed: {send_exc}")

    def finalize(self) -> None:
        runner = getattr(self, "runner", None)
        t0 = time.monotonic()
        engine_socket = getattr(self, "engine_socket", None)
        if engine_socket is not None:  # no new requests on it; those in flight drain with the rest
            remove_description(engine_socket.path)
            engine_socket.close()
            self.engine_socket = None
        if runner is not None:
            self.log.log_info("[llmhost] unloading: draining, then stopping vLLM's engine")
            runner.stop(self.config.settings.drain_timeout_s)
        t_engine = time.monotonic()
        io = getattr(self, "io", None)
        if io is not None:
            io.stop()
            if io.exporter is not None:
                io.exporter.close()
            self.io = None
        self.runner = None
        # The start-up heap stays frozen (_freeze_startup_heap): this stub process
        # ends after finalize, and a collection over that heap (here, or the one at
        # interpreter exit) only delays the unload, by seconds on a busy host.
        if runner is not None:
            t1 = time.monotonic()
            self.log.log_info(f"[llmhost] unloaded in {t1 - t0:.1f} s (drain and engine {t_engine - t0:.1f} s, "
                              f"response threads {t1 - t_engine:.1f} s)")
