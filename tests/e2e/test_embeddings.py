"""Embeddings for real: the tiny model served as an embedding model (vLLM's pooling
runner: engine_args runner pooling, convert embed) by our backend on tritonserver,
behind the gateway (over the engine socket and over gRPC), against `vllm serve
--runner pooling --convert embed` on the same model, through the official `openai`
client (which asks for base64)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.harness.gateway import KEY, keyed_gateway, stop_gateway
from tests.harness.net import CLIENT_TIMEOUT_S
from tests.harness.server import Server, start_server, wait_gone
from tests.harness.vllm_server import vllm_server

TEXTS = ["def fibonacci(n):", "hello world, this is a longer sentence to embed"]
POOLING = ["--engine-arg", "runner=pooling", "--engine-arg", "convert=embed"]
TOLERANCE = 1e-2  # bfloat16 on both sides


@pytest.fixture(scope="module")
def embedder(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tiny_model, tmp_path_factory.mktemp("serve-embed"), name="embed", extra=POOLING)
    yield srv
    kids = srv.descendants()
    srv.stop()
    assert not wait_gone(kids), "processes left after SIGTERM"


@pytest.fixture(scope="module")
def clients(embedder: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, openai.OpenAI]]:
    socket = keyed_gateway(embedder, tmp_path_factory.mktemp("embed-gateway-socket"),
                           "--engine-sockets", f"{embedder.grpc}={embedder.engine_sockets}")
    grpc = keyed_gateway(embedder, tmp_path_factory.mktemp("embed-gateway-grpc"))
    try:
        yield {name: openai.OpenAI(base_url=g.url, api_key=KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S)
               for name, g in (("socket", socket), ("grpc", grpc))}
    finally:
        stop_gateway(socket.proc, socket.log)
        stop_gateway(grpc.proc, grpc.log)


@pytest.fixture(scope="module")
def theirs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    args = ["--max-model-len", "512", "--enforce-eager", "--dtype", "bfloat16", "--runner", "pooling",
            "--convert", "embed"]
    with vllm_server(tiny_model, tmp_path_factory.mktemp("vllm-serve-embed"), "embed", args) as vllm:
        yield openai.OpenAI(base_url=vllm.url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= TOLERANCE for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("path", ["socket", "grpc"])
def test_embeddings_match_vllm_serve(clients, theirs, path):
    mine = clients[path].embeddings.create(model="embed", input=TEXTS)
    vllms = theirs.embeddings.create(model="embed", input=TEXTS)
    assert [d.index for d in mine.data] == [0, 1]
    assert len(mine.data[0].embedding) == len(vllms.data[0].embedding) > 0
    for a, b in zip(mine.data, vllms.data, strict=True):
        assert _close(a.embedding, b.embedding), (a.embedding[:4], b.embedding[:4])
        assert math.isclose(math.fsum(x * x for x in a.embedding), 1.0, rel_tol=1e-2)  # normalized, as vLLM's
    assert mine.usage.prompt_tokens == vllms.usage.prompt_tokens > 0
    ids = clients[path].embeddings.create(model="embed", input=[[1, 2, 3, 4]], encoding_format="float")
    assert _close(ids.data[0].embedding, theirs.embeddings.create(model="embed", input=[[1, 2, 3, 4]],
                                                                   encoding_format="float").data[0].embedding)
    assert ids.usage.prompt_tokens == 4


def test_chat_on_an_embedding_model_is_a_400(clients):
    with pytest.raises(openai.BadRequestError, match="/v1/embeddings"):
        clients["socket"].chat.completions.create(model="embed", messages=[{"role": "user", "content": "hi"}])


def test_tritons_native_generate_answers_with_the_embedding(embedder: Server):
    r = httpx.post(f"{embedder.http}/v2/models/embed/generate", json={"text_input": TEXTS[0]}, timeout=60)
    assert r.status_code == 200, r.text
    vector = r.json()["embedding"]
    assert isinstance(vector, list) and len(vector) > 1 and all(isinstance(v, float) for v in vector)


def test_a_model_that_generates_text_refuses_embeddings(server, tmp_path):
    gateway = keyed_gateway(server, tmp_path)
    try:
        client = openai.OpenAI(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S)
        with pytest.raises(openai.BadRequestError, match="generates text and has no embeddings"):
            client.embeddings.create(model=server.name, input="hello")
    finally:
        stop_gateway(gateway.proc, gateway.log)
