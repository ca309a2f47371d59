"""The tiny vision model (BLIP-2): deterministic per seed, loadable by transformers
with its processor, the <image> token in its tokenizer, written by `llmhost
tiny-vision-model`, and a foreign directory left alone."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from PIL import Image

from llmhost.cli import main
from llmhost.tiny.vision import IMAGE_SIZE, IMAGE_TOKEN, QUERY_TOKENS, VOCAB_SIZE, write_tiny_vision_model


def _digest(p: Path) -> str:
    return hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()


def test_deterministic_per_seed_loadable_and_written_by_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    a = write_tiny_vision_model(tmp_path / "a", seed=1)
    assert main(["tiny-vision-model", str(tmp_path / "b"), "--seed", "1"]) == 0
    assert f"wrote tiny vision model to {tmp_path / 'b'}" in capsys.readouterr().out
    c = write_tiny_vision_model(tmp_path / "c", seed=2)
    assert _digest(a) == _digest(tmp_path / "b") != _digest(c)
    from transformers import AutoConfig, AutoProcessor

    cfg = AutoConfig.from_pretrained(a)
    assert cfg.model_type == "blip-2" and cfg.architectures == ["Blip2ForConditionalGeneration"]
    assert cfg.num_query_tokens == QUERY_TOKENS and cfg.text_config.vocab_size == VOCAB_SIZE
    proc = AutoProcessor.from_pretrained(a)
    image_id = proc.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert image_id == cfg.image_token_index < VOCAB_SIZE
    batch = proc(images=Image.new("RGB", (50, 20), (9, 99, 199)), text="what is it", return_tensors="pt")
    assert tuple(batch["pixel_values"].shape) == (1, 3, IMAGE_SIZE, IMAGE_SIZE)
    # The processor puts the image's query tokens before the text.
    assert batch["input_ids"][0].tolist()[:QUERY_TOKENS] == [image_id] * QUERY_TOKENS
    assert oct((a / "model.safetensors").stat().st_mode & 0o777) == "0o644"
    # Written again over itself: allowed (the marker says llmhost made it).
    assert _digest(write_tiny_vision_model(a, seed=1)) == _digest(c.parent / "b")


def test_refuses_foreign_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="holds no tiny vision model made by llmhost; refusing to overwrite"):
        write_tiny_vision_model(tmp_path)
    assert main(["tiny-vision-model", str(tmp_path)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt"]
