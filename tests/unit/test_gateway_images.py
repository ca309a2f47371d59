"""Image parts of chat messages in the gateway: data URLs to the backend's `image`
input in order (engine socket and gRPC), http(s) URLs refused by name unless the
operator allows them, and every malformed part a 400 naming it."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest

from llmhost.gateway.doors.openai.images import fetch_images
from llmhost.gateway.doors.openai.mapping import parse_body, to_backend
from llmhost.gateway.errors import ApiError
from llmhost.gateway.upstreams.client import build_request, socket_request
from llmhost.gateway.upstreams.request import RemoteImage
from tests.harness.webfiles import serve_files

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n pretend pixels").decode()


def _chat(*parts: dict[str, Any], **more: Any) -> bytes:
    return json.dumps({"model": "vision", "messages": [{"role": "user", "content": list(parts)}], **more}).encode()


def _image(url: str, **more: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **more}}


def _error(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        to_backend(parse_body(raw, chat=True))
    assert info.value.status == 400
    return info.value


def test_data_urls_go_to_the_image_input_in_order():
    other = base64.b64encode(b"GIF89a more pixels").decode()
    req = to_backend(parse_body(_chat({"type": "text", "text": "what is "}, _image(f"data:image/png;base64,{PNG}"),
                                      {"type": "text", "text": "this?"},
                                      _image(f"data:image/gif;base64,{other}", detail="low")), chat=True))
    assert req.images == [PNG, other]
    assert req.messages == [{"role": "user", "content": [
        {"type": "text", "text": "what is "}, {"type": "image"}, {"type": "text", "text": "this?"}, {"type": "image"}]}]
    line = json.loads(socket_request(req, "r1"))
    assert line["inputs"]["image"] == [PNG, other]
    grpc = build_request(req, "r1")
    image = next(t for t in grpc.inputs if t.name == "image")
    assert image.datatype == "BYTES" and list(image.shape) == [2]
    # Text alone: no image input at all.
    plain = to_backend(parse_body(_chat({"type": "text", "text": "hi"}), chat=True))
    assert plain.images == [] and "image" not in json.loads(socket_request(plain, "r2"))["inputs"]


@pytest.mark.parametrize(("part", "param", "needle"), [
    (_image("https://example.invalid/cat.png"), None, None),  # parsed; refused when fetched (below)
    (_image("data:image/png;base64,***"), "messages[0].content[0].image_url.url", "not valid base64"),
    (_image("data:text/plain;base64,aGk="), "messages[0].content[0].image_url.url", "not of an image"),
    (_image("data:image/png,rawbytes"), "messages[0].content[0].image_url.url", "base64 data URL"),
    (_image("file:///etc/passwd"), "messages[0].content[0].image_url.url", "'file'"),
    (_image(""), "messages[0].content[0].image_url.url", "missing required field"),
    (_image(f"data:image/png;base64,{PNG}", detail="ultra"), "messages[0].content[0].image_url.detail", "one of"),
    (_image(f"data:image/png;base64,{PNG}", uuid="x"), "messages[0].content[0].image_url.uuid", "not a known"),
    ({"type": "input_audio", "input_audio": {}}, "messages[0].content[0].type", "'input_audio'"),
    ({"text": "no type"}, "messages[0].content[0].type", "missing required field"),
    ({"type": "text", "text": 3}, "messages[0].content[0].text", "must be a string"),
    ({"type": "text", "text": "x", "cache": 1}, "messages[0].content[0].cache", "not a known"),
])
def test_bad_parts_are_refused_naming_the_part(part, param, needle):
    if param is None:
        req = to_backend(parse_body(_chat(part), chat=True))
        assert req.images == [RemoteImage("https://example.invalid/cat.png", "messages[0].content[0].image_url.url")]
        return
    err = _error(_chat(part))
    assert err.param == param and needle in err.message, (err.param, err.message)


def test_too_many_images_are_refused():
    err = _error(_chat(*[_image(f"data:image/png;base64,{PNG}")] * 17))
    assert err.param == "messages[0].content[16]" and "at most 16" in err.message


def test_remote_urls_are_refused_by_name_unless_allowed():
    remote = RemoteImage("http://127.0.0.1:9/x.png", "messages[1].content[0].image_url.url")
    images: list[str | RemoteImage] = [PNG, remote]
    with pytest.raises(ApiError) as info:
        asyncio.run(fetch_images(images, allowed=False))
    assert info.value.status == 400 and info.value.param == "messages[1].content[0].image_url.url"
    assert "does not fetch" in info.value.message


def test_allowed_remote_urls_are_fetched_in_order():
    pixels = b"\x89PNG fetched"
    srv = serve_files({"/a.png": (200, pixels), "/gone.png": (404, b"")})
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        got = asyncio.run(fetch_images([RemoteImage(f"{base}/a.png", "p0"), PNG], allowed=True))
        assert got == [base64.b64encode(pixels).decode(), PNG]
        with pytest.raises(ApiError) as info:
            asyncio.run(fetch_images([RemoteImage(f"{base}/gone.png", "messages[0].content[2].image_url.url")],
                                     allowed=True))
        assert info.value.param == "messages[0].content[2].image_url.url" and "HTTP 404" in info.value.message
    finally:
        srv.shutdown()
