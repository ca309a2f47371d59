"""The stub's I/O thread (model._TritonIO) with a stand-in for the python backend's
module: the first and final chunk of a stream leave at once, the deltas between
them are delivered by the thread's own tick (nothing else wakes it for them),
merged, in order, and nothing held is lost at shutdown."""

from __future__ import annotations

import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from llmhost.backend.engine import Chunk
from llmhost.backend.metrics import ServingMetrics

FINAL = 1


class _Tensor:
    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value


class _Response:
    def __init__(self, output_tensors: list[_Tensor], error: Any = None) -> None:
        self.tensors, self.error = output_tensors, error


class _Logger:
    @staticmethod
    def log_warn(msg: str) -> None:
        print(msg, file=sys.stderr)

    log_info = log_warn


@pytest.fixture
def fake_pb() -> Iterator[None]:
    mod = types.ModuleType("triton_python_backend_utils")
    mod.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL  # type: ignore[attr-defined]
    mod.Tensor = _Tensor  # type: ignore[attr-defined]
    mod.InferenceResponse = _Response  # type: ignore[attr-defined]
    mod.TritonError = str  # type: ignore[attr-defined]
    mod.Logger = _Logger  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    yield
    del sys.modules[mod.__name__]


class Sender:
    """Records what a stream's response sender got."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []
        self.cond = threading.Condition()

    def send(self, response: _Response, flags: int = 0) -> None:
        text = response.error if response.error else response.tensors[0].value[0].decode()
        with self.cond:
            self.sent.append((text, flags))
            self.cond.notify_all()

    def is_cancelled(self) -> bool:
        return False

    def wait_for(self, text: str, timeout_s: float = 30) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: "".join(t for t, _ in self.sent) == text, timeout=timeout_s)


def chunk(text: str, count: int, final: bool = False) -> Chunk:
    return Chunk([text], ["length" if final else ""], 3, [count], final)


def make_io(window_s: float, metrics: ServingMetrics | None = None, exporter: Any = None,
            fresh: bool = True) -> Any:
    from llmhost.backend.model import _MetricsPush, _TritonIO

    push = _MetricsPush(metrics or ServingMetrics(), exporter, on_final=fresh)
    return _TritonIO(runner=None, push=push, interval_s=0.25,  # type: ignore[arg-type]
                     metrics_s=60.0, window_s=window_s, periodic=True, name="test-io")


def stream(io: Any) -> tuple[Any, Sender]:
    from llmhost.backend.model import _TritonSink

    sender = Sender()
    return _TritonSink(io, sender, frozenset()), sender


def stop(io: Any) -> None:
    io.put(None)
    io.thread.join(timeout=30)
    assert not io.thread.is_alive()


def test_deltas_arrive_by_the_tick_merged_and_in_order(fake_pb: None) -> None:
    io = make_io(window_s=0.05)
    sink, sender = stream(io)
    sink.send(chunk("a", 1))
    assert sender.wait_for("a")  # the first chunk wakes the thread
    for i, t in enumerate("bcdefgh", start=2):
        sink.send(chunk(t, i))
    # No final and no other urgent item: only the thread's tick can deliver them.
    assert sender.wait_for("abcdefgh"), sender.sent
    sink.send(chunk("!", 9, final=True))
    assert sender.wait_for("abcdefgh!"), sender.sent
    assert sender.sent[-1][1] == FINAL and all(f == 0 for _, f in sender.sent[:-1])
    # Seven deltas put back to back within one 50 ms window cannot each have been
    # a response of their own unless every put straddled a tick.
    assert len(sender.sent) < 9, sender.sent
    stop(io)


def test_without_a_window_every_chunk_is_its_own_response(fake_pb: None) -> None:
    io = make_io(window_s=0.0)
    sink, sender = stream(io)
    for i, t in enumerate("abcd", start=1):
        sink.send(chunk(t, i, final=t == "d"))
        assert sender.wait_for("abcd"[:i])  # one at a time: nothing can merge
    assert sender.sent == [("a", 0), ("b", 0), ("c", 0), ("d", FINAL)]
    stop(io)


def test_held_deltas_leave_before_an_error_and_on_shutdown(fake_pb: None) -> None:
    io = make_io(window_s=30.0)  # a tick that never comes during the test
    failing, f_sender = stream(io)
    open_, o_sender = stream(io)
    failing.send(chunk("x", 1))
    open_.send(chunk("p", 1))
    assert f_sender.wait_for("x") and o_sender.wait_for("p")
    failing.send(chunk("y", 2))
    open_.send(chunk("q", 2))
    failing.fail("engine error: boom")
    assert f_sender.wait_for("xyengine error: boom"), f_sender.sent
    assert f_sender.sent[-1] == ("engine error: boom", FINAL)
    time.sleep(0.2)
    assert o_sender.sent == [("p", 0)]  # still held: its window is 30 s
    stop(io)
    assert o_sender.sent == [("p", 0), ("q", 0)]  # shutdown sends what was held


class BlockingSender(Sender):
    """A Sender whose send of BLOCK_ON waits until released, logging every send to LOG."""

    def __init__(self, log: list[str], block_on: str | None = None) -> None:
        super().__init__()
        self.log, self.block_on = log, block_on
        self.blocked, self.release = threading.Event(), threading.Event()

    def send(self, response: _Response, flags: int = 0) -> None:
        text = response.tensors[0].value[0].decode()
        if text == self.block_on:
            self.blocked.set()
            assert self.release.wait(30)
        self.log.append(text)
        super().send(response, flags)


def test_a_first_chunk_goes_ahead_of_the_rest_of_a_tick_and_order_holds(fake_pb: None) -> None:
    from llmhost.backend.model import _TritonSink

    log: list[str] = []
    io = make_io(window_s=0.05)
    senders = [BlockingSender(log, block_on="a2"), BlockingSender(log)]
    a, b = (_TritonSink(io, s, frozenset()) for s in senders)
    a.send(chunk("a1", 1))
    b.send(chunk("b1", 1))
    assert senders[0].wait_for("a1") and senders[1].wait_for("b1")
    a.send(chunk("a2", 2))
    b.send(chunk("b2", 2))
    assert senders[0].blocked.wait(30)  # the tick is sending a2; b2 waits behind it
    c_sender = BlockingSender(log)
    c = _TritonSink(io, c_sender, frozenset())
    c.send(chunk("c1", 1))  # a new stream's first chunk
    b.send(chunk("b3", 3, final=True))
    senders[0].release.set()
    assert c_sender.wait_for("c1") and senders[1].wait_for("b1b2b3")
    # c1 and b's final (merged with the b2 it held back) went before the tick's rest.
    assert log.index("c1") < log.index("b2b3"), log
    assert senders[1].sent == [("b1", 0), ("b2b3", FINAL)]
    stop(io)


def test_an_idle_thread_without_the_exporter_sleeps(fake_pb: None) -> None:
    """Every I/O thread but the first has no metrics exporter; idle, it must wait
    for its next cancellation poll, not spin (it once did: response_threads > 1
    burnt a core while the server was idle)."""
    from llmhost.backend.model import _MetricsPush, _TritonIO

    push = _MetricsPush(ServingMetrics(), exporter=object())  # type: ignore[arg-type]
    io = _TritonIO(runner=None, push=push, interval_s=0.05,  # type: ignore[arg-type]
                   metrics_s=0.01, window_s=0.05, periodic=False, name="test-io-idle")
    passes = 0
    real = io._send_queued

    def counting(pb: Any, final: int) -> bool:
        nonlocal passes
        passes += 1
        return real(pb, final)

    io._send_queued = counting  # type: ignore[method-assign]
    time.sleep(1.0)
    stop(io)
    # About 20 passes (one per 0.05 s poll); a spinning loop makes hundreds of thousands.
    assert passes < 500, passes


def test_a_barrier_is_passed_only_after_what_was_queued_before_it(fake_pb: None) -> None:
    """wait_sent's barrier: errors queued before it have been sent when it is set."""
    io = make_io(window_s=0.05)
    sink, sender = stream(io)
    sink.send(chunk("a", 1))
    sink.fail("the model's engine stopped")
    event = threading.Event()
    io.put(("barrier", None, event), urgent=True)
    assert event.wait(30)
    assert [t for t, _ in sender.sent] == ["a", "the model's engine stopped"], sender.sent
    stop(io)


class GatedSender(Sender):
    """A sender whose first send blocks until the gate opens: tritonserver slow to take it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.blocked = threading.Event()

    def send(self, response: _Response, flags: int = 0) -> None:
        if not self.sent:
            self.blocked.set()
            assert self.gate.wait(30)
        super().send(response, flags)


def test_without_a_window_a_backlog_leaves_as_one_response_per_stream(fake_pb: None) -> None:
    # Per-step mode when the sender falls behind (vLLM's server does the same): all a
    # stream's waiting deltas merge into one response, however long the queue, so the
    # round trips per pass never exceed the open streams and the backlog cannot grow.
    from llmhost.backend.model import _TritonSink

    io = make_io(window_s=0.0)
    slow = GatedSender()
    first = _TritonSink(io, slow, frozenset())
    other, o_sender = stream(io)
    first.send(chunk("<", 1))
    assert slow.blocked.wait(30)  # the thread is stuck in its first round trip
    steps = 400  # two streams: 800 queued items, more than one take of the old 512
    for i in range(steps):
        first.send(chunk("a", i + 2))
        other.send(chunk("b", i + 1, final=i == steps - 1))
    slow.gate.set()
    assert slow.wait_for("<" + "a" * steps) and o_sender.wait_for("b" * steps)
    assert len(slow.sent) == 2 and o_sender.sent == [("b" * steps, FINAL)]
    stop(io)


def test_a_requests_own_window_groups_its_deltas_on_a_per_step_model(fake_pb: None) -> None:
    from llmhost.backend.model import _TritonSink

    io = make_io(window_s=0.0)  # the model sends every step...
    sender = Sender()
    sink = _TritonSink(io, sender, frozenset(), window_s=0.05)  # ... this request asked for 50 ms
    sink.send(chunk("a", 1))
    assert sender.wait_for("a")
    for i, t in enumerate("bcdefgh", start=2):
        sink.send(chunk(t, i))
    assert sender.wait_for("abcdefgh"), sender.sent  # delivered by the tick
    sink.send(chunk("!", 9, final=True))
    assert sender.wait_for("abcdefgh!") and sender.sent[-1][1] == FINAL
    assert len(sender.sent) < 9, sender.sent  # as in the test with the model's window above
    stop(io)


def test_a_response_carries_the_outputs_asked_for_with_vllm_backends_types(fake_pb: None) -> None:
    import numpy as np

    from llmhost.backend.model import _TritonIO, _TritonSink

    io = make_io(window_s=0.0)
    top = {"9": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}
    c = Chunk(["a", "b"], ["", "length"], 4, [0, 1], True, cumulative_logprobs=[None, -0.5], logprobs=[[], [top]])
    every = frozenset({"return_finish_reason", "return_cumulative_logprob", "return_logprobs",
                       "return_num_input_tokens", "return_num_output_tokens"})
    pb = sys.modules["triton_python_backend_utils"]
    resp = _TritonIO._response(pb, _TritonSink(io, Sender(), every), c)
    got = {t.name: t.value for t in resp.tensors}
    assert list(got) == ["text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                         "num_output_tokens"]
    assert got["finish_reason"].tolist() == [b"None", b"length"]
    assert got["cumulative_logprob"].dtype == np.float32 and np.isnan(got["cumulative_logprob"][0])
    assert got["cumulative_logprob"][1] == np.float32(-0.5)
    assert got["logprobs"].tolist() == [b"[]", b'[{"9": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}]']
    assert got["num_input_tokens"].dtype == np.uint32 and got["num_input_tokens"].tolist() == [4]
    assert got["num_output_tokens"].dtype == np.uint32 and got["num_output_tokens"].tolist() == [0, 1]
    only = _TritonIO._response(pb, _TritonSink(io, Sender(), frozenset({"return_logprobs"})), c)
    assert [t.name for t in only.tensors] == ["text_output", "logprobs"]
    stop(io)


def test_sparse_outputs_leave_out_what_says_nothing(fake_pb: None) -> None:
    """With sparse_outputs, finish_reason goes only where a completion has finished and
    num_input_tokens only in the first and the final response; the rest as asked."""
    from llmhost.backend.model import _TritonIO, _TritonSink

    io = make_io(window_s=0.0)
    pb = sys.modules["triton_python_backend_utils"]
    asked = frozenset({"return_finish_reason", "return_num_input_tokens", "return_num_output_tokens"})
    chunks = [Chunk(["a", "b"], ["", ""], 4, [1, 1], False), Chunk(["c", "d"], ["", ""], 4, [1, 1], False),
              Chunk(["e", ""], ["length", ""], 4, [1, 0], False), Chunk(["", "f"], ["length", "stop"], 4, [0, 1], True)]

    def names(flags: frozenset[str]) -> list[list[str]]:
        sink = _TritonSink(io, Sender(), flags)
        return [[t.name for t in _TritonIO._response(pb, sink, c).tensors] for c in chunks]

    every = ["text_output", "finish_reason", "num_input_tokens", "num_output_tokens"]
    assert names(asked) == [every] * 4  # vllm_backend's way: every output on every response
    assert names(asked | {"sparse_outputs"}) == [
        ["text_output", "num_input_tokens", "num_output_tokens"],
        ["text_output", "num_output_tokens"],
        ["text_output", "finish_reason", "num_output_tokens"],  # the first completion finished
        every,
    ]
    sparse = _TritonSink(io, Sender(), asked | {"sparse_outputs"})
    last = {t.name: t.value for t in _TritonIO._response(pb, sparse, chunks[-1]).tensors}
    assert last["finish_reason"].tolist() == [b"length", b"stop"] and last["num_input_tokens"].tolist() == [4]
    stop(io)


class _Exporter:
    """Records what reached Triton's metrics: the deltas applied, in order."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, str, str | None, float]] = []

    def apply(self, deltas: list[tuple[str, str, str | None, float]]) -> None:
        self.applied += deltas

    def total(self, series: str) -> float:
        return sum(a for k, s, _, a in self.applied if s == series and k == "inc")


class _SnapshotSender(Sender):
    """Notes, as each response is sent, how many generation tokens Triton had been told."""

    def __init__(self, exporter: _Exporter) -> None:
        super().__init__()
        self.exporter = exporter
        self.tokens_seen: list[float] = []

    def send(self, response: _Response, flags: int = 0) -> None:
        self.tokens_seen.append(self.exporter.total("vllm:generation_tokens_total"))
        super().send(response, flags)


def _first_step_counted(fresh: bool) -> tuple[Any, Any, _SnapshotSender, _Exporter]:
    """A stream's first response sent, then vLLM's statistics of 7 output tokens
    recorded (not pushed yet: the periodic push comes every 60 s here)."""
    from llmhost.backend.model import _TritonSink

    metrics, exporter = ServingMetrics(), _Exporter()
    io = make_io(window_s=0.0, metrics=metrics, exporter=exporter, fresh=fresh)
    sender = _SnapshotSender(exporter)
    sink = _TritonSink(io, sender, frozenset())
    sink.send(chunk("a", 1))
    assert sender.wait_for("a")
    metrics.record_iteration(prompt_tokens=5, generation_tokens=7, ttfts=[0.1], itls=[0.01], preempted=0,
                             finished=[], n_params=[2])
    return io, sink, sender, exporter


@pytest.mark.parametrize("ends_with_error", [False, True])
def test_metrics_reach_triton_before_the_final_response(fake_pb: None, ends_with_error: bool) -> None:
    """A client that reads /metrics right after its final response (or error) finds
    its tokens counted: the push happens before the send, not at the next interval
    (60 s here)."""
    io, sink, sender, exporter = _first_step_counted(fresh=True)
    if ends_with_error:
        sink.fail("boom")
        assert sender.wait_for("aboom")
    else:
        sink.send(chunk("b", 2, final=True))
        assert sender.wait_for("ab")
    stop(io)
    assert sender.tokens_seen[-1] == 7
    assert exporter.total("vllm:request_params_n_count") == 1


def test_without_fresh_metrics_a_final_response_does_not_push(fake_pb: None) -> None:
    """fresh_metrics false: the final response leaves without a push (the periodic
    push, 60 s here, has not come); stopping the I/O thread pushes what is left."""
    io, sink, sender, exporter = _first_step_counted(fresh=False)
    sink.send(chunk("b", 2, final=True))
    assert sender.wait_for("ab")
    assert sender.tokens_seen[-1] == 0
    stop(io)
    assert exporter.total("vllm:generation_tokens_total") == 7
