"""Generate a tiny LoRA adapter (PEFT layout) for the tiny model, with no downloads.

The adapter targets every attention and MLP projection of the tiny model
(llmhost.tiny.model) with random A and B matrices of a fixed seed. B is not zero
(a freshly initialised PEFT adapter has B = 0 and changes nothing), and its scale
dwarfs the base weights, so greedy output with the adapter differs from without:
a test can see that the adapter was applied.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from llmhost.tiny import model as tiny_model

RANK = 8
ALPHA = 16
# Module -> (input features, output features), from tiny_model's Qwen2 configuration:
# hidden 256, 4 query heads and 2 key/value heads of 64, MLP 512.
_HIDDEN, _KV, _MLP = 256, 2 * 64, 512
SHAPES: dict[str, tuple[str, int, int]] = {
    "q_proj": ("self_attn", _HIDDEN, _HIDDEN),
    "k_proj": ("self_attn", _HIDDEN, _KV),
    "v_proj": ("self_attn", _HIDDEN, _KV),
    "o_proj": ("self_attn", _HIDDEN, _HIDDEN),
    "gate_proj": ("mlp", _HIDDEN, _MLP),
    "up_proj": ("mlp", _HIDDEN, _MLP),
    "down_proj": ("mlp", _MLP, _HIDDEN),
}
LAYERS = 4
MARKER = ".llmhost-tiny-lora.json"


def adapter_config(base_model: str = "") -> dict[str, object]:
    """PEFT's adapter_config.json for the tiny adapter."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted(SHAPES),
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def write_tiny_lora(out: str | os.PathLike[str], seed: int = 1, base_model: str = "") -> Path:
    """Write the adapter (adapter_config.json, adapter_model.safetensors) to ``out``.

    Deterministic for a seed. Refuses a non-empty directory that holds no adapter it made.
    """
    import torch
    from safetensors.torch import save_file

    path = tiny_model.prepare_dir(out, MARKER, "tiny adapter")
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        for module, (block, fan_in, fan_out) in SHAPES.items():
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(RANK, fan_in, generator=gen) * 0.1).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, RANK, generator=gen) * 0.1).to(torch.bfloat16)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(adapter_config(base_model), indent=2) + "\n")
    (path / MARKER).write_text(json.dumps({"seed": seed, "base": "llmhost tiny model",
                                           "vocab_size": tiny_model.VOCAB_SIZE}) + "\n")
    tiny_model.readable(path)
    return path
