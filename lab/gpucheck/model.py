"""The model the GPU checks serve: the tiny model, or Qwen3-0.6B's shape with the tiny
model's tokenizer (random bf16 weights, 445M parameters).

``python -m lab.gpucheck.model KIND PATH`` writes it (``make_in_child`` runs that, so
that the CUDA memory making it takes is given back when the child exits).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

MAX_MODEL_LEN = 4096


# Qwen3 shapes but for the vocabulary (the tiny model's tokenizer has 4,096 tokens).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True},
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "tie_word_embeddings": False},
}


def make_model(kind: str, path: Path, seed: int = 0) -> dict[str, Any]:
    """The tiny model, or a shape of SHAPES with the tiny model's tokenizer (random bf16)."""
    from llmhost.tiny.model import write_tiny_model

    if (path / "config.json").exists():
        return json.loads((path / "config.json").read_text())
    if kind == "tiny":
        write_tiny_model(path, seed)
        return json.loads((path / "config.json").read_text())
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok_dir = path.with_name(path.name + "-tokenizer")
    write_tiny_model(tok_dir, seed)
    path.mkdir(parents=True, exist_ok=True)
    for f in tok_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors") and not f.name.startswith("."):
            shutil.copy2(f, path / f.name)
    tok = AutoTokenizer.from_pretrained(str(path))
    config = Qwen3Config(vocab_size=4096, **SHAPES[kind], max_position_embeddings=MAX_MODEL_LEN,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None,
                         torch_dtype="bfloat16")
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        if kind == "qwen3":
            model = Qwen3ForCausalLM(config).to(torch.bfloat16)
        else:  # made in float32 first, an 8B model would take 30 GB
            torch.set_default_dtype(torch.bfloat16)
            model = Qwen3ForCausalLM(config)
    model.save_pretrained(str(path), safe_serialization=True)
    del model
    for f in path.iterdir():
        f.chmod(0o644)
    return json.loads((path / "config.json").read_text())


def make_in_child(kind: str, path: Path) -> None:
    """make_model in a child process: CUDA memory this process took would stay held until it exits."""
    subprocess.run([sys.executable, "-m", "lab.gpucheck.model", kind, str(path)], check=True)


def main(argv: list[str] | None = None) -> int:
    kind, path = argv or sys.argv[1:]
    make_model(kind, Path(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
