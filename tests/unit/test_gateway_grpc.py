"""Triton's gRPC API on the gateway (llmhost.gateway.doors.grpc): requests decoded into the HTTP
door's generate request, responses encoded as Triton's Python backend sends them,
and a real gRPC server over a fake upstream: keys, scopes, limits, streams with the
empty final response, records for metrics and the access log."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.doors.grpc import decode_request, encode_response, start
from llmhost.gateway.doors.triton_generate import _set_parameter
from llmhost.gateway.errors import ApiError
from llmhost.gateway.record import RequestRecord
from llmhost.gateway.upstreams.client import decode_outputs
from tests.harness.net import free_port
from tests.unit._gateway_fakes import KEY, Fake, keystore, make_app

AUTH = (("authorization", f"Bearer {KEY}"),)


def _bytes(*values: str) -> bytes:
    return b"".join(struct.pack("<I", len(v.encode())) + v.encode() for v in values)


def _request(model: str = "m", text: str | None = "hi", **params: Any) -> Any:
    msg = service_pb2.ModelInferRequest(model_name=model, id="r1")
    if text is not None:
        msg.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        msg.raw_input_contents.append(_bytes(text))
    msg.inputs.add(name="stream", datatype="BOOL", shape=[1])
    msg.raw_input_contents.append(b"\x01")
    for name, value in params.items():
        _set_parameter(msg, name, value)
    return msg


def test_a_request_becomes_the_generate_body_of_the_http_door():
    body, empty_final, named = decode_request(_request(max_tokens=8, temperature=0.5, stop='["x"]',
                                                       triton_enable_empty_final_response=True))
    assert body == {"text_input": "hi", "stream": True, "id": "r1",
                    "parameters": {"max_tokens": 8, "temperature": 0.5, "stop": '["x"]'}}
    assert empty_final is True and named == set()


def test_inputs_in_contents_instead_of_raw_contents():
    msg = service_pb2.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append("héllo".encode())
    b = msg.inputs.add(name="exclude_input_in_output", datatype="BOOL", shape=[1])
    b.contents.bool_contents.append(True)
    i = msg.inputs.add(name="image", datatype="BYTES", shape=[2])
    i.contents.bytes_contents.extend([b"aGk=", b"eW8="])
    msg.outputs.add(name="text_output")
    body, empty_final, named = decode_request(msg)
    assert body == {"text_input": "héllo", "exclude_input_in_output": True, "image": ["aGk=", "eW8="],
                    "parameters": {}}
    assert not empty_final and named == {"text_output"}


@pytest.mark.parametrize(("change", "field", "says"), [
    (lambda m: setattr(m.inputs[0], "datatype", "INT32"), "text_input", "must have datatype BYTES, got 'INT32'"),
    (lambda m: setattr(m.inputs[1], "datatype", "BYTES"), "stream", "must have datatype BOOL"),
    (lambda m: m.inputs[0].shape.__setitem__(0, 2), "text_input", "has 1 element(s) but its shape [2] says 2"),
    (lambda m: m.raw_input_contents.__setitem__(0, b"\x09\x00\x00\x00hi"), "text_input", "runs past"),
    (lambda m: m.raw_input_contents.__setitem__(0, b"\x02\x00"), "text_input", "inside an element's length"),
    (lambda m: m.raw_input_contents.__setitem__(0, _bytes("a", "b")), "text_input", "has 2 element(s)"),
    (lambda m: m.raw_input_contents.__setitem__(0, b"\x01\x00\x00\x00\xff"), "text_input", "must be UTF-8"),
    (lambda m: m.raw_input_contents.append(b""), "raw_input_contents", "3 entries for 2 inputs"),
    (lambda m: setattr(m.inputs[0], "name", "prompt"), "prompt", "is not an input of this model"),
    (lambda m: setattr(m.inputs[1], "name", "text_input"), "text_input", "is given twice"),
    (lambda m: m.parameters["triton_enable_empty_final_response"].MergeFrom(service_pb2.InferParameter(
        string_param="yes")), "triton_enable_empty_final_response", "must be a bool_param"),
])
def test_bad_input_is_refused_naming_the_field(change: Callable[[Any], None], field: str, says: str):
    msg = _request()
    change(msg)
    with pytest.raises(ApiError) as caught:
        decode_request(msg)
    assert caught.value.status == 400 and caught.value.param == field and says in caught.value.message
    assert f"'{field}'" in caught.value.message or field == "raw_input_contents"


def test_outputs_are_encoded_as_tritons_python_backend_sends_them():
    outputs = {"text_output": ["hé"], "finish_reason": ["length"], "num_output_tokens": [2],
               "num_input_tokens": [3], "cumulative_logprob": [-0.5], "logprobs": ["null"]}
    resp = encode_response("m", "1", "r1", outputs)
    assert (resp.model_name, resp.model_version, resp.id) == ("m", "1", "r1")
    types = {t.name: (t.datatype, list(t.shape)) for t in resp.outputs}
    assert types == {"text_output": ("BYTES", [1]), "finish_reason": ("BYTES", [1]),
                     "num_output_tokens": ("UINT32", [1]), "num_input_tokens": ("UINT32", [1]),
                     "cumulative_logprob": ("FP32", [1]), "logprobs": ("BYTES", [1])}
    assert resp.raw_output_contents[0] == b"\x03\x00\x00\x00h\xc3\xa9"
    assert decode_outputs(resp) == outputs


# --- a real gRPC server over a fake upstream -------------------------------------

Calls = Callable[[Any, list[RequestRecord]], Awaitable[None]]


def _serve(fake: Any, calls: Calls, keys: Any = None, models: tuple[str, ...] = ("m",)) -> list[RequestRecord]:
    """CALLS(stub, records) against the gRPC door of a gateway over FAKE."""
    config = GatewayConfig(upstreams=["up:1"], models=list(models), max_body_bytes=4096,
                           grpc_listen=("127.0.0.1", free_port()))
    records: list[RequestRecord] = []
    scopes: list[dict[str, Any]] = []

    def observe(rec: RequestRecord, scope: Any) -> None:
        records.append(rec)
        scopes.append(scope)

    async def go() -> None:
        app = make_app(fake, keys, config=config)
        server = await start(app.state.gateway, [*app.state.observers, observe], config)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{config.grpc_listen[1]}") as channel:
                await calls(service_pb2_grpc.GRPCInferenceServiceStub(channel), records)
        finally:
            await server.stop(None)

    asyncio.run(go())
    assert len(scopes) == len(records)
    assert all(str(scope["path"]).startswith("grpc:") for scope in scopes)
    return records


async def _stream(stub: Any, *msgs: Any, metadata: Any = AUTH) -> list[Any]:
    """Every response of MSGS sent on one stream, until each has its final response or error."""
    async def requests() -> AsyncIterator[Any]:
        for msg in msgs:
            yield msg

    call = stub.ModelStreamInfer(requests(), metadata=metadata)
    out, open_requests = [], len(msgs)
    async for resp in call:
        out.append(resp)
        final = resp.infer_response.parameters.get("triton_final_response")
        if resp.error_message or (final is not None and final.bool_param):
            open_requests -= 1
            if not open_requests:
                call.cancel()
                break
    return out


def test_a_stream_sends_each_response_then_the_empty_final_one():
    fake = Fake()

    async def calls(stub: Any, records: list[RequestRecord]) -> None:
        got = await _stream(stub, _request(max_tokens=4, triton_enable_empty_final_response=True))
        texts = [decode_outputs(r.infer_response).get("text_output") for r in got]
        assert texts == [["he"], ["llo"], None]
        assert [r.infer_response.parameters["triton_final_response"].bool_param for r in got] == [False, False, True]
        assert all(r.infer_response.id == "r1" and r.infer_response.model_name == "m" for r in got)
        # Token counts are asked of the backend always, returned only when asked for.
        assert "num_output_tokens" not in decode_outputs(got[0].infer_response)

    records = _serve(fake, calls)
    sent = fake.seen[0]
    assert sent.parameters["max_tokens"].int64_param == 4
    assert "stream" in {t.name for t in sent.inputs}
    (rec,) = records
    assert (rec.key, rec.model, rec.status, rec.output_tokens, rec.prompt_tokens) == ("alice", "m", 200, 2, 3)
    assert rec.ttft_s is not None and rec.event_tokens == [1, 1]


def test_requests_on_one_stream_run_side_by_side_and_errors_stay_theirs():
    fake = Fake()

    async def calls(stub: Any, records: list[RequestRecord]) -> None:
        bad = _request(text=None, triton_enable_empty_final_response=True)
        bad.inputs[0].datatype = "INT32"
        got = await _stream(stub, _request("other"), bad, _request(triton_enable_empty_final_response=True,
                                                                     return_num_output_tokens=True))
        errors = [r.error_message for r in got if r.error_message]
        assert len(errors) == 2
        assert any("input 'stream' must have datatype BOOL" in e for e in errors)
        assert any("unknown model: 'other'" in e for e in errors)
        answers = [decode_outputs(r.infer_response) for r in got if not r.error_message]
        assert [a.get("num_output_tokens") for a in answers] == [[1], [1], None]

    records = _serve(fake, calls)
    assert sorted(r.status for r in records) == [200, 400, 404]


def test_without_the_empty_final_response_none_is_sent():
    async def calls(stub: Any, records: list[RequestRecord]) -> None:
        async def requests() -> AsyncIterator[Any]:
            yield _request()

        got = [r async for r in stub.ModelStreamInfer(requests(), metadata=AUTH)]
        assert [decode_outputs(r.infer_response)["text_output"] for r in got] == [["he"], ["llo"]]

    _serve(Fake(), calls)


def test_model_infer_answers_once_with_the_whole_text_and_the_outputs_named():
    async def calls(stub: Any, records: list[RequestRecord]) -> None:
        msg = _request()
        msg.outputs.add(name="text_output")
        msg.outputs.add(name="num_output_tokens")
        resp = await stub.ModelInfer(msg, metadata=AUTH)
        assert decode_outputs(resp) == {"text_output": ["hello"], "num_output_tokens": [2]}
        assert "triton_final_response" not in resp.parameters

    (rec,) = _serve(Fake(), calls)
    assert rec.status == 200 and rec.output_tokens == 2


def _code(exc: BaseException) -> Any:
    assert isinstance(exc, grpc.aio.AioRpcError)
    return exc.code()


def test_no_key_or_a_wrong_one_is_unauthenticated_on_every_method():
    async def calls(stub: Any, records: list[RequestRecord]) -> None:
        for metadata in ((), (("authorization", "Bearer wrong-key-0123456789"),)):
            for call in (stub.ServerLive(service_pb2.ServerLiveRequest(), metadata=metadata),
                         stub.ModelInfer(_request(), metadata=metadata)):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert _code(caught.value) == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _stream(stub, _request(), metadata=metadata)
            assert _code(caught.value) == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in str(caught.value.details())

    records = _serve(Fake(), calls)
    assert [r.status for r in records] == [401] * 6


def test_scopes_limits_and_health_follow_the_key():
    keys = keystore(models=["m"], max_tokens=8)

    async def calls(stub: Any, records: list[RequestRecord]) -> None:
        assert (await stub.ServerLive(service_pb2.ServerLiveRequest(), metadata=AUTH)).live
        assert (await stub.ServerReady(service_pb2.ServerReadyRequest(), metadata=AUTH)).ready
        assert (await stub.ModelReady(service_pb2.ModelReadyRequest(name="m"), metadata=AUTH)).ready
        meta = await stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="m"), metadata=AUTH)
        assert meta.inputs[0].name == "text_input" and meta.outputs[0].datatype == "BYTES"
        config = (await stub.ModelConfig(service_pb2.ModelConfigRequest(name="m"), metadata=AUTH)).config
        assert (config.name, config.backend, config.model_transaction_policy.decoupled) == ("m", "vllm", True)
        inputs = [(t.name, t.data_type, list(t.dims)) for t in config.input]
        assert inputs == [("text_input", model_config_pb2.TYPE_STRING, [1])]
        assert config.output[0].name == "text_output"
        for call in (stub.ModelReady(service_pb2.ModelReadyRequest(name="n"), metadata=AUTH),
                     stub.ModelConfig(service_pb2.ModelConfigRequest(name="n"), metadata=AUTH),
                     stub.ModelInfer(_request("n"), metadata=AUTH)):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert _code(caught.value) == grpc.StatusCode.NOT_FOUND  # served, but not to this key
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ModelInfer(_request(max_tokens=9), metadata=AUTH)
        assert _code(caught.value) == grpc.StatusCode.INVALID_ARGUMENT
        assert "may ask for at most 8" in str(caught.value.details())
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), metadata=AUTH)
        assert _code(caught.value) == grpc.StatusCode.UNIMPLEMENTED

    fake = Fake(ready=("m", "n"))
    _serve(fake, calls, keys, models=("m", "n"))
    assert not fake.seen  # nothing refused reached the upstream


def test_a_key_over_its_concurrency_is_refused_with_resource_exhausted():
    fake = Fake()
    fake.gate = asyncio.Event()

    async def calls(stub: Any, records: list[RequestRecord]) -> None:
        first = asyncio.ensure_future(stub.ModelInfer(_request(), metadata=AUTH))
        while not fake.started:
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ModelInfer(_request(), metadata=AUTH)
        assert _code(caught.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert fake.gate is not None
        fake.gate.set()
        assert decode_outputs(await first)["text_output"] == ["hello"]

    records = _serve(fake, calls, keystore(max_concurrent=1))
    assert sorted(r.status for r in records) == [200, 429]
    assert [r.limited for r in records if r.status == 429] == ["max_concurrent"]


def test_a_backend_error_is_the_requests_error():
    async def calls(stub: Any, records: list[RequestRecord]) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ModelInfer(_request(), metadata=AUTH)
        assert _code(caught.value) == grpc.StatusCode.UNAVAILABLE
        got = await _stream(stub, _request())
        assert got[0].error_message

    _serve(Fake(fail="down"), calls)


def test_tls_with_the_gateways_certificate_and_a_renewed_one_for_new_connections(tmp_path: Any):
    from tests.harness.certs import self_signed

    cert, key = self_signed(tmp_path / "old")
    config = GatewayConfig(upstreams=["up:1"], models=["m"], grpc_listen=("127.0.0.1", free_port()),
                           tls_cert=cert, tls_key=key)
    address = f"127.0.0.1:{config.grpc_listen[1]}"

    async def live(trusted: bytes, timeout_s: float = 10) -> bool:
        async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(trusted)) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            return bool((await stub.ServerLive(service_pb2.ServerLiveRequest(), metadata=AUTH,
                                               timeout=timeout_s)).live)

    async def go() -> None:
        app = make_app(Fake(), config=config)
        server = await start(app.state.gateway, app.state.observers, config)
        try:
            old = cert.read_bytes()
            assert await live(old)
            with pytest.raises(grpc.aio.AioRpcError):  # plaintext is not served
                async with grpc.aio.insecure_channel(address) as channel:
                    await service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(
                        service_pb2.ServerLiveRequest(), metadata=AUTH, timeout=2)
            new_cert, new_key = self_signed(tmp_path / "new")
            key.write_bytes(new_key.read_bytes())  # a renewal: the key first, the certificate after
            cert.write_bytes(new_cert.read_bytes())
            assert await live(new_cert.read_bytes())
            with pytest.raises(grpc.aio.AioRpcError):  # the old certificate is no longer served
                await live(old, timeout_s=2)
        finally:
            await server.stop(None)

    asyncio.run(go())


class _Broken(Fake):
    """An upstream whose streams fail in a way the gateway does not expect."""

    async def native_stream(self, model: str, line: dict[str, Any], msg: Any
                            ) -> AsyncIterator[tuple[str, dict[str, list[Any]]]]:
        raise RuntimeError("a bug")
        yield "1", {}


def test_a_failure_of_the_gateways_own_ends_the_request_as_internal_and_the_stream_goes_on(
        capsys: pytest.CaptureFixture[str]):
    async def calls(stub: Any, records: list[RequestRecord]) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ModelInfer(_request(), metadata=AUTH)
        assert _code(caught.value) == grpc.StatusCode.INTERNAL
        assert caught.value.details() == "internal error: RuntimeError; the gateway log has the details"
        got = await _stream(stub, _request(), _request("other"))
        assert sorted(r.error_message.split(":")[0] for r in got) == ["Request for unknown model", "internal error"]

    records = _serve(_Broken(), calls)
    assert sorted(r.status for r in records) == [404, 500, 500]
    assert "gRPC ModelStreamInfer: internal error: RuntimeError: a bug" in capsys.readouterr().err


def test_sampling_parameters_nested_too_deep_for_the_gateway_are_the_backends_to_refuse():
    fake = Fake()
    deep = "[" * 1500 + "]" * 1500  # deeper than Python's recursion limit

    async def calls(stub: Any, records: list[RequestRecord]) -> None:
        msg = _request()
        msg.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
        msg.raw_input_contents.append(_bytes(deep))
        assert decode_outputs(await stub.ModelInfer(msg, metadata=AUTH))["text_output"] == ["hello"]

    _serve(fake, calls)
    assert len(fake.seen) == 1


def test_the_grpc_listener_is_off_by_default_and_plaintext_only_on_loopback():
    from llmhost.gateway.cli import build_parser, settings
    from llmhost.gateway.config import ConfigError, parse_config

    def config(*flags: str) -> GatewayConfig:
        return settings(build_parser().parse_args(["--keys-file", "/k", "--model", "m", *flags]))

    assert config().grpc_listen is None
    assert config("--grpc-listen", "127.0.0.1:18082").grpc_listen == ("127.0.0.1", 18082)
    assert parse_config('grpc_listen: "[::1]:9"') == {"grpc_listen": ("::1", 9)}
    with pytest.raises(ConfigError, match=r"--grpc-listen 0\.0\.0\.0:18082 without TLS"):
        config("--grpc-listen", "0.0.0.0:18082")
    assert config("--grpc-listen", "0.0.0.0:18082", "--allow-plaintext").grpc_listen == ("0.0.0.0", 18082)


def test_the_grpc_door_stops_when_the_api_server_begins_to_stop():
    from llmhost.gateway.cli import _stop_with

    class Door:
        grace: float | None = None

        async def stop(self, grace: float) -> None:
            self.grace = grace

    class Api:
        should_exit = False

    async def go() -> None:
        api, door = Api(), Door()
        stopping = asyncio.ensure_future(_stop_with(api, door, 7.0))
        await asyncio.sleep(0.3)
        assert door.grace is None  # serving while the API serves
        api.should_exit = True  # SIGTERM
        await asyncio.wait_for(stopping, 5)
        assert door.grace == 7.0

    asyncio.run(go())
