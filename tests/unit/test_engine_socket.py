"""The engine socket end to end without vLLM: a real EngineRunner (fake engine) serves
its socket on the engine's loop; the gateway's own Upstream streams from it. One line
per engine step; the backend's validation and errors, with their kinds; hanging up
cancels in the engine; the socket's and folder's modes; a live socket is not taken."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llmhost.backend.engine import EngineRunner
from llmhost.backend.metrics import RESPONSE_DELAY
from llmhost.backend.stream_socket import StreamSocketServer, socket_path
from llmhost.gateway.errors import ApiError
from llmhost.gateway.upstreams.client import Draining, Piece, Upstream, UpstreamDown
from llmhost.gateway.upstreams.request import BackendRequest
from tests.unit.test_engine_lifecycle import BOUND_S, FakeEngine, Log, fake_vllm, make_runner, start_in_thread

__all__ = ["fake_vllm"]  # the fixture, used by name

STEPS = ["Hel", "lo", ", wor", "ld"]


async def finishing_generate(self: FakeEngine, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
    """Four engine steps of one token each, the last finished."""
    for i, text in enumerate(STEPS):
        last = i == len(STEPS) - 1
        yield SimpleNamespace(outputs=[SimpleNamespace(index=0, text=text, token_ids=[i], cumulative_logprob=None,
                                                       finish_reason="length" if last else None, logprobs=None)],
                              finished=last)
        await asyncio.sleep(0.001)


class Served:
    def __init__(self, runner: EngineRunner, server: StreamSocketServer, log: Log, root: Path) -> None:
        self.runner, self.server, self.log, self.root = runner, server, log, root

    def upstream(self) -> Upstream:
        return Upstream("127.0.0.1:1", 0.5, self.root)


@pytest.fixture
def served(fake_vllm: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    runner, info, _, _, _ = make_runner()
    assert start_in_thread(runner) == [None]
    monkeypatch.setattr(runner, "_sampling_params", lambda j, *a: SimpleNamespace(n=1))
    server = StreamSocketServer(runner, runner.config.settings, socket_path(tmp_path, "tiny", "1", "tiny_0"), info)
    assert server.open()
    yield Served(runner, server, info, tmp_path)
    server.close()
    runner.stop(drain_timeout_s=1)


def request(stream: bool = True, **sampling: Any) -> BackendRequest:
    return BackendRequest(model="tiny", text_input="hello", messages=None, sampling={"max_tokens": 8, **sampling},
                          stream=stream, n=1, include_usage=False, chat=False)


async def collect(upstream: Upstream, req: BackendRequest) -> list[Piece]:
    return [piece async for piece in upstream.generate(req)]


def test_each_engine_step_is_one_piece_with_counts(served: Served, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(FakeEngine, "generate", finishing_generate)
    lines: list[tuple[str, int, float]] = []
    upstream = served.upstream()
    upstream.on_line = lambda model, tokens, transit: lines.append((model, tokens, transit))
    pieces = asyncio.run(collect(upstream, request()))
    assert [p.texts for p in pieces] == [[t] for t in STEPS]
    assert [p.num_output_tokens for p in pieces] == [[1]] * len(STEPS)
    assert [p.final for p in pieces] == [False, False, False, True]
    # Sparse outputs: the prompt's tokens in the first and the final response, the reason once.
    assert [p.num_input_tokens for p in pieces] == [len("hello"), None, None, len("hello")]
    assert pieces[-1].finish_reasons == ["length"] and not pieces[0].finish_reasons
    assert [(m, t) for m, t, _ in lines] == [("tiny", 1)] * len(STEPS)
    assert all(0 <= transit < BOUND_S for _, _, transit in lines)
    served.server._flush()
    assert served.runner.metrics._hists[RESPONSE_DELAY].n == len(STEPS)


def test_a_request_not_streamed_gets_one_final_piece(served: Served, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(FakeEngine, "generate", finishing_generate)
    pieces = asyncio.run(collect(served.upstream(), request(stream=False)))
    assert [(p.texts, p.final) for p in pieces] == [(["".join(STEPS)], True)]


def test_bad_input_is_a_400_naming_the_field(served: Served, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(served.runner, "_sampling_params", EngineRunner._sampling_params.__get__(served.runner))
    with pytest.raises(ApiError) as err:
        asyncio.run(collect(served.upstream(), request(temperature="hot")))
    assert err.value.status == 400 and "temperature" in err.value.message
    assert served.runner.metrics._counters[("vllm:request_failed_total", "invalid_request")] == 1


def test_a_line_that_is_not_a_request_gets_an_error_line(served: Served):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(BOUND_S)
    sock.connect(str(served.server.path))
    with sock, sock.makefile("rb") as answers:
        sock.sendall(b'{"inputs": {"text_input": "hi", "stream": "yes"}}\n')
        line = answers.readline()
    assert b'"kind":"invalid"' in line and b"stream" in line


def test_a_draining_model_is_unavailable_and_the_pool_may_retry(served: Served):
    served.runner.begin_drain(30, "test")
    with pytest.raises(Draining) as err:
        asyncio.run(collect(served.upstream(), request()))
    assert err.value.status == 503 and "shutting down" in err.value.message


def test_hanging_up_cancels_the_request_in_the_engine(served: Served):
    async def first_then_leave() -> Piece:
        stream = served.upstream().generate(request())
        piece = await anext(stream)
        await stream.aclose()
        return piece

    assert asyncio.run(first_then_leave()).texts == ["x"]  # the fake engine's one step, then it waits
    for _ in range(BOUND_S * 20):
        if not served.runner.active:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert not served.runner.active, "the request still runs in the engine after its client hung up"
    assert served.runner.metrics._counters[("vllm:request_cancelled_total", None)] == 1


def test_the_socket_is_the_groups_and_its_folders_closed_to_others(served: Served, tmp_path: Path):
    assert stat.S_IMODE(served.server.path.stat().st_mode) == 0o660
    assert stat.S_IMODE(served.server.path.parent.stat().st_mode) == 0o750
    assert served.server.path.name == "1-tiny_0.sock"
    # Under the unit's umask (0077) too: the folders the server makes let the group in.
    old = os.umask(0o077)
    try:
        path = socket_path(tmp_path / "run" / "engine", "tiny", "1", "tiny_1")
        (tmp_path / "run").mkdir()
        other = StreamSocketServer(served.runner, served.runner.config.settings, path, served.log)
        assert other.open()
    finally:
        os.umask(old)
    try:
        for p, mode in ((path, 0o660), (path.parent, 0o750), (path.parent.parent, 0o750)):
            assert stat.S_IMODE(p.stat().st_mode) == mode, p
    finally:
        other.close()


def test_a_live_socket_is_not_taken_and_a_stale_one_is(served: Served, tmp_path: Path):
    other = StreamSocketServer(served.runner, served.runner.config.settings, served.server.path, served.log)
    assert not other.open()
    assert "served by another process" in served.log.text()
    stale = tmp_path / "tiny" / "1-tiny_1.sock"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(stale))
    leftover.close()  # bound, never listening: what a killed process leaves
    again = StreamSocketServer(served.runner, served.runner.config.settings, stale, served.log)
    assert again.open()
    again.close()
    assert not stale.exists()


def test_without_a_socket_the_gateway_goes_over_grpc(tmp_path: Path):
    upstream = Upstream("127.0.0.1:1", 0.5, tmp_path)  # no socket there; nothing listens on port 1
    assert upstream.engine_socket("tiny") is None
    with pytest.raises(UpstreamDown):
        asyncio.run(collect(upstream, request()))
    assert Upstream("127.0.0.1:1", 0.5, tmp_path).engine_socket("../etc") is None
