"""The ``image`` input through our backend on a GPU: a LLaVA-style model (the prompt's
``<image>`` placeholder, which vLLM expands to the picture's tokens) and the tiny BLIP-2.

Run on a GPU host whose python3 imports vLLM, nvidia-pytriton and llmhost (the device
kit: ../shared/gpu-kit). It writes two random models with the tiny model's tokenizer plus
``<image>``:

* ``llava``: LlavaForConditionalGeneration, a CLIP vision tower (32x32 pictures, 8x8
  patches: 16 patch features once the class token is dropped, the "default" strategy)
  and a Qwen2 text model of the tiny model's size (vocabulary padded to 4160), bf16.
  vLLM's LLaVA needs torchvision, which CPU CI lacks: this is its only run.
* ``blip2``: llmhost.tiny.vision (vLLM inserts its 8 query tokens itself).

Each is served with ``llmhost serve --device gpu`` (enforce_eager) and asked over HTTP
``/v2/models/NAME/generate`` and a gRPC stream: text alone; one picture (prompt tokens
= the text's + the picture's tokens - the placeholder); another picture (other
cumulative_logprob at temperature 0); the first again (the same answer); for LLaVA two
pictures with two placeholders, and the mismatches (two pictures, one placeholder; one
picture, two placeholders); a file that is no picture (the named 400).

Then the OpenAI door (openai_door): ``llmhost gateway`` in front of that server (its
engine sockets, a key from a keys file) and, once it has stopped, ``vllm serve`` of the same
model folder (same max_model_len, dtype and enforce_eager; gpu_memory_utilization 0.3 on a
GPU) are asked the same chats with the official ``openai`` client (temperature 0, log
probabilities, ignore_eos, 6 tokens): chat_cases (text and image_url parts; for LLaVA also
a text holding ``<image>`` itself, two image parts, more placeholders than pictures; for
BLIP-2 two image parts, over its limit of one). Each case's verdict (chat_verdict): both
answered 200 with the same prompt_tokens, the same content and every token's log
probability within 1e-3, or both refused with the same status.

With the device kit (vLLM 0.20.2 on the image's transformers 5.17) LLaVA needs
``--fix-pixtral-import`` (fix_pixtral_import rewrites one import of the kit's vLLM), and
the CLIP tower's weights are renamed as LLaVA checkpoints name them (clip_tower_names).
The backend renders content parts with ``vllm.renderers.chat_utils``, which vLLM 0.20.2
has in ``vllm.entrypoints.chat_utils``: ``--fix-chat-utils-import`` (fix_chat_utils_import)
adds the module to the kit's vLLM. ``--device cpu`` serves BLIP-2 on CPU (a dry run of the
checks; LLaVA needs torchvision).

Usage: python3 -m lab.gpu_image_check OUT.json [--work DIR] [--models llava,blip2]
       [--fix-pixtral-import] [--fix-chat-utils-import] [--device gpu|cpu] [--write-only]
       [--no-openai-door]
Writes OUT.json (versions, each check's request summary, response fields and verdict,
each chat's answers from both servers and its verdict) and serve-NAME.log, gateway.log
and vllm-serve.log beside it; prints a summary; exits 1 if a check failed. The H100 run
of 2026-11-25: tests/fixtures/gpu/h100-580.159.04-real/device-run-2026-11-25-images/
(its test: tests/records/test_h100_image_input.py).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import queue
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmhost.tiny import model as tiny_model
from llmhost.tiny.vision import IMAGE_TOKEN, image_tokenizer, picture

HTTP, GRPC, METRICS = 18600, 18601, 18602
URL = f"http://127.0.0.1:{HTTP}"
GATEWAY, GATEWAY_METRICS, VLLM_PORT = 18610, 18611, 18620
GATEWAY_KEY = "gpu-image-check-key"
MAX_MODEL_LEN = 2048
# The OpenAI door's verdict: each token's log probability within this of vLLM's server's.
LOGPROB_TOLERANCE = 1e-3
LLAVA_MARKER = ".llmhost-tiny-llava.json"
IMAGE_SIZE, PATCH = 32, 8
# CLIP's patch features, the class token dropped ("default" strategy): what one
# <image> becomes in the prompt.
LLAVA_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
VOCAB_SIZE = 4160
QUESTION = "\nwhat is in the picture?"
NOT_A_PICTURE = base64.b64encode(b"GIF89a but not really").decode()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the models ---------------------------------------------------------------------------

def write_tiny_llava(out: str | os.PathLike[str], seed: int = 0) -> Path:
    """A random LLaVA (CLIP tower, Qwen2 text model) with the tiny tokenizer plus <image>."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        GenerationConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2Config,
    )

    path = tiny_model.prepare_dir(out, LLAVA_MARKER, "tiny LLaVA")
    tok, image_id, eos_id, pad_id = image_tokenizer(path)
    text = Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                       tie_word_embeddings=False, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=64)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         image_seq_length=LLAVA_IMAGE_TOKENS, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    clip_tower_names(path / "model.safetensors")
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH, num_additional_image_tokens=1,
                   vision_feature_select_strategy="default").save_pretrained(str(path))
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(str(path))
    (path / LLAVA_MARKER).write_text(json.dumps({"seed": seed, "architecture": "LlavaForConditionalGeneration",
                                                 "image_tokens": LLAVA_IMAGE_TOKENS}) + "\n")
    tiny_model.readable(path)
    return path


def clip_tower_names(weights: Path) -> None:
    """transformers 5 saves the CLIP tower as ``vision_tower.embeddings...``; LLaVA
    checkpoints (llava-hf's, and what vLLM 0.20.2 loads) name it
    ``vision_tower.vision_model.embeddings...``. Rename; transformers loads either."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    old, new = "vision_tower.", "vision_tower.vision_model."
    renamed = {(new + k[len(old):] if k.startswith(old) and not k.startswith(new) else k): v
               for k, v in tensors.items()}
    save_file(renamed, str(weights), metadata={"format": "pt"})


def text_tokens(model: Path, prompt: str) -> int:
    """PROMPT's length in the model's own tokenizer (no template, no special tokens added)."""
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(model))(prompt, add_special_tokens=False)["input_ids"])


# --- vLLM 0.20.2 under transformers 5.17 ----------------------------------------------------

PIXTRAL_IMPORT = """from transformers.models.pixtral.modeling_pixtral import (
    PixtralRotaryEmbedding,
    apply_rotary_pos_emb,
    position_ids_in_meshgrid,
)
"""
PIXTRAL_FIXED = """from transformers.models.pixtral import modeling_pixtral as _mp  # llmhost: transformers 5.17
PixtralRotaryEmbedding = getattr(_mp, "PixtralRotaryEmbedding", None) or _mp.PixtralVisionRotaryEmbedding
apply_rotary_pos_emb = _mp.apply_rotary_pos_emb
position_ids_in_meshgrid = getattr(_mp, "position_ids_in_meshgrid", None)  # a Pixtral tower only
"""


def fix_pixtral_import() -> str:
    """vLLM 0.20.2's llava.py imports its pixtral.py, which imports PixtralRotaryEmbedding and
    position_ids_in_meshgrid from transformers; transformers 5.17 has neither (the first is
    now PixtralVisionRotaryEmbedding), so every LLaVA fails vLLM's architecture inspection.
    Rewrite that import in the installed vLLM (the device kit's copy) to take what exists;
    only a Pixtral vision tower uses those names. Returns what was done."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return "vllm not found"
    path = Path(spec.origin).parent / "model_executor" / "models" / "pixtral.py"
    text = path.read_text()
    if PIXTRAL_FIXED in text:
        return f"{path}: already rewritten"
    if PIXTRAL_IMPORT not in text:
        return f"{path}: import not found, left alone"
    path.write_text(text.replace(PIXTRAL_IMPORT, PIXTRAL_FIXED))
    return f"{path}: rewrote the modeling_pixtral import"


CHAT_UTILS_SHIM = """# llmhost lab: vLLM 0.20.2 keeps this in vllm.entrypoints.chat_utils
from vllm.entrypoints.chat_utils import _get_full_multimodal_text_prompt  # noqa: F401
"""


def fix_chat_utils_import() -> str:
    """The backend takes vLLM's placement of image placeholders from
    ``vllm.renderers.chat_utils`` (where vLLM 0.32 has it); vLLM 0.20.2 has the same
    function in ``vllm.entrypoints.chat_utils`` and no such module, so a chat with content
    parts fails there. Add the module to the installed vLLM (the device kit's copy),
    re-exporting 0.20.2's function. Returns what was done."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return "vllm not found"
    renderers = Path(spec.origin).parent / "renderers"
    module = renderers / "chat_utils.py"
    if not renderers.is_dir():
        return f"{renderers}: no such package, left alone"
    if module.exists():
        return f"{module}: " + ("already added" if module.read_text() == CHAT_UTILS_SHIM else "exists, left alone")
    source = (Path(spec.origin).parent / "entrypoints" / "chat_utils.py")
    if "def _get_full_multimodal_text_prompt(" not in source.read_text():
        return f"{source}: no _get_full_multimodal_text_prompt, left alone"
    module.write_text(CHAT_UTILS_SHIM)
    return f"{module}: added, re-exporting vllm.entrypoints.chat_utils._get_full_multimodal_text_prompt"


# --- serving and asking ---------------------------------------------------------------------

def http(method: str, path: str, body: Any = None, timeout: float = 60) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(URL + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except OSError as exc:
        return 0, {"error": f"{type(exc).__name__}: {exc}"}
    try:
        parsed = json.loads(raw or b"{}")
    except ValueError:
        parsed = {"raw": raw.decode(errors="replace")}
    return status, parsed if isinstance(parsed, dict) else {"raw": parsed}


def wait(pred: Callable[[], bool], timeout_s: float, step: float = 0.5) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return round(time.monotonic() - t0, 1)
        time.sleep(step)
    return None


def serve(model: Path, name: str, work: Path, logfile: Path, device: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "llmhost.cli", "serve", "--device", device, "--model", str(model), "--name", name,
           "--http-port", str(HTTP), "--grpc-port", str(GRPC), "--metrics-port", str(METRICS),
           "--max-model-len", str(MAX_MODEL_LEN), "--workdir", str(work), "--max-restarts", "0"]
    if device == "gpu":
        # dtype as vllm_serve gives it (on CPU serve sets enforce_eager and bfloat16 itself).
        cmd += ["--kind", "KIND_GPU", "--engine-arg", "enforce_eager=true",
                "--engine-arg", "gpu_memory_utilization=0.3", "--engine-arg", 'dtype="bfloat16"']
    return subprocess.Popen(cmd, stdout=logfile.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None


def stop_group(proc: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM to PROC's whole session (vLLM's server and its engine process), SIGKILL
    after 90 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None


def grpc_stream(name: str, prompt: str, image: str, params: dict[str, Any]) -> dict[str, Any]:
    """One streaming gRPC request with one picture: its responses' texts, or the error."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{GRPC}")
    texts: list[str] = []
    error = None
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        tensors = []
        for key, value in (("text_input", prompt.encode()), ("image", image.encode()),
                           ("exclude_input_in_output", True), ("stream", True)):
            if isinstance(value, bool):
                t = grpcclient.InferInput(key, [1], "BOOL")
                t.set_data_from_numpy(np.array([value], dtype=np.bool_))
            else:
                t = grpcclient.InferInput(key, [1], "BYTES")
                t.set_data_from_numpy(np.array([value], dtype=np.object_))
            tensors.append(t)
        client.async_stream_infer(name, tensors, parameters=params, enable_empty_final_response=True)
        deadline = time.monotonic() + 60
        while True:
            result, err = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if err is not None:
                error = str(err)
                break
            out = result.as_numpy("text_output")
            if out is not None:
                texts.extend(t.decode() for t in out)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
    except Exception as exc:  # noqa: BLE001 - recorded as the check's outcome
        error = f"{type(exc).__name__}: {exc}"
    finally:
        client.stop_stream()
        client.close()
    return {"responses": len(texts), "texts": texts, "error": error}


class Checks:
    """Requests to one served model; each recorded with its verdict."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.records: list[dict[str, Any]] = []

    def ask(self, check: str, prompt: str, images: list[str] | None = None, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"text_input": prompt, "max_tokens": 6, "temperature": 0,
                                "exclude_input_in_output": True, "return_num_input_tokens": True,
                                "return_cumulative_logprob": True, **extra}
        if images is not None:
            body["image"] = images
        t0 = time.monotonic()
        status, resp = http("POST", f"/v2/models/{self.name}/generate", body)
        rec = {"check": check, "request": {"prompt": prompt, "images": len(images or []),
                                           "image_bytes": [len(base64.b64decode(i)) for i in images or []],
                                           **{k: v for k, v in body.items() if k not in ("text_input", "image")}},
               "status": status, "seconds": round(time.monotonic() - t0, 3),
               "response": {k: v for k, v in resp.items() if k != "model_version"}}
        self.records.append(rec)
        return rec

    def verdict(self, rec: dict[str, Any], passed: bool, **facts: Any) -> bool:
        rec.update(facts)
        rec["passed"] = bool(passed)
        log(f"{self.name} {rec['check']}: {'ok' if passed else 'FAILED'} {rec['status']} "
            f"{json.dumps(rec['response'])[:300]}")
        return bool(passed)


def error_of(rec: dict[str, Any]) -> str:
    return str(rec["response"].get("error", ""))


def refused(c: Checks, rec: dict[str, Any], needle: str = "") -> bool:
    """A 400 with an error message (naming NEEDLE), no traceback or path in it."""
    err = error_of(rec)
    clean = not any(s in err for s in ("Traceback", 'File "', "site-packages"))
    return c.verdict(rec, rec["status"] == 400 and bool(err) and needle in err and clean, expected_in_error=needle)


def run_checks(c: Checks, model: Path, placeholder: bool, image_tokens: int, red: str, blue: str) -> None:
    """The checks of one model. PLACEHOLDER: the prompt carries <image> per picture
    (LLaVA); otherwise vLLM inserts the picture's tokens itself (BLIP-2)."""
    one = (IMAGE_TOKEN if placeholder else "") + QUESTION
    two = (IMAGE_TOKEN * 2 if placeholder else "") + QUESTION
    placeholders = 1 if placeholder else 0
    text = c.ask("text_alone", QUESTION)
    c.verdict(text, text["status"] == 200 and bool(text["response"].get("text_output")))
    n_text = int(text["response"].get("num_input_tokens", -1))
    n_one = text_tokens(model, one)
    expected = n_one - placeholders + image_tokens
    for check, pic in (("one_picture_red", red), ("one_picture_blue", blue)):
        rec = c.ask(check, one, [pic])
        got = rec["response"].get("num_input_tokens")
        c.verdict(rec, rec["status"] == 200 and got == expected and n_one == n_text + placeholders,
                  text_alone_tokens=n_text, prompt_tokens_before_expansion=n_one, image_tokens=image_tokens,
                  expected_num_input_tokens=expected)
    r, b = c.records[-2], c.records[-1]
    lp = (r["response"].get("cumulative_logprob"), b["response"].get("cumulative_logprob"))
    c.records.append({"check": "pictures_differ", "status": None, "response": {"cumulative_logprobs": lp}})
    c.verdict(c.records[-1], None not in lp and lp[0] != lp[1])
    if placeholder:
        n_two = text_tokens(model, two)
        expected_two = n_two - 2 + 2 * image_tokens
        for check, pics in (("two_pictures_two_placeholders", [red, blue]),
                            ("two_pictures_swapped", [blue, red])):
            rec = c.ask(check, two, pics)
            c.verdict(rec, rec["status"] == 200 and rec["response"].get("num_input_tokens") == expected_two,
                      prompt_tokens_before_expansion=n_two, image_tokens=2 * image_tokens,
                      expected_num_input_tokens=expected_two)
        a, s = c.records[-2]["response"], c.records[-1]["response"]
        c.records.append({"check": "order_of_pictures_matters", "status": None,
                          "response": {"cumulative_logprobs": [a.get("cumulative_logprob"),
                                                               s.get("cumulative_logprob")]}})
        c.verdict(c.records[-1], a.get("cumulative_logprob") != s.get("cumulative_logprob"))
    again = c.ask("one_picture_red_again", one, [red])
    c.verdict(again, again["status"] == 200
              and again["response"].get("text_output") == r["response"].get("text_output")
              and abs(float(again["response"].get("cumulative_logprob", 1e9)) - float(lp[0] or 0)) < 1e-2)
    params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    streamed = grpc_stream(c.name, one, blue, params)
    whole = c.ask("http_whole_for_grpc", one, [blue], ignore_eos=True)
    rec = {"check": "grpc_stream_one_picture", "status": None,
           "request": {"prompt": one, "images": 1, "parameters": params}, "response": streamed}
    c.records.append(rec)
    c.verdict(rec, streamed["error"] is None and streamed["responses"] >= 2
              and "".join(streamed["texts"]) == whole["response"].get("text_output"),
              http_text_output=whole["response"].get("text_output"))
    whole["passed"] = whole["status"] == 200
    # Last, the refusals (should one of them upset the engine, the checks above are in).
    refused(c, c.ask("not_a_picture", one, [NOT_A_PICTURE]), "input 'image'[0] is not an image Pillow can read")
    if not placeholder:
        refused(c, c.ask("two_pictures_limit_one", one, [red, blue]), "At most 1 image(s) may be provided")
    else:
        # Only a 400 is asked of it: on 2026-11-25 (vLLM 0.20.2) its message was the bare
        # "engine error: EngineGenerateError" (vLLM's AssertionError "Failed to apply prompt
        # replacement for mm_items['image'][1]" went to the server's log alone).
        refused(c, c.ask("two_pictures_one_placeholder", one, [red, blue]))
        # Observed only: one picture and two placeholders; a placeholder and no picture.
        for check, prompt, pics in (("one_picture_two_placeholders", two, [red]),
                                    ("placeholder_without_picture", one, None)):
            rec = c.ask(check, prompt, pics)
            rec["passed"] = None
            log(f"{c.name} {check} (observed): {rec['status']} {json.dumps(rec['response'])[:300]}")
    last = c.ask("still_serving", one, [red])
    c.verdict(last, last["status"] == 200 and last["response"].get("text_output") == r["response"].get("text_output"))


# --- the OpenAI door against vLLM's server ---------------------------------------------------

def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _image(png_b64: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64}"}}


def chat_cases(kind: str, red: str, blue: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """(case, one user message's content parts) asked of both servers."""
    question = QUESTION.lstrip("\n")
    cases = [("parts_red", [_text("Look:"), _image(red), _text(question)]),
             ("parts_blue", [_text("Look:"), _image(blue), _text(question)])]
    if kind == "llava":
        cases += [("placeholder_in_text", [_text(IMAGE_TOKEN + QUESTION), _image(red)]),
                  ("two_image_parts", [_text("Look:"), _image(red), _image(blue), _text(question)]),
                  ("more_placeholders_than_pictures", [_text(IMAGE_TOKEN * 2 + QUESTION), _image(red)])]
    else:
        cases += [("two_image_parts", [_text("Look:"), _image(red), _image(blue), _text(question)])]
    return cases


def chat_ask(client: Any, model: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    """One chat (temperature 0, log probabilities, ignore_eos, 6 tokens): its status and
    usage, content and per-token log probabilities, or its error."""
    import openai

    t0 = time.monotonic()
    try:
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                           max_tokens=6, temperature=0, logprobs=True,
                                           extra_body={"ignore_eos": True})
    except openai.APIStatusError as exc:
        return {"status": exc.status_code, "error": str(exc.message)[:600], "seconds": round(time.monotonic() - t0, 3)}
    except openai.APIError as exc:
        return {"status": 0, "error": f"{type(exc).__name__}: {exc}"[:600],
                "seconds": round(time.monotonic() - t0, 3)}
    choice = r.choices[0]
    tokens = choice.logprobs.content if choice.logprobs is not None and choice.logprobs.content else []
    return {"status": 200, "prompt_tokens": r.usage.prompt_tokens if r.usage else None,
            "completion_tokens": r.usage.completion_tokens if r.usage else None,
            "content": choice.message.content, "finish_reason": choice.finish_reason,
            "tokens": [t.token for t in tokens], "logprobs": [t.logprob for t in tokens],
            "seconds": round(time.monotonic() - t0, 3)}


def chat_verdict(ours: dict[str, Any], theirs: dict[str, Any], tol: float = LOGPROB_TOLERANCE) -> dict[str, Any]:
    """Both 200 with the same prompt_tokens, content and log probabilities (each within
    TOL), or both refused with the same status (a 4xx)."""
    if ours.get("status") != 200 or theirs.get("status") != 200:
        same = ours.get("status") == theirs.get("status")
        return {"same_status": same, "passed": same and 400 <= int(ours.get("status") or 0) < 500}
    a, b = ours.get("logprobs") or [], theirs.get("logprobs") or []
    diff = max((abs(x - y) for x, y in zip(a, b, strict=False)), default=None)
    facts = {"same_status": True, "same_prompt_tokens": ours.get("prompt_tokens") == theirs.get("prompt_tokens"),
             "same_content": ours.get("content") == theirs.get("content"),
             "same_token_count": len(a) == len(b) and len(a) > 0, "max_logprob_diff": diff}
    facts["passed"] = bool(facts["same_prompt_tokens"] and facts["same_content"] and facts["same_token_count"]
                           and diff is not None and diff <= tol)
    return facts


def _start(cmd: list[str], logfile: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with logfile.open("ab") as out:
        out.write(f"\n===== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
        out.flush()
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def ask_side(label: str, cmd: list[str], logfile: Path, env: dict[str, str], ready_url: str, base: str,
             key: str, timeout_s: float, kind: str, cases: list[tuple[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Start CMD (logging to LOGFILE), wait until READY_URL answers 200 (with KEY), ask each
    case once through the `openai` client at BASE, stop it."""
    import openai

    proc = _start(cmd, logfile, env)
    side: dict[str, Any] = {"command": cmd[2:], "answers": {}}

    def ready() -> bool:
        if proc.poll() is not None:
            return True
        req = urllib.request.Request(ready_url, headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        took = wait(ready, timeout_s, 0.5)
        side["ready_s"] = took if proc.poll() is None else None
        if side["ready_s"] is None:
            log(f"{kind} {label}: not ready (exit {proc.poll()}); see {logfile}")
            return side
        client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
        for case, content in cases:
            side["answers"][case] = chat_ask(client, kind, content)
            log(f"{kind} {label} {case}: {json.dumps(side['answers'][case])[:300]}")
    finally:
        side["exit"] = stop_group(proc)
    return side


def gateway_answers(kind: str, work: Path, out_dir: Path,
                    cases: list[tuple[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """`llmhost gateway` in front of the running `llmhost serve` (its gRPC port and engine
    sockets, as the role runs it), a key from a keys file; each case asked once."""
    from llmhost.gateway.keys import hash_key

    keys = work / "gateway-keys.yml"
    keys.write_text(f"keys:\n  - name: check\n    sha256: {hash_key(GATEWAY_KEY)}\n")
    base = f"http://127.0.0.1:{GATEWAY}/v1"
    cmd = [sys.executable, "-m", "llmhost.cli", "gateway", "--upstream", f"127.0.0.1:{GRPC}",
           "--listen", f"127.0.0.1:{GATEWAY}", "--metrics-listen", f"127.0.0.1:{GATEWAY_METRICS}",
           "--keys-file", str(keys), "--model", kind,
           "--engine-sockets", f"127.0.0.1:{GRPC}={work / f'serve-{kind}' / 'engine'}"]
    return ask_side("gateway", cmd, out_dir / "gateway.log", {}, base + "/models", base, GATEWAY_KEY, 60, kind,
                    cases)


def vllm_answers(model: Path, kind: str, work: Path, out_dir: Path, device: str,
                 cases: list[tuple[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """`vllm serve` of MODEL (vLLM's own OpenAI server) with serve()'s engine arguments;
    each case asked once."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", kind, "--host", "127.0.0.1", "--port", str(VLLM_PORT),
           "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "bfloat16", "--enforce-eager"]
    if device == "gpu":
        cmd += ["--gpu-memory-utilization", "0.3"]
    cache = work / f"vllm-{kind}"
    cache.mkdir(parents=True, exist_ok=True)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CACHE_ROOT": str(cache / "cache")}
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    url = f"http://127.0.0.1:{VLLM_PORT}"
    return ask_side("vllm serve", cmd, out_dir / "vllm-serve.log", env, url + "/health", url + "/v1", "unused",
                    420, kind, cases)


def chat_comparison(cases: list[tuple[str, list[dict[str, Any]]]], ours: dict[str, Any],
                    theirs: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case: the request's parts (pictures named by size), both answers and the verdict."""
    out = []
    for case, content in cases:
        a, b = ours["answers"].get(case, {"status": None}), theirs["answers"].get(case, {"status": None})
        parts = [p if p["type"] == "text" else {"type": "image_url", "data_url_chars": len(p["image_url"]["url"])}
                 for p in content]
        rec = {"case": case, "parts": parts, "gateway": a, "vllm_serve": b, **chat_verdict(a, b)}
        log(f"chat {case}: {'ok' if rec['passed'] else 'FAILED'} gateway {a.get('status')} "
            f"{a.get('prompt_tokens')} {a.get('content')!r} / vllm serve {b.get('status')} {b.get('prompt_tokens')} "
            f"{b.get('content')!r} max diff {rec.get('max_logprob_diff')}")
        out.append(rec)
    return out


def versions() -> dict[str, str]:
    import torch
    import transformers
    import vllm

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        smi = ""
    return {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "gpu": gpu, "nvidia_smi": smi, "python": sys.version.split()[0]}


def check_model(kind: str, work: Path, out_dir: Path, red: str, blue: str, device: str,
                openai_door: bool = True) -> dict[str, Any]:
    from llmhost.tiny.vision import QUERY_TOKENS, write_tiny_vision_model

    t0 = time.monotonic()
    path = write_tiny_llava(work / kind) if kind == "llava" else write_tiny_vision_model(work / kind)
    made = round(time.monotonic() - t0, 1)
    config = json.loads((path / "config.json").read_text())
    result: dict[str, Any] = {"architectures": config.get("architectures"), "written_s": made,
                              "image_token_id": config.get("image_token_index", config.get("image_token_id"))}
    log(f"{kind}: written in {made} s ({result})")
    proc = serve(path, kind, work / f"serve-{kind}", out_dir / f"serve-{kind}.log", device)
    try:
        took = wait(lambda: proc.poll() is not None or http("GET", f"/v2/models/{kind}/ready", timeout=3)[0] == 200,
                    300, 1.0)
        result["ready_s"] = took if proc.poll() is None else None
        if result["ready_s"] is None:
            result["checks"] = [{"check": "ready", "status": None, "response": {}, "passed": False}]
            return result
        log(f"{kind}: ready in {took} s")
        c = Checks(kind)
        if kind == "llava":
            run_checks(c, path, True, LLAVA_IMAGE_TOKENS, red, blue)
        else:
            run_checks(c, path, False, QUERY_TOKENS, red, blue)
        result["checks"] = c.records
        if openai_door:
            cases = chat_cases(kind, red, blue)
            ours = gateway_answers(kind, work, out_dir, cases)
    finally:
        result["serve_exit"] = stop(proc)
    if openai_door:
        # vLLM's server once ours has stopped: one server on the GPU at a time.
        theirs = vllm_answers(path, kind, work, out_dir, device, cases)
        result["openai_door"] = {
            "gateway": {k: v for k, v in ours.items() if k != "answers"},
            "vllm_serve": {k: v for k, v in theirs.items() if k != "answers"},
            "logprob_tolerance": LOGPROB_TOLERANCE,
            "chats": chat_comparison(cases, ours, theirs)}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("out", type=Path, help="the JSON record to write")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu-image-check"))
    p.add_argument("--models", default="llava,blip2")
    p.add_argument("--write-only", action="store_true", help="write the models and stop (a CPU dry run)")
    p.add_argument("--fix-pixtral-import", action="store_true",
                   help="rewrite vLLM 0.20.2's pixtral.py import for transformers 5.17 first (fix_pixtral_import)")
    p.add_argument("--fix-chat-utils-import", action="store_true",
                   help="add vllm.renderers.chat_utils to vLLM 0.20.2 first (fix_chat_utils_import)")
    p.add_argument("--no-openai-door", action="store_true", help="skip the gateway against vllm serve")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="cpu: a dry run (BLIP-2 only there)")
    args = p.parse_args(argv)
    out_dir = args.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in args.models.split(",") if k]
    if args.write_only:
        from llmhost.tiny.vision import write_tiny_vision_model

        for kind in kinds:
            path = write_tiny_llava(args.work / kind) if kind == "llava" else write_tiny_vision_model(args.work / kind)
            log(f"{kind}: {path}: {sorted(f.name for f in path.iterdir())}")
        return 0
    fixed = fix_pixtral_import() if args.fix_pixtral_import else "not asked"
    log(f"pixtral import: {fixed}")
    chat_utils = fix_chat_utils_import() if args.fix_chat_utils_import else "not asked"
    log(f"chat_utils import: {chat_utils}")
    red, blue = picture((200, 20, 20)), picture((20, 40, 220))
    record: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": args.device,
                              "pixtral_import_fix": fixed, "chat_utils_import_fix": chat_utils,
                              **versions(),
                              "pictures": {"red": "48x40 PNG (200,20,20), lighter square",
                                           "blue": "48x40 PNG (20,40,220), lighter square"},
                              "models": {}}
    t0 = time.monotonic()
    for kind in kinds:
        try:
            record["models"][kind] = check_model(kind, args.work, out_dir, red, blue, args.device,
                                                 not args.no_openai_door)
        except Exception as exc:  # noqa: BLE001 - recorded, and the run fails
            record["models"][kind] = {"exception": f"{type(exc).__name__}: {exc}"}
            log(f"{kind}: exception {type(exc).__name__}: {exc}")
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    record["seconds"] = round(time.monotonic() - t0, 1)
    failed = [f"{k}/{c['check']}" for k, m in record["models"].items()
              for c in m.get("checks", [{"check": "exception", "passed": False}]) if c.get("passed") is False]
    failed += [f"{k}/openai/{c['case']}" for k, m in record["models"].items()
               for c in m.get("openai_door", {}).get("chats", []) if not c["passed"]]
    record["failed"] = failed
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    log(f"done in {record['seconds']} s; {record['vllm']=} {record['gpu']=}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
