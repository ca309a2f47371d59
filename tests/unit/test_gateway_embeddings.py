"""POST /v1/embeddings against stand-in upstreams: OpenAI's shape (floats or base64),
one upstream request per input, in order, with usage; bad bodies are 400s naming the
field; a model that answers without an embedding, and chat on an embedding model, are
400s."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest

from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.upstreams.client import Piece, build_request, socket_request
from llmhost.gateway.upstreams.request import BackendRequest
from tests.unit._gateway_fakes import Fake, chat, client, make_app


class Embedder(Fake):
    """An embedding model: the vector [length of the prompt, 0.5, -1]."""

    async def generate(self, req: BackendRequest) -> AsyncIterator[Piece]:
        self.seen.append(req)
        await self._before()
        size = len(req.text_input) if req.text_input is not None else len(req.prompt_token_ids or [])
        yield Piece([""], ["stop"], size + 1, [0], True, embedding=[float(size), 0.5, -1.0])


def _post(app: Any, body: Any) -> Any:
    async def run() -> Any:
        async with client(app) as c:
            return await c.post("/v1/embeddings", content=json.dumps(body).encode())

    return asyncio.run(run())


def test_texts_and_token_ids_get_their_embeddings_in_order_with_usage():
    fake = Embedder()
    r = _post(make_app(fake), {"model": "m", "input": ["ab", "abcd", "x"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "m"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["embedding"] for d in body["data"]] == [[2.0, 0.5, -1.0], [4.0, 0.5, -1.0], [1.0, 0.5, -1.0]]
    assert body["usage"] == {"prompt_tokens": 3 + 5 + 2, "total_tokens": 10}
    assert all(req.embed and req.sampling == {} and not req.stream for req in fake.seen)

    r = _post(make_app(Embedder()), {"model": "m", "input": [5, 6, 7]})
    assert r.json()["data"][0]["embedding"] == [3.0, 0.5, -1.0]
    r = _post(make_app(Embedder()), {"model": "m", "input": [[5], [6, 7]]})
    assert [d["embedding"][0] for d in r.json()["data"]] == [1.0, 2.0]


def test_base64_is_little_endian_float32():
    r = _post(make_app(Embedder()), {"model": "m", "input": "abc", "encoding_format": "base64"})
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert struct.unpack("<3f", raw) == (3.0, 0.5, -1.0)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m"}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": "  "}, "input"),
    ({"model": "m", "input": ["a", ""]}, "input[1]"),
    ({"model": "m", "input": [[1], []]}, "input[1]"),
    ({"model": "m", "input": [1.5]}, "input"),
    ({"model": "m", "input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"model": "m", "input": "a", "dimensions": 8}, "dimensions"),
    ({"model": "m", "input": "a", "truncate": True}, "truncate"),
    ({"model": "m", "input": ["a"] * 2049}, "input"),
])
def test_bad_bodies_are_400_naming_the_field(body, param):
    fake = Embedder()
    config = GatewayConfig(upstreams=["up:1"], models=["m"], max_body_bytes=1 << 20)
    r = _post(make_app(fake, config=config), body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert fake.calls == 0


def test_a_model_without_embeddings_and_an_unknown_model():
    r = _post(make_app(Fake()), {"model": "m", "input": "a"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "not_an_embedding_model", r.text
    r = _post(make_app(Embedder()), {"model": "other", "input": "a"})
    assert r.status_code == 404


def test_chat_on_an_embedding_model_is_a_400_naming_the_endpoint():
    async def run() -> list[Any]:
        async with client(make_app(Embedder())) as c:
            return [await c.post("/v1/chat/completions", content=chat(stream=stream)) for stream in (False, True)]

    for r in asyncio.run(run()):
        assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"], r.text


def test_the_backend_is_asked_for_the_embedding_on_both_paths():
    req = BackendRequest(model="m", text_input="a", messages=None, sampling={}, stream=False, n=1,
                         include_usage=False, chat=False, embed=True)
    assert json.loads(socket_request(req, "r1"))["parameters"]["embed"] is True
    assert build_request(req, "r1").parameters["embed"].bool_param is True
    req.embed = False
    assert "embed" not in json.loads(socket_request(req, "r1"))["parameters"]
    assert "embed" not in build_request(req, "r1").parameters
