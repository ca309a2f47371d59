"""The `image` input on a real multimodal model: the tiny BLIP-2 (llmhost.tiny.vision)
served by our backend on tritonserver and vLLM. A picture reaches the model (its
query tokens are counted in the prompt, and another picture changes the model's
log probabilities), over HTTP and a gRPC stream; the model's own limit of one image
and a file that is no picture are refused by name; text alone still works."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmhost.tiny.vision import QUERY_TOKENS, picture, write_tiny_vision_model
from tests.e2e._client import generate, grpc_stream, more_than, shaped, texts
from tests.harness.net import CLIENT_TIMEOUT_S
from tests.harness.server import Server, start_server, wait_gone

PROMPT = "what is in the picture?"
ASK = {"text_input": PROMPT, "max_tokens": 6, "temperature": 0, "exclude_input_in_output": True,
       "return_num_input_tokens": True, "return_cumulative_logprob": True}
RED, BLUE = picture((200, 20, 20)), picture((20, 40, 220))


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_vision_model(tmp_path_factory.mktemp("tiny-vision"), seed=0)


@pytest.fixture(scope="module")
def vision_server(vision_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # serve's default restarts: a start that hangs (docs/testing.md) is started again.
    srv = start_server(vision_model, tmp_path_factory.mktemp("serve-vision"), name="vision")
    yield srv
    kids = srv.descendants()
    srv.stop()
    assert not wait_gone(kids), "processes left after SIGTERM"


def _ok(server: Server, **body: object) -> dict[str, object]:
    r = generate(server, **body)
    assert r["_status"] == 200, r
    return r


def test_a_picture_reaches_the_model(vision_server: Server):
    text_only = _ok(vision_server, **ASK)
    red = _ok(vision_server, **ASK, image=[RED])
    blue = _ok(vision_server, **ASK, image=[BLUE])
    again = _ok(vision_server, **ASK, image=[RED])
    # The prompt as the engine counts it: the image's query tokens before the text.
    assert red["num_input_tokens"] == blue["num_input_tokens"] == text_only["num_input_tokens"] + QUERY_TOKENS
    assert red["text_output"] and blue["text_output"]
    # Another picture, other log probabilities: the pixels reached the model; the same
    # picture again, the same answer.
    assert red["cumulative_logprob"] != blue["cumulative_logprob"], (red, blue)
    assert again["text_output"] == red["text_output"]
    assert again["cumulative_logprob"] == pytest.approx(red["cumulative_logprob"], rel=1e-3, abs=1e-3)


def test_a_picture_in_a_grpc_stream(vision_server: Server):
    whole = _ok(vision_server, text_input=PROMPT, image=[BLUE], max_tokens=6, temperature=0, ignore_eos=True,
                exclude_input_in_output=True)

    def take() -> list[Any]:
        results, error = grpc_stream(vision_server, {"text_input": PROMPT, "image": BLUE.encode(), "stream": True,
                                                     "exclude_input_in_output": True},
                                     {"max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert error is None, error
        assert "".join(t for r in results for t in texts(r)) == whole["text_output"]
        return results

    shaped(take, more_than(1))


@pytest.mark.parametrize(("images", "needle"), [
    # BLIP-2 reads one picture a prompt: vLLM's limit, passed on as the client's error.
    ([RED, BLUE], "At most 1 image(s) may be provided in one prompt"),
    ([base64.b64encode(b"GIF89a but not really").decode()], "input 'image'[0] is not an image Pillow can read"),
])
def test_pictures_the_model_cannot_take_are_refused_by_name(vision_server: Server, images: list[str], needle: str):
    r = generate(vision_server, **ASK, image=images)
    assert r["_status"] == 400 and needle in str(r.get("error")), r
    assert _ok(vision_server, **ASK, image=[RED])["text_output"]  # nothing lost: the next request is served


def test_text_alone_on_the_vision_model(vision_server: Server):
    r = _ok(vision_server, text_input=PROMPT, max_tokens=4, temperature=0, ignore_eos=True,
            return_num_output_tokens=True)
    assert r["num_output_tokens"] == 4



# -- Image parts of chat messages through the gateway, with the official `openai` client --


@pytest.fixture(scope="module")
def vision_chat(vision_server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """Two gateways in front of the vision server: the demo's (engine sockets; remote image
    URLs refused, the default) and one that may fetch them (over gRPC); and a local web
    server with the red picture at /red.png."""
    import base64 as b64

    import openai

    from tests.harness.gateway import KEY, keyed_gateway, stop_gateway
    from tests.harness.webfiles import serve_files

    web = serve_files({"/red.png": (200, b64.b64decode(RED))})
    plain = keyed_gateway(vision_server, tmp_path_factory.mktemp("vision-gateway"),
                          "--engine-sockets", f"{vision_server.grpc}={vision_server.engine_sockets}")
    remote = keyed_gateway(vision_server, tmp_path_factory.mktemp("vision-gateway-remote"), "--allow-remote-images")
    try:
        yield {name: openai.OpenAI(base_url=g.url, api_key=KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S)
               for name, g in (("plain", plain), ("remote", remote))} | {
            "url": f"http://127.0.0.1:{web.server_address[1]}/red.png"}
    finally:
        stop_gateway(plain.proc, plain.log)
        stop_gateway(remote.proc, remote.log)
        web.shutdown()


def _asking(*images: str) -> list[dict[str, object]]:
    return [{"role": "user", "content": [{"type": "text", "text": PROMPT},
                                         *({"type": "image_url", "image_url": {"url": u}} for u in images)]}]


def _data_url(png_b64: str) -> str:
    return f"data:image/png;base64,{png_b64}"


CHAT = {"model": "vision", "max_tokens": 6, "temperature": 0, "logprobs": True, "extra_body": {"ignore_eos": True}}


def _logprob(answer) -> float:  # type: ignore[no-untyped-def]
    return sum(t.logprob for t in answer.choices[0].logprobs.content)


def test_an_image_part_reaches_the_model_through_the_gateway(vision_chat):
    client = vision_chat["plain"]
    text_only = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **CHAT)
    red = client.chat.completions.create(messages=_asking(_data_url(RED)), **CHAT)
    blue = client.chat.completions.create(messages=_asking(_data_url(BLUE)), **CHAT)
    again = client.chat.completions.create(messages=_asking(_data_url(RED)), **CHAT)
    # The image's query tokens are in the prompt, as the engine counts it.
    assert red.usage.prompt_tokens == blue.usage.prompt_tokens == text_only.usage.prompt_tokens + QUERY_TOKENS
    assert red.usage.completion_tokens == 6
    assert _logprob(red) != _logprob(blue), (red, blue)  # the pixels reached the model
    assert again.choices[0].message.content == red.choices[0].message.content
    assert _logprob(again) == pytest.approx(_logprob(red), abs=1e-3)
    # Streamed, over the other door (gRPC): the same answer.
    streamed = "".join(c.choices[0].delta.content or "" for c in vision_chat["remote"].chat.completions.create(
        messages=_asking(_data_url(RED)), stream=True, **{k: v for k, v in CHAT.items() if k != "logprobs"})
        if c.choices)
    assert streamed == red.choices[0].message.content


def test_an_image_chat_matches_vllm_serve(vision_chat, vision_model, tmp_path_factory):
    """Image and text parts render as vLLM's server renders them (the texts joined by
    newlines for this model's string template; BLIP-2 needs no placeholder): the same
    prompt tokens, answer and log probabilities at temperature 0."""
    import openai

    from tests.harness.vllm_server import ENGINE_ARGS, vllm_server

    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "image_url", "image_url": {"url": _data_url(RED)}},
                                             {"type": "text", "text": PROMPT}]}]
    with vllm_server(vision_model, tmp_path_factory.mktemp("vllm-vision"), "vision", ENGINE_ARGS) as vllm:
        theirs = openai.OpenAI(base_url=vllm.url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
        vllms = theirs.chat.completions.create(messages=messages, **CHAT)
    mine = vision_chat["plain"].chat.completions.create(messages=messages, **CHAT)
    assert mine.usage.prompt_tokens == vllms.usage.prompt_tokens, (mine.usage, vllms.usage)
    assert mine.choices[0].message.content == vllms.choices[0].message.content
    assert [t.logprob for t in mine.choices[0].logprobs.content] == pytest.approx(
        [t.logprob for t in vllms.choices[0].logprobs.content], abs=1e-3)


def test_remote_image_urls_only_where_the_gateway_allows_them(vision_chat):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        vision_chat["plain"].chat.completions.create(messages=_asking(vision_chat["url"]), **CHAT)
    error = info.value.response.json()["error"]
    assert error["param"] == "messages[0].content[1].image_url.url" and "remote URL" in error["message"], error
    fetched = vision_chat["remote"].chat.completions.create(messages=_asking(vision_chat["url"]), **CHAT)
    sent = vision_chat["remote"].chat.completions.create(messages=_asking(_data_url(RED)), **CHAT)
    assert fetched.choices[0].message.content == sent.choices[0].message.content
    assert fetched.usage.prompt_tokens == sent.usage.prompt_tokens
    assert _logprob(fetched) == pytest.approx(_logprob(sent), abs=1e-3)


@pytest.mark.parametrize(("images", "needle"), [
    # BLIP-2 reads one picture a prompt: vLLM's limit, passed on as the client's error.
    ([_data_url(RED), _data_url(BLUE)], "At most 1 image(s) may be provided in one prompt"),
    ([_data_url(base64.b64encode(b"GIF89a but not really").decode())], "is not an image Pillow can read"),
    (["data:image/png;base64,not base64!"], "messages[0].content[1].image_url.url"),
])
def test_image_parts_the_model_cannot_take_are_a_400(vision_chat, images, needle):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        vision_chat["plain"].chat.completions.create(messages=_asking(*images), **CHAT)
    assert needle in info.value.response.text, info.value.response.text
