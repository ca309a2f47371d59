"""Fake upstreams and an in-process client for the gateway's unit tests."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

import httpx
from tritonclient.grpc import service_pb2

from llmhost.gateway.app import create_app
from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.keys import KeyStore, hash_key, parse_keys
from llmhost.gateway.upstreams.client import Piece, UpstreamDown, classify, decode_outputs
from llmhost.gateway.upstreams.request import BackendRequest

KEY = "unit-key-0123456789abcdef"


def keystore(**limits: Any) -> KeyStore:
    return KeyStore(parse_keys(json.dumps({"keys": [{"name": "alice", "sha256": hash_key(KEY), **limits}]})))


def chat(**kw: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def infer_response(final: bool = True, **outputs: list[Any]) -> Any:
    """A ModelInferResponse with BYTES (str values) or UINT32 (int values) outputs."""
    resp = service_pb2.ModelInferResponse(model_name="m", model_version="1")
    for name, values in outputs.items():
        out = resp.outputs.add()
        out.name = name
        if isinstance(values[0], str):
            out.datatype = "BYTES"
            resp.raw_output_contents.append(b"".join(struct.pack("<I", len(v.encode())) + v.encode()
                                                     for v in values))
        else:
            out.datatype = "UINT32"
            resp.raw_output_contents.append(struct.pack(f"<{len(values)}I", *values))
        out.shape.append(len(values))
    resp.parameters["triton_final_response"].bool_param = final
    return resp


class Fake:
    """An upstream: ready for `ready` models; `fail` makes calls fail ("down" or a
    backend message) before anything; `gate` holds calls until set."""

    def __init__(self, name: str = "up", ready: tuple[str, ...] = ("m",), fail: str | None = None,
                 reachable: bool = True) -> None:
        self.name = name
        self.ready = set(ready)
        self.fail = fail
        self.reachable = reachable
        self.calls = 0
        self.seen: list[Any] = []
        self.lines: list[dict[str, Any]] = []  # native requests as an engine socket gets them
        self.gate: asyncio.Event | None = None
        self.started = 0

    async def model_ready(self, model: str) -> bool:
        if not self.reachable:
            raise UpstreamDown(self.name)
        return model in self.ready

    async def model_metadata(self, model: str) -> dict[str, Any]:
        return {"name": model, "versions": ["1"], "platform": "python",
                "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
                "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]}

    async def _before(self) -> None:
        self.calls += 1
        self.started += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail == "down":
            raise UpstreamDown(self.name)
        if self.fail is not None:
            raise classify(self.fail)

    async def generate(self, req: BackendRequest) -> AsyncIterator[Piece]:
        self.seen.append(req)
        await self._before()
        # Output tokens per response (2 + 2), as the backend counts them.
        yield Piece([f"hello from {self.name}"], ["None"], 3, [2], False)
        yield Piece(["!"], ["length"], 3, [2], True)

    async def native_stream(self, model: str, line: dict[str, Any], msg: Any
                            ) -> AsyncIterator[tuple[str, dict[str, list[Any]]]]:
        """Triton's generate API over this fake's gRPC responses (upstream.Upstream's)."""
        self.lines.append(line)
        async for resp in self.infer_stream(msg):
            if outputs := decode_outputs(resp):
                yield resp.model_version, outputs

    async def infer_stream(self, msg: Any) -> AsyncIterator[Any]:
        self.seen.append(msg)
        await self._before()
        yield infer_response(False, text_output=["he"], num_input_tokens=[3], num_output_tokens=[1])
        yield infer_response(False, text_output=["llo"], finish_reason=["length"], num_input_tokens=[3],
                             num_output_tokens=[1])
        yield infer_response(True)


def client(app: Any, key: str | None = KEY) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False,
                                                           client=("10.1.2.3", 4567)),
                             base_url="http://gw", headers=headers)


def make_app(upstream: Any, keys: KeyStore | None = None, **kw: Any) -> Any:
    config = kw.pop("config", None) or GatewayConfig(upstreams=["up:1"], models=["m"], max_body_bytes=4096)
    return create_app(config, keys or keystore(), upstream, **kw)
