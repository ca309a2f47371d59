"""The `image` input on a real multimodal model: the tiny BLIP-2 (llmhost.tiny.vision)
served by our backend on tritonserver and vLLM. A picture reaches the model (its
query tokens are counted in the prompt, and another picture changes the model's
log probabilities), over HTTP and a gRPC stream; the model's own limit of one image
and a file that is no picture are refused by name; text alone still works."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest

from llmhost.tiny.vision import QUERY_TOKENS, picture, write_tiny_vision_model
from tests.e2e._client import generate, grpc_stream, texts
from tests.harness.server import Server, start_server, wait_gone

PROMPT = "what is in the picture?"
ASK = {"text_input": PROMPT, "max_tokens": 6, "temperature": 0, "exclude_input_in_output": True,
       "return_num_input_tokens": True, "return_cumulative_logprob": True}
RED, BLUE = picture((200, 20, 20)), picture((20, 40, 220))


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = write_tiny_vision_model(tmp_path_factory.mktemp("tiny-vision"), seed=0)
    srv = start_server(model, tmp_path_factory.mktemp("serve-vision"), name="vision",
                       extra=["--max-restarts", "0"])
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
    results, error = grpc_stream(vision_server, {"text_input": PROMPT, "image": BLUE.encode(), "stream": True,
                                                 "exclude_input_in_output": True},
                                 {"max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert error is None, error
    streamed = "".join(t for r in results for t in texts(r))
    whole = _ok(vision_server, text_input=PROMPT, image=[BLUE], max_tokens=6, temperature=0, ignore_eos=True,
                exclude_input_in_output=True)
    assert len(results) >= 2 and streamed == whole["text_output"]


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

