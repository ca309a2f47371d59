"""Generate a tiny, random multimodal model (BLIP-2) that vLLM serves on CPU.

It takes one image per prompt, so the ``image`` input can be tested end to end
without a GPU or a download: a 32x32 ViT and a Q-Former turn the picture into
QUERY_TOKENS embeddings that take the place of as many ``<image>`` tokens, which
vLLM inserts at the start of the prompt; an OPT language model of the tiny
model's size reads them. The tokenizer is the tiny model's (llmhost.tiny.model)
plus the ``<image>`` token.

Why BLIP-2: vLLM's LLaVA and PaliGemma reach transformers' Pixtral image
processor, which imports torchvision, and the package index CI reaches has no
torchvision build for CPU torch. BLIP-2 needs only Pillow.
"""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path
from typing import Any

from llmhost.tiny import model as tiny_model

IMAGE_TOKEN = "<image>"
# The Q-Former's query tokens: the prompt tokens one image takes.
QUERY_TOKENS = 8
IMAGE_SIZE = 32
# The tiny tokenizer's 4,096 tokens, <image>, and room to a multiple of 64.
VOCAB_SIZE = 4160
MARKER = ".llmhost-tiny-vision-model.json"


def _configs(image_token_id: int, eos_id: int, pad_id: int) -> object:
    from transformers import Blip2Config, Blip2QFormerConfig, Blip2VisionConfig, OPTConfig

    text = OPTConfig(vocab_size=VOCAB_SIZE, hidden_size=256, ffn_dim=512, num_hidden_layers=4,
                     num_attention_heads=4, word_embed_proj_dim=256, max_position_embeddings=2048,
                     eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=pad_id)
    vision = Blip2VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                               image_size=IMAGE_SIZE, patch_size=8)
    qformer = Blip2QFormerConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                 encoder_hidden_size=64)
    return Blip2Config(vision_config=vision.to_dict(), qformer_config=qformer.to_dict(),
                       text_config=text.to_dict(), num_query_tokens=QUERY_TOKENS, image_token_index=image_token_id)


def image_tokenizer(path: Path) -> tuple[Any, int, int, int]:
    """The tiny model's tokenizer trained into PATH, plus IMAGE_TOKEN (not yet saved):
    (tokenizer, image token id, end-of-sequence id, padding id)."""
    from transformers import AutoTokenizer

    tiny_model.train_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    ids = tok.convert_tokens_to_ids
    return tok, ids(IMAGE_TOKEN), ids("<|im_end|>"), ids("<|endoftext|>")


def picture(color: tuple[int, int, int], size: tuple[int, int] = (48, 40)) -> str:
    """A PNG of one colour with a lighter square in it, base64: a request's `image`."""
    from PIL import Image

    img = Image.new("RGB", size, color)
    img.paste(tuple(min(255, c + 120) for c in color), (8, 8, 24, 24))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def write_tiny_vision_model(out: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write the tiny BLIP-2 model to ``out`` and return its path.

    Deterministic for a seed. Refuses a non-empty directory that holds no model it made.
    """
    import torch
    from transformers import (
        Blip2ForConditionalGeneration,
        Blip2Processor,
        BlipImageProcessor,
        GenerationConfig,
    )

    path = tiny_model.prepare_dir(out, MARKER, "tiny vision model")
    tok, image_id, eos_id, pad_id = image_tokenizer(path)
    torch.manual_seed(seed)
    model = Blip2ForConditionalGeneration(_configs(image_id, eos_id, pad_id)).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    images = BlipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    Blip2Processor(image_processor=images, tokenizer=tok, num_query_tokens=QUERY_TOKENS).save_pretrained(str(path))
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(str(path))
    (path / MARKER).write_text(json.dumps({"seed": seed, "architecture": "Blip2ForConditionalGeneration",
                                           "query_tokens": QUERY_TOKENS}) + "\n")
    tiny_model.readable(path)
    return path
