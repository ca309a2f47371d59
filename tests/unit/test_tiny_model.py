from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from llmhost.tiny.model import write_tiny_model


def _digest(p: Path) -> str:
    return hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()


def test_deterministic_per_seed_and_loadable(tmp_path: Path):
    a = write_tiny_model(tmp_path / "a", seed=1)
    b = write_tiny_model(tmp_path / "b", seed=1)
    c = write_tiny_model(tmp_path / "c", seed=2)
    assert _digest(a) == _digest(b) != _digest(c)
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(a)
    assert cfg.model_type == "qwen2" and cfg.vocab_size == 4096
    tok = AutoTokenizer.from_pretrained(a)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"
    assert oct((a / "model.safetensors").stat().st_mode & 0o777) == "0o644"


def test_refuses_foreign_directory(tmp_path: Path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="refusing to overwrite"):
        write_tiny_model(tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep me"
