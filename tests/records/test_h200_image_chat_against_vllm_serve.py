"""Chat image parts through the gateway against ``vllm serve`` on the H200 (2026-11-28,
vLLM 0.20.2, transformers 5.17.0), recorded in ``device-run-2026-11-28-image-chat``:

    python3 -m lab.gpu_image_check OUT/record.json --fix-pixtral-import --fix-chat-utils-import

For the random LLaVA (its prompt needs ``<image>``, one picture = 16 patch tokens) and the
tiny BLIP-2 (8 query tokens, no placeholder), ``llmhost gateway`` in front of ``llmhost
serve --device gpu`` and then ``vllm serve`` of the same model folder were asked the same
chats with the official ``openai`` client (temperature 0, log probabilities, ignore_eos,
6 tokens). Every verdict is recomputed here from the recorded answers; what docs/gpu.md
("Chat image parts against vllm serve on the H200") states of it is checked too."""

from __future__ import annotations

import json

import pytest

from tests.harness.paths import FIXTURES

RUN = FIXTURES / "gpu" / "h200-580.159.04-real" / "device-run-2026-11-28-image-chat"
TOLERANCE = 1e-3
LLAVA_CASES = ["parts_red", "parts_blue", "placeholder_in_text", "two_image_parts", "more_placeholders_than_pictures"]
BLIP2_CASES = ["parts_red", "parts_blue", "two_image_parts"]
REFUSED = {("llava", "more_placeholders_than_pictures"), ("blip2", "two_image_parts")}
# The LLaVA prompt of one picture through the chat template: "<image>\nLook:\nwhat is in the
# picture?" is 26 tokens with "<image>" one of them; vLLM puts the picture's 16 in its place.
LLAVA_IMAGE_TOKENS = 16


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads((RUN / "record.json").read_text())


def chats(record: dict, model: str) -> dict[str, dict]:
    return {c["case"]: c for c in record["models"][model]["openai_door"]["chats"]}


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_recorded_on_the_h200_with_the_kit(record: dict):
    assert record["gpu"] == "NVIDIA H200" and record["nvidia_smi"] == "NVIDIA H200, 580.159.04"
    assert (record["vllm"], record["torch"], record["transformers"]) == ("0.20.2", "2.11.0+cu130", "5.17.0")
    assert record["device"] == "gpu" and record["date"].startswith("2026-11-28T05:28")
    assert "NVIDIA H200" in (RUN / "nvidia-smi.txt").read_text()
    assert record["pixtral_import_fix"].endswith("rewrote the modeling_pixtral import")
    # vLLM 0.20.2 has no vllm.renderers.chat_utils (the backend's import): the script added it.
    assert record["chat_utils_import_fix"] == ("/tmp/site/vllm/renderers/chat_utils.py: added, re-exporting "
                                               "vllm.entrypoints.chat_utils._get_full_multimodal_text_prompt")
    assert "ModuleNotFoundError: No module named 'vllm.renderers.chat_utils'" not in (
        RUN / "serve-llava.log").read_text()
    assert record["failed"] == []


@pytest.mark.parametrize(("model", "cases"), [("llava", LLAVA_CASES), ("blip2", BLIP2_CASES)])
def test_both_servers_ran_as_asked(record: dict, model: str, cases: list[str]):
    m = record["models"][model]
    assert m["serve_exit"] == 0 and m["ready_s"] > 0
    door = m["openai_door"]
    gateway, vllm = door["gateway"], door["vllm_serve"]
    assert gateway["exit"] == 0 and vllm["exit"] == 0 and gateway["ready_s"] > 0 and vllm["ready_s"] > 0
    assert gateway["command"][:2] == ["llmhost.cli", "gateway"] and "--engine-sockets" in gateway["command"]
    # The same engine settings as llmhost serve's: max_model_len, bfloat16, eager, a share of the GPU.
    args = vllm["command"]
    assert args[0] == "vllm.entrypoints.openai.api_server" and args[args.index("--model") + 1] == f"/tmp/gic/{model}"
    for flag, value in (("--max-model-len", "2048"), ("--dtype", "bfloat16"), ("--gpu-memory-utilization", "0.3")):
        assert args[args.index(flag) + 1] == value
    assert "--enforce-eager" in args
    # vLLM's engine line on both sides: bfloat16, eager.
    engines = [line for line in (RUN / f"serve-{model}.log").read_text().splitlines()
               if "Initializing a V1 LLM engine" in line]
    engines += [line for line in (RUN / "vllm-serve.log").read_text().splitlines()
                if "Initializing a V1 LLM engine" in line and f"model='/tmp/gic/{model}'" in line]
    assert len(engines) == 2
    assert all(" dtype=torch.bfloat16," in line and "enforce_eager=True" in line for line in engines)
    assert door["logprob_tolerance"] == TOLERANCE
    assert [c["case"] for c in door["chats"]] == cases


@pytest.mark.parametrize("model", ["llava", "blip2"])
def test_every_answer_matches_vllm_serve(record: dict, model: str):
    for case, c in chats(record, model).items():
        ours, theirs = c["gateway"], c["vllm_serve"]
        if (model, case) in REFUSED:
            assert ours["status"] == theirs["status"] == 400, c
            assert c["passed"] is True
            continue
        assert ours["status"] == theirs["status"] == 200, c
        assert ours["prompt_tokens"] == theirs["prompt_tokens"]
        assert ours["content"] == theirs["content"] and ours["tokens"] == theirs["tokens"]
        assert ours["completion_tokens"] == theirs["completion_tokens"] == len(ours["logprobs"]) == 6
        diff = max_diff(ours["logprobs"], theirs["logprobs"])
        assert diff <= TOLERANCE and diff == c["max_logprob_diff"]
        assert c["passed"] is True


def test_llava_placeholders_as_vllm_places_them(record: dict):
    """One <image> put first for the one picture, none added where the text holds it,
    two for two pictures: the prompt counts follow."""
    c = chats(record, "llava")
    one = c["parts_red"]["gateway"]["prompt_tokens"]
    assert one == c["parts_blue"]["gateway"]["prompt_tokens"] == 41
    # "<image>\nwhat is in the picture?" holds its placeholder: no "Look:" line, no second <image>.
    assert c["placeholder_in_text"]["gateway"]["prompt_tokens"] == 37
    # A second picture: one more <image> and its newline (2 tokens) less the token <image> was, plus 16.
    assert c["two_image_parts"]["gateway"]["prompt_tokens"] == 58 == one + 1 + LLAVA_IMAGE_TOKENS
    # Another picture, other tokens: the pixels reached the model on both servers.
    assert c["parts_red"]["gateway"]["content"] != c["parts_blue"]["gateway"]["content"]


def test_the_refusals_name_the_cause_on_both(record: dict):
    more = chats(record, "llava")["more_placeholders_than_pictures"]
    cause = "Found more '<image>' placeholders in input prompt than actual multimodal data items."
    assert cause in more["gateway"]["error"] and cause in more["vllm_serve"]["error"]
    assert "'code': 'invalid_request'" in more["gateway"]["error"]
    limit = chats(record, "blip2")["two_image_parts"]
    cause = "At most 1 image(s) may be provided in one prompt."
    assert cause in limit["gateway"]["error"] and cause in limit["vllm_serve"]["error"]


def test_blip2_needs_no_placeholder(record: dict):
    c = chats(record, "blip2")
    assert c["parts_red"]["gateway"]["prompt_tokens"] == c["parts_blue"]["gateway"]["prompt_tokens"] == 32
    assert c["parts_red"]["gateway"]["content"] != c["parts_blue"]["gateway"]["content"]


def test_the_triton_checks_still_pass(record: dict):
    for model in ("llava", "blip2"):
        checks = record["models"][model]["checks"]
        assert all(c["passed"] in (True, None) for c in checks)
        assert {c["check"] for c in checks if c["passed"] is None} <= {"one_picture_two_placeholders",
                                                                       "placeholder_without_picture"}


def test_what_docs_gpu_md_says_of_it(record: dict):
    doc = (FIXTURES.parents[1] / "docs" / "gpu.md").read_text()
    section = " ".join(doc.split("### Chat image parts against vllm serve on the H200 (2026-11-28)")[1]
                       .split("\n### ")[0].split())
    for model in ("llava", "blip2"):
        for case, c in chats(record, model).items():
            if c["gateway"]["status"] == 200:
                assert f"| {model} | {case} | {c['gateway']['prompt_tokens']} |" in section, (model, case)
    assert "0.0 (every token's log probability identical)" in section
    assert "`--fix-chat-utils-import`" in section
