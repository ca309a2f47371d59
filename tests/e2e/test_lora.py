"""LoRA on a real server: adapters from multi_lora.json picked per request by
`lora_name`, the errors for an unknown adapter and for LoRA off, and a bad
multi_lora.json failing the load with a message naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e._client import generate, grpc_stream, sampling, stream, texts
from tests.e2e._servers import LORA_ARGS
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
