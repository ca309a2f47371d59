"""The 'image' input (vllm_backend's): base64 images checked where the request is
parsed, opened with Pillow on the worker pool, handed to vLLM as multi_modal_data;
a text-only model refuses them naming the input. Each bad input has its case."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image

from llmhost.backend import images
from llmhost.backend.config import BackendSettings
from llmhost.backend.errors import RequestError
from llmhost.backend.request import parse_request
from tests.unit._engine_fakes import Engine, Sink, generate


def png(width: int = 6, height: int = 4, color: tuple[int, int, int] = (200, 10, 10), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), color if mode == "RGB" else 0).save(buf, format="PNG")
    return buf.getvalue()


def b64(raw: bytes) -> bytes:
    return base64.b64encode(raw)


def test_base64_images_parse_to_their_bytes_from_an_array_or_a_list():
    a, b = png(), png(color=(0, 255, 0))
    assert images.parse_images(np.array([b64(a), b64(b)], dtype=object)) == [a, b]
    assert images.parse_images([b64(a).decode()]) == [a]


@pytest.mark.parametrize(("value", "words"), [
    ([], "is empty"),
    ([b"not base64!"], "'image'[0] is not valid base64"),
    ([b64(b"x"), b"%%%"], "'image'[1] is not valid base64"),
    ([b""], "'image'[0] is empty"),
    ([5], "'image'[0] must be base64 text, got int"),
    ([b"aGk="] * (images.MAX_IMAGES + 1), f"at most {images.MAX_IMAGES} are allowed"),
])
def test_bad_image_inputs_are_named(value: Any, words: str):
    with pytest.raises(RequestError) as err:
        images.parse_images(value)
    assert words in str(err.value)


def test_an_oversized_image_is_refused_before_it_is_decoded(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 30)
    with pytest.raises(RequestError, match=r"'image'\[0\] is \d+ bytes of base64; an image may be at most 30"):
        images.parse_images([b"A" * 200])  # not valid base64 either: the size is checked first
    assert images.parse_images([b64(b"y" * 30)]) == [b"y" * 30]


def test_images_open_as_rgb_pictures():
    got = images.open_images([png(6, 4), png(3, 3, mode="L")])
    assert [(im.size, im.mode) for im in got] == [((6, 4), "RGB"), ((3, 3), "RGB")]
    assert got[0].getpixel((0, 0)) == (200, 10, 10)


def test_bytes_that_are_no_image_are_named():
    with pytest.raises(RequestError, match=r"'image'\[1\] is not an image Pillow can read: UnidentifiedImageError"):
        images.open_images([png(), b"plain text, valid base64 once encoded"])


def test_too_many_pixels_are_refused(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 20)
    with pytest.raises(RequestError, match=r"'image'\[0\] is 6x4 pixels; at most 20 pixels"):
        images.open_images([png(6, 4)])


def test_parse_request_carries_the_images_and_none_by_default():
    settings = BackendSettings()
    job = parse_request({"text_input": np.array([b"<image> what is it"], dtype=object),
                         "image": np.array([b64(png())], dtype=object)}, None, settings)
    assert job.images == [png()]
    job = parse_request({"text_input": np.array([b"hi"], dtype=object)}, None, settings)
    assert job.images == []
    with pytest.raises(RequestError, match="'image'"):
        parse_request({"text_input": np.array([b"hi"], dtype=object), "image": np.array([b"??"], dtype=object)},
                      None, settings)


class _Encoder:
    async def images(self, blobs: list[bytes]) -> list[Any]:
        return images.open_images(blobs)


def _run(multimodal: bool) -> tuple[Engine, Sink]:
    done = SimpleNamespace(index=0, text="ok", token_ids=[1], cumulative_logprob=None, finish_reason="length",
                           logprobs=None)
    # The engine's prompt: PROMPT_IDS with each <image> expanded to the model's image tokens.
    engine = Engine([SimpleNamespace(outputs=[done], finished=True, prompt_token_ids=[5] * 16 + [7, 8, 9])])
    job = parse_request({"text_input": np.array([b"<image> what"], dtype=object),
                         "image": np.array([b64(png()), b64(png(2, 2))], dtype=object)}, None, BackendSettings())
    sink = generate(engine, job, model="/models/tiny", _multimodal=multimodal, _architectures=["Qwen2ForCausalLM"],
                    _encoder=_Encoder())
    return engine, sink


def test_a_multimodal_model_gets_the_pictures_as_multi_modal_data():
    engine, sink = _run(multimodal=True)
    assert sink.errors == []
    (prompt,) = engine.prompts
    assert prompt["prompt_token_ids"] == [7, 8, 9]
    assert [im.size for im in prompt["multi_modal_data"]["image"]] == [(6, 4), (2, 2)]
    # num_input_tokens counts the prompt as the engine does: image tokens included.
    assert sink.chunks[-1].num_input_tokens == 19


def test_a_text_model_refuses_images_naming_the_input():
    engine, sink = _run(multimodal=False)
    assert engine.prompts == []
    assert len(sink.errors) == 1 and "input 'image' needs a multimodal model" in sink.errors[0]
    assert "this model takes text only (vLLM reports no multimodal support for Qwen2ForCausalLM)" in sink.errors[0]


def test_pillows_own_bomb_bound_is_a_request_error(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5)  # 6x4 is past twice that: Pillow raises while opening
    with pytest.raises(RequestError, match=r"'image'\[0\] decodes to too many pixels \(Pillow's bound\)"):
        images.open_images([png(6, 4)])
