"""LoRA adapters as models of their own through the gateway's OpenAI door: read from
each ready model's Triton configuration (parameter lora_adapters), listed in
/v1/models with their base model as parent, a request naming one sent to its base
model with the backend's lora_name, and the keys' model scopes applied to them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from tritonclient.grpc import service_pb2

from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.keys import KeyStore, hash_key, parse_keys
from llmhost.gateway.routing.pool import UpstreamPool, published_adapters
from tests.unit._gateway_fakes import KEY, Fake, chat, client, make_app

SCOPED = "scoped-key-0123456789abcdef"


def config_response(adapters: Any = None, raw: str | None = None) -> Any:
    """A ModelConfigResponse publishing ADAPTERS (a list, as JSON) or RAW as lora_adapters."""
    resp = service_pb2.ModelConfigResponse(config={"name": "m", "backend": "vllm"})
    if adapters is not None or raw is not None:
        resp.config.parameters["lora_adapters"].string_value = raw if raw is not None else json.dumps(adapters)
    return resp


class LoraFake(Fake):
    """An upstream whose models publish ADAPTERS (model -> names) in their configuration."""

    def __init__(self, adapters: dict[str, list[str]], **kw: Any) -> None:
        super().__init__(**kw)
        self.adapters = adapters
        self.config_fails = False

    async def model_config(self, model: str) -> Any:
        if self.config_fails:
            raise OSError("unreachable")
        return config_response(self.adapters.get(model))


def _keys(scope: list[str]) -> KeyStore:
    return KeyStore(parse_keys(json.dumps({"keys": [{"name": "all", "sha256": hash_key(KEY)},
                                                     {"name": "some", "sha256": hash_key(SCOPED),
                                                      "models": scope}]})))


def _app(fake: Fake, scope: list[str] | None = None, models: tuple[str, ...] = ("m",)) -> Any:
    config = GatewayConfig(upstreams=["up:1"], models=list(models), max_body_bytes=4096)
    return make_app(fake, _keys(scope or ["m"]), config=config)


@pytest.mark.parametrize(("published", "names"), [
    (config_response(["alpha", "beta"]), ("alpha", "beta")),
    (config_response(), ()),
    (config_response(raw="not json"), ()),
    (config_response(raw='{"alpha": "/x"}'), ()),
    (config_response(raw='["alpha", 3]'), ()),
    (config_response(raw='["alpha", ""]'), ()),
])
def test_published_adapters_are_a_json_list_of_names(published: Any, names: tuple[str, ...]):
    assert published_adapters(published) == names


def test_models_lists_adapters_with_their_parent():
    fake = LoraFake({"m": ["alpha", "beta"]})

    async def run() -> None:
        async with client(_app(fake)) as c:
            data = (await c.get("/v1/models")).json()["data"]
            assert data == [
                {"id": "m", "object": "model", "created": 0, "owned_by": "llmhost"},
                {"id": "alpha", "object": "model", "created": 0, "owned_by": "llmhost", "root": "alpha",
                 "parent": "m"},
                {"id": "beta", "object": "model", "created": 0, "owned_by": "llmhost", "root": "beta",
                 "parent": "m"},
            ]
            r = await c.get("/v1/models/beta")
            assert r.status_code == 200 and r.json()["parent"] == "m", r.text
            r = await c.get("/v1/models/m")
            assert r.status_code == 200 and "parent" not in r.json()
            r = await c.get("/v1/models/gamma")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

    asyncio.run(run())


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_an_adapter_as_model_goes_to_its_base_model_with_lora_name(path: str):
    fake = LoraFake({"m": ["alpha"]})
    body = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
            "/v1/completions": {"prompt": "hi"}, "/v1/responses": {"input": "hi"}}[path]

    async def run() -> None:
        async with client(_app(fake)) as c:
            r = await c.post(path, json={"model": "alpha", **body})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "alpha"  # the answer names the model asked, as vLLM's server does
            r = await c.post(path, json={"model": "m", **body})
            assert r.status_code == 200, r.text
        asked, plain = fake.seen
        assert (asked.model, asked.sampling.get("lora_name")) == ("m", "alpha")
        assert (plain.model, plain.sampling.get("lora_name")) == ("m", None)

    asyncio.run(run())


def test_unknown_adapter_and_lora_name_field_are_refused():
    fake = LoraFake({"m": ["alpha"]})

    async def run() -> None:
        async with client(_app(fake)) as c:
            r = await c.post("/v1/chat/completions", content=chat(model="gamma"))
            assert r.status_code == 404, r.text
            assert r.json()["error"]["message"] == "The model 'gamma' does not exist or is not served here"
            for model in ("alpha", "m"):
                r = await c.post("/v1/chat/completions", content=chat(model=model, lora_name="alpha"))
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "lora_name"
                assert "name the LoRA adapter as the model" in r.json()["error"]["message"]
        assert fake.seen == []

    asyncio.run(run())


@pytest.mark.parametrize(("scope", "listed", "usable"), [
    # A key scoped to the base model alone does not reach its adapters.
    (["m"], ["m"], ["m"]),
    # An adapter is reached by its own name in the scope, without its base model.
    (["alpha"], ["alpha"], ["alpha"]),
    (["m", "beta"], ["m", "beta"], ["m", "beta"]),
])
def test_key_scopes_name_adapters_themselves(scope: list[str], listed: list[str], usable: list[str]):
    fake = LoraFake({"m": ["alpha", "beta"]})

    async def run() -> None:
        async with client(_app(fake, scope), SCOPED) as c:
            assert [d["id"] for d in (await c.get("/v1/models")).json()["data"]] == listed
            for name in ("m", "alpha", "beta"):
                chat_status = (await c.post("/v1/chat/completions", content=chat(model=name))).status_code
                model_status = (await c.get(f"/v1/models/{name}")).status_code
                expected = 200 if name in usable else 404
                assert (chat_status, model_status) == (expected, expected), name
        async with client(_app(fake, scope)) as c:  # the unscoped key reaches everything
            assert [d["id"] for d in (await c.get("/v1/models")).json()["data"]] == ["m", "alpha", "beta"]

    asyncio.run(run())


def test_a_served_model_name_is_never_an_adapter():
    fake = LoraFake({"m": ["other"], "other": []}, ready=("m", "other"))

    async def run() -> None:
        async with client(_app(fake, models=("m", "other"))) as c:
            assert [d["id"] for d in (await c.get("/v1/models")).json()["data"]] == ["m", "other"]
            r = await c.post("/v1/chat/completions", content=chat(model="other"))
            assert r.status_code == 200
        assert fake.seen[0].model == "other" and "lora_name" not in fake.seen[0].sampling

    asyncio.run(run())


def test_adapters_follow_the_upstreams_and_survive_a_failed_read():
    one = LoraFake({"m": ["alpha"]}, name="one")
    two = LoraFake({"m": ["beta"]}, name="two")
    pool = UpstreamPool([("one:1", one), ("two:1", two)], ["m"])

    async def run() -> None:
        await pool.check()
        assert pool.adapters("m") == ["alpha", "beta"]
        assert await pool.adapter_base("beta") == "m" and await pool.adapter_base("gamma") is None
        assert await pool.adapter_base("m") is None
        # A configuration that cannot be read keeps the names last read.
        two.config_fails = True
        await pool.check()
        assert pool.adapters("m") == ["alpha", "beta"]
        # A model reloaded without adapters publishes none.
        two.config_fails, two.adapters = False, {}
        await pool.check()
        assert pool.adapters("m") == ["alpha"]
        # Not ready anywhere: nothing listed, but the name still leads to its base model
        # (whose requests then get the pool's 503, not a 404).
        one.ready = set()
        await pool.check()
        assert pool.adapters("m") == [] and await pool.adapter_base("alpha") == "m"

    asyncio.run(run())


def test_the_grpc_upstream_reads_adapters_from_the_model_configuration():
    from llmhost.gateway.upstreams.client import Upstream

    class Stub:  # Triton's gRPC service, as the generated stub names its calls
        async def ModelReady(self, request: Any, timeout: float) -> Any:
            return service_pb2.ModelReadyResponse(ready=True)

        async def ModelConfig(self, request: Any, timeout: float) -> Any:
            return config_response(["alpha"] if request.name == "m" else None)

    upstream = Upstream("up:1")
    upstream._stub = Stub()
    pool = UpstreamPool([("up:1", upstream)], ["m", "n"])

    async def run() -> None:
        await pool.check()
        assert pool.adapters("m") == ["alpha"] and pool.adapters("n") == []

    asyncio.run(run())


def test_an_adapter_tokenizes_as_its_base_model():
    fake = LoraFake({"m": ["alpha"]})

    async def run() -> None:
        async with client(_app(fake)) as c:
            r = await c.post("/detokenize", json={"model": "alpha", "tokens": [1, 2]})
            assert r.status_code == 200, r.text
            r = await c.post("/detokenize", json={"model": "gamma", "tokens": [1, 2]})
            assert r.status_code == 404, r.text
        (asked,) = fake.seen
        assert asked.model == "m" and "lora_name" not in asked.sampling

    asyncio.run(run())
