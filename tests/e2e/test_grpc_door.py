"""Triton's gRPC API on the gateway (--grpc-listen) for real: tritonclient.grpc (the
streaming client, the asyncio client and ModelInfer) through the gateway to
tritonserver + vLLM (tiny model, CPU) over the engine sockets, as `make demo` runs
it: the same text as the gateway's HTTP generate door, one response per engine
step, and the key, the model and bad input refused with gRPC's status codes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from tests.e2e._client import grpc_stream, more_than, sampling, shaped, texts
from tests.harness.gateway import KEY, Gateway, keyed_gateway, stop_gateway
from tests.harness.net import CLIENT_TIMEOUT_S, free_port
from tests.harness.server import Server

PROMPT = "def fibonacci(n):"
AUTH = {"authorization": f"Bearer {KEY}"}
GREEDY = {"max_tokens": 20, "ignore_eos": True, "temperature": 0}


@dataclass
class Door:
    gateway: Gateway
    grpc: str  # HOST:PORT of its gRPC door


@pytest.fixture(scope="module")
def door(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    address = f"127.0.0.1:{free_port()}"
    gateway = keyed_gateway(server, tmp_path_factory.mktemp("grpc-door"), "--grpc-listen", address,
                            "--engine-sockets", f"{server.grpc}={server.engine_sockets}")
    try:
        yield Door(gateway, address)
    finally:
        stop_gateway(gateway.proc, gateway.log)


def _http_text(door: Door, server: Server) -> str:
    """The greedy completion of PROMPT from the gateway's HTTP generate door."""
    base = door.gateway.url.removesuffix("/v1")
    r = httpx.post(f"{base}/v2/models/{server.name}/generate", headers=AUTH, timeout=CLIENT_TIMEOUT_S,
                   json={"text_input": PROMPT, "exclude_input_in_output": True, **GREEDY})
    assert r.status_code == 200, r.text
    return str(r.json()["text_output"])


def _text_input(value: Any = PROMPT, datatype: str = "BYTES") -> Any:
    t = grpcclient.InferInput("text_input", [1], datatype)
    t.set_data_from_numpy(np.array([value], dtype=np.object_ if datatype == "BYTES" else np.int32))
    return t


def _bool(name: str, value: bool) -> Any:
    t = grpcclient.InferInput(name, [1], "BOOL")
    t.set_data_from_numpy(np.array([value], dtype=np.bool_))
    return t


def test_streamed_text_matches_the_http_door_one_response_per_engine_step(door: Door, server: Server):
    full = _http_text(door, server)

    def take() -> list[Any]:
        results, error = grpc_stream(server, {"text_input": PROMPT, "stream": True, "exclude_input_in_output": True,
                                              "return_num_output_tokens": True},
                                     params=GREEDY, target=door.grpc, headers=AUTH)
        assert error is None, error
        assert "".join(texts(r)[0] for r in results) == full
        counts = [int(r.as_numpy("num_output_tokens")[0]) for r in results]
        assert sum(counts) == 20
        return counts

    def per_step(counts: list[int]) -> None:
        more_than(1)(counts)
        # An idle engine makes one token a step: a response each, a few at most merged.
        assert max(counts) <= 3, counts

    shaped(take, per_step)
    log = door.gateway.log.read_text()
    assert '"path":"grpc:ModelStreamInfer"' in log and '"key":"tester"' in log


def test_the_asyncio_client_streams_and_model_infer_answers_whole(door: Door, server: Server):
    full = _http_text(door, server)

    async def go() -> tuple[str, str]:
        async with aioclient.InferenceServerClient(door.grpc) as client:
            assert await client.is_server_live(headers=AUTH)
            assert await client.is_model_ready(server.name, headers=AUTH)
            meta = await client.get_model_metadata(server.name, headers=AUTH, as_json=True)
            assert "text_input" in [i["name"] for i in meta["inputs"]]
            config = await client.get_model_config(server.name, headers=AUTH, as_json=True)
            assert config["config"]["model_transaction_policy"]["decoupled"] is True

            async def requests() -> Any:
                yield {"model_name": server.name, "inputs": [_text_input(), _bool("stream", True),
                                                               _bool("exclude_input_in_output", True)],
                       "parameters": GREEDY, "enable_empty_final_response": True}

            streamed = ""
            async for result, error in client.stream_infer(requests(), headers=AUTH):
                assert error is None, error
                out = result.as_numpy("text_output")
                if out is not None:
                    streamed += out[0].decode()
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            whole = await client.infer(server.name, [_text_input(), _bool("exclude_input_in_output", True)],
                                       parameters=GREEDY, headers=AUTH)
            return streamed, whole.as_numpy("text_output")[0].decode()

    streamed, whole = asyncio.run(go())
    assert streamed == full and whole == full


def test_requests_shaped_as_vllm_backends_sample_client_are_answered_by_id(door: Door, server: Server):
    """NVIDIA vllm_backend's sample client (samples/client.py) sends its prompts as
    requests of one stream_infer call, each with a request_id, `text_input`, `stream`,
    the sampling parameters as a JSON `sampling_parameters` tensor and again as request
    parameters (string values, "0.1", "100"), and asks for `text_output`; it files each
    response under its id. Both of its modes (streamed and not), with the key added."""
    full = _http_text(door, server)
    prompts = [PROMPT, "def main():", "import os"]
    sampling = {"temperature": "0", "max_tokens": str(GREEDY["max_tokens"]), "ignore_eos": "true"}

    def request(prompt: str, request_id: str, stream: bool) -> dict[str, Any]:
        inputs = [_text_input(prompt), _bool("stream", stream), _bool("exclude_input_in_output", True)]
        params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        params.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
        inputs.append(params)
        return {"model_name": server.name, "inputs": inputs, "request_id": request_id,
                "outputs": [grpcclient.InferRequestedOutput("text_output")], "parameters": sampling}

    async def run(stream: bool) -> tuple[dict[str, list[str]], int]:
        results: dict[str, list[str]] = {}
        errors = 0

        async def requests() -> Any:
            for i, prompt in enumerate(prompts):
                results[str(i)] = []
                yield request(prompt, str(i), stream)

        async with aioclient.InferenceServerClient(door.grpc) as client:
            async for result, error in client.stream_infer(requests(), headers=AUTH, stream_timeout=120):
                if error is not None:
                    errors += 1
                    continue
                out = result.as_numpy("text_output")
                if out is not None:  # the stream ends once every request is answered, as the sample reads it
                    results[result.get_response().id].extend(x.decode() for x in out)
        return results, errors

    whole, errors = asyncio.run(run(False))
    assert errors == 0 and sorted(whole) == ["0", "1", "2"], whole
    assert all(len(v) == 1 for v in whole.values()), whole  # one response a request when not streamed
    assert whole["0"] == [full], whole
    streamed, errors = asyncio.run(run(True))
    assert errors == 0 and "".join(streamed["0"]) == full, streamed
    assert all(len(streamed[k]) > 1 for k in streamed), streamed  # one response per engine step


def _refused(door: Door, server: Server, inputs: list[Any], model: str | None = None,
             headers: dict[str, str] | None = AUTH) -> InferenceServerException:
    client = grpcclient.InferenceServerClient(door.grpc)
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.infer(model or server.name, inputs, parameters={"max_tokens": 4}, headers=headers)
        return caught.value
    finally:
        client.close()


def test_refusals_carry_grpc_status_codes_and_name_the_problem(door: Door, server: Server):
    no_key = _refused(door, server, [_text_input()], headers=None)
    assert no_key.status() == "StatusCode.UNAUTHENTICATED" and "API key" in no_key.message()
    client = grpcclient.InferenceServerClient(door.grpc)
    with pytest.raises(InferenceServerException) as caught:
        client.is_server_live()
    assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
    client.close()
    # A stream without a key fails as a whole, maybe before its first request is sent.
    errors: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(door.grpc)
    client.start_stream(callback=lambda result, error: errors.put(error))
    with contextlib.suppress(InferenceServerException):
        client.async_stream_infer(server.name, [_text_input()])
    error = errors.get(timeout=CLIENT_TIMEOUT_S)
    client.stop_stream()
    client.close()
    assert error is not None and error.status() == "StatusCode.UNAUTHENTICATED"

    missing = _refused(door, server, [], model="no-such-model")
    assert missing.status() == "StatusCode.NOT_FOUND" and "no-such-model" in missing.message()
    no_text = _refused(door, server, [_bool("stream", False)])
    assert no_text.status() == "StatusCode.INVALID_ARGUMENT", no_text
    wrong_type = _refused(door, server, [_text_input(7, "INT32")])
    assert wrong_type.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'text_input' must have datatype BYTES, got 'INT32'" in wrong_type.message()
    # Refused by the gateway (a request parameter that is no integer) and by the backend.
    bad_sampling = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    bad_sampling.set_data_from_numpy(np.array([sampling(max_tokens="many")], dtype=np.object_))
    client = grpcclient.InferenceServerClient(door.grpc)
    with pytest.raises(InferenceServerException) as caught:
        client.infer(server.name, [_text_input(), bad_sampling], headers=AUTH)
    client.close()
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "'max_tokens' must be an integer" in str(caught.value.message())
    bad_sampling.set_data_from_numpy(np.array([b"[1, 2]"], dtype=np.object_))
    bad = _refused(door, server, [_text_input(), bad_sampling])
    assert bad.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'sampling_parameters' must be a JSON object" in bad.message()
    assert "Traceback" not in door.gateway.log.read_text()
