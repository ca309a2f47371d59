"""How the gateway ends its gRPC stream to Triton (llmhost.gateway.upstreams.client): a
request that finished is half-closed and the call left to end (cancelling it leaked
the model in Triton 2.51, tests/e2e/test_shutdown.py), one still running is cancelled."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tritonclient.grpc import service_pb2

from llmhost.gateway.errors import ApiError
from llmhost.gateway.upstreams import client as upstream
from llmhost.gateway.upstreams.client import Upstream
from llmhost.gateway.upstreams.request import BackendRequest


def _response(text: bytes = b"", final: bool = False, error: str = "") -> Any:
    resp = service_pb2.ModelStreamInferResponse(error_message=error)
    if final:
        resp.infer_response.parameters["triton_final_response"].bool_param = True
    if text:
        out = resp.infer_response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        del out  # the raw contents carry the value
        resp.infer_response.raw_output_contents.append(len(text).to_bytes(4, "little") + text)
    return resp


class _Call:
    """A ModelStreamInfer call: sends RESPONSES, then ends once the client has
    half-closed (its request iterator is exhausted), unless told to hang."""

    def __init__(self, requests: AsyncIterator[Any], responses: list[Any], end_after_half_close: bool = True,
                 hang: bool = False) -> None:
        self.requests = requests
        self.responses = responses
        self.end_after_half_close = end_after_half_close
        self.hang = hang
        self.cancelled = False
        self.half_closed = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for _ in self.requests:
            pass
        self.half_closed.set()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Any]:
        for r in self.responses:
            yield r
        if self.hang:
            await asyncio.Event().wait()

    async def code(self) -> Any:
        await self.half_closed.wait()
        if not self.end_after_half_close:
            await asyncio.Event().wait()
        return "OK"

    def cancel(self) -> bool:
        self.cancelled = True
        self._reader.cancel()
        return True


class _Stub:
    def __init__(self, **call_args: Any) -> None:
        self.call_args = call_args
        self.calls: list[_Call] = []

    def ModelStreamInfer(self, requests: AsyncIterator[Any]) -> _Call:
        call = _Call(requests, **self.call_args)
        self.calls.append(call)
        return call


REQ = BackendRequest(model="m", text_input="hi", messages=None, sampling={"max_tokens": 4}, stream=True, n=1,
                     include_usage=False, chat=False)


def _upstream(stub: _Stub) -> Upstream:
    u = Upstream("127.0.0.1:1")
    u._stub = stub
    return u


def test_a_finished_request_half_closes_and_is_not_cancelled():
    stub = _Stub(responses=[_response(b"a"), _response(b"b", final=True)])

    async def run() -> list[str]:
        return [p.texts[0] async for p in _upstream(stub).generate(REQ)]

    assert asyncio.run(run()) == ["a", "b"]
    call = stub.calls[0]
    assert call.half_closed.is_set() and not call.cancelled


def test_an_error_response_ends_the_request_without_a_cancel():
    stub = _Stub(responses=[_response(error="the model is shutting down; retry on another instance")])

    async def run() -> None:
        async for _ in _upstream(stub).generate(REQ):
            pass

    with pytest.raises(ApiError) as err:
        asyncio.run(run())
    assert err.value.status == 503
    assert stub.calls[0].half_closed.is_set() and not stub.calls[0].cancelled


def test_a_request_left_early_is_cancelled():
    stub = _Stub(responses=[_response(b"a")], hang=True)

    async def run() -> None:
        async with contextlib.aclosing(_upstream(stub).generate(REQ)) as pieces:
            async for _ in pieces:
                break  # the client went away after the first piece

    asyncio.run(run())
    assert stub.calls[0].cancelled


def test_a_finished_call_the_server_does_not_end_is_cancelled_after_the_timeout(monkeypatch):
    monkeypatch.setattr(upstream, "_CLOSE_TIMEOUT_S", 0.2)
    stub = _Stub(responses=[_response(b"a", final=True)], end_after_half_close=False)

    async def run() -> list[str]:
        return [p.texts[0] async for p in _upstream(stub).generate(REQ)]

    assert asyncio.run(run()) == ["a"]
    assert stub.calls[0].half_closed.is_set() and stub.calls[0].cancelled
