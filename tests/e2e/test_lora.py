"""LoRA on a real server: adapters from multi_lora.json picked per request by
`lora_name`, the errors for an unknown adapter and for LoRA off, and a bad
multi_lora.json failing the load with a message naming it. Through the gateway
(over gRPC, as from another host) with the official openai client: each adapter a
model of its own, listed with its base model as parent and asked for by name, and
the keys' model scopes applied to adapters."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e._client import generate, grpc_stream, sampling, stream, texts
from tests.e2e._servers import LORA_ARGS
from tests.harness.gateway import KEY, start_gateway, stop_gateway
from tests.harness.net import CLIENT_TIMEOUT_S, free_port
from tests.harness.server import Server, start_server

PROMPT = "def parse(line):"
GREEDY = {"text_input": PROMPT, "max_tokens": 12, "temperature": 0, "exclude_input_in_output": True}


@pytest.fixture(scope="module")
def lora_server(tuned_server: Server) -> Server:
    """LoRA on, with adapters alpha and beta in its multi_lora.json: tests/e2e/conftest.py's
    tuned server (its stream window and prompt limit change no answer checked here)."""
    return tuned_server


def _text(server: Server, **extra: object) -> str:
    r = generate(server, **GREEDY, **extra)
    assert r["_status"] == 200, r
    return str(r["text_output"])


def test_adapter_changes_greedy_output(lora_server: Server):
    base = _text(lora_server)
    alpha = _text(lora_server, lora_name="alpha")
    beta = _text(lora_server, lora_name="beta")
    assert base and alpha and beta
    assert alpha != base, "the adapter made no difference: was it applied?"
    assert beta not in (base, alpha), "each name must pick its own adapter"
    # The same adapter again (now cached by vLLM under its id) answers the same.
    assert _text(lora_server, lora_name="alpha") == alpha
    assert _text(lora_server) == base


def test_adapter_applies_to_streams(lora_server: Server):
    alpha = _text(lora_server, lora_name="alpha")
    events = stream(lora_server, **GREEDY, lora_name="alpha")
    assert all("error" not in e for e in events), events
    assert "".join(e["text_output"] for e in events) == alpha
    base = "".join(e["text_output"] for e in stream(lora_server, **GREEDY))
    assert base != alpha


def test_lora_name_in_sampling_parameters_over_grpc(lora_server: Server):
    """vllm_backend's clients send lora_name inside the sampling_parameters input."""
    alpha = _text(lora_server, lora_name="alpha")
    params = sampling(max_tokens=12, temperature=0, lora_name="alpha")
    results, error = grpc_stream(lora_server, {"text_input": PROMPT, "sampling_parameters": params,
                                               "exclude_input_in_output": True, "stream": True})
    assert error is None, error
    assert "".join(texts(r)[0] for r in results) == alpha


@pytest.mark.parametrize(("name", "needle"), [
    # vllm_backend's sentence, then ours naming the parameter.
    ("gamma", "LoRA gamma is not supported, we currently support ['alpha', 'beta']; sampling parameter 'lora_name' "
              "must name an adapter of the model's multi_lora.json"),
    ("", "sampling parameter 'lora_name' must be an adapter's name"),
    (7, "sampling parameter 'lora_name' must be an adapter's name"),
])
def test_bad_adapter_name_is_400(lora_server: Server, name: object, needle: str):
    r = generate(lora_server, **GREEDY, lora_name=name)
    assert r["_status"] == 400, r
    assert needle in r["error"], r
    assert "Traceback" not in r["error"]
    assert lora_server.model_ready()


def test_lora_off_refuses_lora_name(server: Server):
    r = generate(server, **GREEDY, lora_name="alpha")
    assert r["_status"] == 400, r
    assert r["error"].startswith("LoRA feature is not enabled."), r
    assert "sampling parameter 'lora_name'" in r["error"] and "enable_lora" in r["error"], r
    ok = generate(server, **GREEDY)
    assert ok["_status"] == 200, ok


@pytest.mark.parametrize(("content", "needle"), [
    ('{"alpha": ', "multi_lora.json is not valid JSON"),
    ('{"alpha": "/nonexistent/adapter"}', "multi_lora.json, adapter 'alpha': /nonexistent/adapter is not a directory"),
    ('["alpha"]', "multi_lora.json must hold a JSON object mapping adapter names to adapter directories"),
])
def test_bad_multi_lora_json_fails_the_load(tiny_model: Path, tmp_path: Path, content: str, needle: str):
    multi = tmp_path / "multi_lora.json"
    multi.write_text(content)
    workdir = tmp_path / "serve"
    with pytest.raises(RuntimeError, match="llmhost serve exited with"):
        srv = start_server(tiny_model, workdir, extra=[*LORA_ARGS, "--max-restarts", "0", "--multi-lora", str(multi)])
        srv.stop()  # it served: stop it before the test fails
    log = "\n".join(p.read_text(errors="replace") for p in sorted(workdir.rglob("serve.log")))
    load_errors = [line for line in log.splitlines() if "failed to load 'tiny' version" in line]
    assert load_errors, log[-4000:]
    assert needle in load_errors[0], load_errors


# A key of the gateway's keys file scoped to the base model alone.
BASE_ONLY_KEY = "base-only-key-0123456789abcdef"


@pytest.fixture(scope="module")
def gateway_url(lora_server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The OpenAI base URL of a gateway in front of the LoRA server over gRPC only (the
    adapters' names reach it through Triton's API, as on another host), with KEY
    (every model) and BASE_ONLY_KEY (scoped to the base model)."""
    from llmhost.gateway.keys import hash_key

    work = tmp_path_factory.mktemp("lora-gateway")
    keys = work / "keys.json"
    keys.write_text(json.dumps({"keys": [
        {"name": "tester", "sha256": hash_key(KEY)},
        {"name": "base-only", "sha256": hash_key(BASE_ONLY_KEY), "models": [lora_server.name]}]}))
    port, log = free_port(), work / "gateway.log"
    url = f"http://127.0.0.1:{port}/v1"
    cmd = [str(Path(sys.executable).parent / "llmhost"), "gateway", "--upstream", lora_server.grpc,
           "--listen", f"127.0.0.1:{port}", "--keys-file", str(keys), "--model", lora_server.name,
           "--metrics-listen", f"127.0.0.1:{free_port()}"]
    proc = start_gateway(cmd, log, url)
    yield url
    stop_gateway(proc, log)


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S)


def test_openai_models_lists_adapters_with_their_base_model(lora_server: Server, gateway_url: str):
    models = {m.id: m for m in _client(gateway_url).models.list()}
    assert list(models) == [lora_server.name, "alpha", "beta"]
    for name in ("alpha", "beta"):
        assert models[name].model_extra == {"root": name, "parent": lora_server.name}
    assert _client(gateway_url).models.retrieve("beta").model_extra["parent"] == lora_server.name


def test_openai_adapter_as_model_answers_as_the_native_lora_name(lora_server: Server, gateway_url: str):
    client = _client(gateway_url)
    greedy = {"max_tokens": 12, "temperature": 0}
    alpha = client.completions.create(model="alpha", prompt=PROMPT, **greedy)
    assert alpha.model == "alpha"
    assert alpha.choices[0].text == _text(lora_server, lora_name="alpha")
    base = client.completions.create(model=lora_server.name, prompt=PROMPT, **greedy)
    assert base.choices[0].text == _text(lora_server) != alpha.choices[0].text
    beta = client.completions.create(model="beta", prompt=PROMPT, **greedy)
    assert beta.choices[0].text == _text(lora_server, lora_name="beta")

    messages = [{"role": "user", "content": PROMPT}]
    native = generate(lora_server, messages=json.dumps(messages), max_tokens=12, temperature=0, lora_name="alpha")
    assert native["_status"] == 200, native
    chat = client.chat.completions.create(model="alpha", messages=messages, **greedy)  # type: ignore[arg-type]
    assert chat.model == "alpha"
    assert chat.choices[0].message.content == native["text_output"]
    streamed = client.chat.completions.create(model="alpha", messages=messages, stream=True,  # type: ignore[arg-type]
                                              **greedy)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == native["text_output"]
    plain = client.chat.completions.create(model=lora_server.name, messages=messages, **greedy)  # type: ignore[arg-type]
    assert plain.choices[0].message.content != native["text_output"]


def test_openai_adapter_outside_a_keys_scope_or_unknown_is_404(lora_server: Server, gateway_url: str):
    scoped = _client(gateway_url, BASE_ONLY_KEY)
    assert [m.id for m in scoped.models.list()] == [lora_server.name]
    for client, name in ((scoped, "alpha"), (_client(gateway_url), "gamma")):
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model=name, prompt=PROMPT, max_tokens=2)
        assert err.value.code == "model_not_found"
        assert f"The model '{name}' does not exist" in err.value.message
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(name)
    with pytest.raises(openai.BadRequestError) as bad:
        _client(gateway_url).completions.create(model="alpha", prompt=PROMPT, max_tokens=2,
                                                extra_body={"lora_name": "beta"})
    assert bad.value.param == "lora_name"
    assert scoped.completions.create(model=lora_server.name, prompt=PROMPT, max_tokens=2).choices
