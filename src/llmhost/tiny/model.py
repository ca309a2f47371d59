"""Generate a tiny, random Qwen2-style model with a locally trained tokenizer.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on the Python
standard library's own source files, the weights are random with a fixed seed.
The result is a real Hugging Face model directory that vLLM loads like any other.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A reasoning model's markers (the tokens vLLM's reasoning parsers look for, e.g.
# deepseek_r1 and qwen3), in the tokenizer of a model written with think=True.
THINK_TOKENS = ["<think>", "</think>"]
VOCAB_SIZE = 4096
# ChatML, the template Qwen2 models use, with Qwen2.5's tool calling (the format of
# vLLM's "hermes" tool parser): the tools listed in a system turn, an assistant's
# calls as <tool_call> JSON, a tool's result as a user turn in <tool_response>. A chat
# without tools renders as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MARKER = ".llmhost-tiny-model.json"


def _corpus_files(limit: int = 400) -> list[str]:
    """A fixed, sorted set of text files that every CPython install has."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))
    if not files:
        raise RuntimeError(f"no Python sources found under {stdlib} to train the tokenizer")
    return files[:limit]


def train_tokenizer(out: Path, think: bool = False) -> None:
    """Train the byte-level BPE tokenizer (ChatML template) and save it to ``out``; with
    THINK, THINK_TOKENS are special tokens too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS + (THINK_TOKENS if think else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _write_model(out: Path, seed: int, eos_id: int, pad_id: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(str(out))


def prepare_dir(out: str | os.PathLike[str], marker: str, what: str) -> Path:
    """``out`` made ready to write into: created, or empty, or holding MARKER (so
    something llmhost wrote before). Anything else is refused, untouched."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / marker).exists():
        raise ValueError(f"{path} is not empty and holds no {what} made by llmhost; refusing to overwrite it")
    path.mkdir(parents=True, exist_ok=True)
    return path


def readable(path: Path) -> None:
    """Every file of PATH readable by all: safetensors writes 0600, and the serving
    user must be able to read the weights."""
    for f in path.iterdir():
        f.chmod(0o644)


def write_tiny_model(out: str | os.PathLike[str], seed: int = 0, think: bool = False) -> Path:
    """Write the tiny model to ``out`` and return its path (THINK: its tokenizer has a
    reasoning model's <think> and </think> tokens).

    Deterministic for a seed: the same seed gives byte-identical weights.
    Refuses to write into a non-empty directory that is not a tiny model it made.
    """
    path = prepare_dir(out, MARKER, "tiny model")
    train_tokenizer(path, think)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    _write_model(path, seed, eos_id, pad_id)
    (path / MARKER).write_text(json.dumps({"seed": seed, "vocab_size": VOCAB_SIZE, "think": think}) + "\n")
    readable(path)
    return path
