"""Chat contents given as parts (text, and where each picture goes) in the backend's
'messages' input, and how they reach the model's chat template: as vLLM's server
renders them, the parts' texts joined by newlines for a template that takes strings,
the model's image placeholder first for each picture the text does not hold (LLaVA's
``<image>``; BLIP-2 needs none), the parts themselves for a template that takes them."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from llmhost.backend.config import BackendSettings
from llmhost.backend.errors import RequestError
from llmhost.backend.prompts import ContentRendering, render_contents
from llmhost.backend.request import parse_messages, parse_request

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n not really").decode()
LLAVA = ContentRendering("string", lambda i: "<image>")
BLIP2 = ContentRendering("string", lambda i: None)
NUMBERED = ContentRendering("string", lambda i: f"<|image_{i}|>")  # phi-3-vision's form


def _parts(*parts: dict[str, str]) -> list[dict[str, object]]:
    return [{"role": "user", "content": list(parts)}]


TEXT_A, TEXT_B, IMAGE = {"type": "text", "text": "What is"}, {"type": "text", "text": "this?"}, {"type": "image"}


def test_text_parts_are_joined_by_newlines_for_a_string_template():
    assert render_contents(_parts(TEXT_A, TEXT_B), lambda: ContentRendering()) == [
        {"role": "user", "content": "What is\nthis?"}]


def test_the_placeholder_goes_first_for_each_picture():
    assert render_contents(_parts(TEXT_A, IMAGE, TEXT_B), lambda: LLAVA)[0]["content"] == "<image>\nWhat is\nthis?"
    two = render_contents([*_parts(IMAGE, TEXT_A), *_parts(IMAGE, IMAGE)], lambda: NUMBERED)
    assert [m["content"] for m in two] == ["<|image_1|>\nWhat is", "<|image_2|>\n<|image_3|>"]


def test_a_placeholder_the_text_already_holds_is_not_added_again():
    said = {"type": "text", "text": "Look: <image> what is it?"}
    assert render_contents(_parts(said, IMAGE), lambda: LLAVA)[0]["content"] == "Look: <image> what is it?"


def test_more_placeholders_in_the_text_than_pictures_is_a_request_error():
    said = {"type": "text", "text": "<image> and <image>"}
    with pytest.raises(RequestError, match="messages"):
        render_contents(_parts(said, IMAGE), lambda: LLAVA)


def test_a_model_without_a_placeholder_gets_the_text_alone():
    assert render_contents(_parts(IMAGE, TEXT_A), lambda: BLIP2)[0]["content"] == "What is"


def test_a_template_that_takes_parts_gets_them():
    messages = [{"role": "system", "content": "be brief"}, *_parts(IMAGE, TEXT_A)]
    out = render_contents(messages, lambda: ContentRendering("openai", lambda i: "<image>"))
    assert out == [{"role": "system", "content": "be brief"}, {"role": "user", "content": [IMAGE, TEXT_A]}]
    assert out[1]["content"] is not messages[1]["content"]  # a copy: the job's messages stay as given


def test_string_contents_are_kept_as_they_are():
    messages = [{"role": "user", "content": "hi"}]
    assert render_contents(messages, lambda: LLAVA) is messages


def test_parse_messages_takes_text_and_image_parts():
    out = parse_messages(json.dumps(_parts(TEXT_A, IMAGE)))
    assert out[0]["content"] == [TEXT_A, IMAGE]
    assert parse_messages(json.dumps(_parts(IMAGE)))[0]["content"] == [IMAGE]  # a picture alone is content


@pytest.mark.parametrize(("content", "needle"), [
    ([{"type": "image_url", "image_url": {"url": "x"}}], "messages[0].content[0].type"),
    ([{"type": "text"}], "messages[0].content[0].text"),
    ([{"type": "text", "text": "a", "extra": 1}], "messages[0].content[0] has unknown key(s) ['extra']"),
    ([{"type": "image", "url": "x"}], "messages[0].content[0] has unknown key(s) ['url']"),
    (["text"], "messages[0].content[0] must be an object"),
    (7, "messages[0].content must be a string or a list of parts"),
])
def test_bad_parts_are_refused_by_name(content, needle):
    with pytest.raises(RequestError) as err:
        parse_messages(json.dumps([{"role": "user", "content": content}]))
    assert needle in str(err.value)


def test_image_parts_and_pictures_must_match():
    def job(messages, images):  # type: ignore[no-untyped-def]
        inputs = {"messages": np.array([json.dumps(messages).encode()], dtype=np.object_),
                  "image": np.array([PNG.encode()] * images, dtype=np.object_)}
        return parse_request(inputs, None, BackendSettings())

    assert len(job(_parts(TEXT_A, IMAGE), 1).images) == 1
    with pytest.raises(RequestError, match="places 2 picture"):
        job(_parts(IMAGE, IMAGE), 1)
    # Pictures with no image part: placed by the prompt's own placeholders, as before.
    assert len(job(_parts(TEXT_A), 1).images) == 1


def test_vllm_chat_utilities_come_from_where_the_release_keeps_them(monkeypatch):
    """vLLM 0.32 keeps its chat utilities in vllm.renderers.chat_utils; releases before
    the renderers (0.20) in vllm.entrypoints.chat_utils, which is taken where the first is
    missing."""
    import sys
    import types

    from llmhost.backend.prompts import vllm_chat_utils

    assert vllm_chat_utils().__name__ == "vllm.renderers.chat_utils"
    older = types.ModuleType("vllm.entrypoints.chat_utils")
    monkeypatch.setitem(sys.modules, "vllm.renderers.chat_utils", None)  # import now fails
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.chat_utils", older)
    monkeypatch.delattr(sys.modules["vllm.renderers"], "chat_utils", raising=False)
    assert vllm_chat_utils() is older
