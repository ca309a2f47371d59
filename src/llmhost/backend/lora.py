"""LoRA adapters: model.json's ``enable_lora``, the ``multi_lora.json`` beside it,
and a request's ``lora_name``.

As NVIDIA's vllm_backend: ``multi_lora.json`` is a JSON object mapping adapter
names to adapter directories (PEFT layout: adapter_config.json plus weights), read
only when ``enable_lora`` is true; a request picks one by name with the sampling
parameter ``lora_name``. Each name gets a fixed integer id (its place in the file,
from 1), which vLLM uses to cache the adapter's weights.

Unlike vllm_backend, the file is checked when the model loads: a bad file, a missing
directory, or an adapter whose rank exceeds ``max_lora_rank`` fails the load with a
message naming the file and the entry, not the first request that uses it.

The adapters' names are published in config.pbtxt's parameter ``lora_adapters`` (a
JSON list of names, written by llmhost's template beside multi_lora.json), where the
gateway reads them over Triton's API to serve each adapter as a model of its own. A
config.pbtxt whose list is not the names multi_lora.json gives fails the load, so
that no gateway is told of an adapter the model does not serve.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmhost.backend.config import Adapter, ConfigError, ModelConfig
from llmhost.backend.errors import RequestError, shown

MULTI_LORA_JSON = "multi_lora.json"
ADAPTER_CONFIG = "adapter_config.json"
LORA_NAME = "lora_name"
# vllm_backend's sentence for a request naming an adapter while LoRA is off.
NOT_ENABLED = "LoRA feature is not enabled."
# vLLM's default max_lora_rank (LoRAConfig.max_lora_rank).
DEFAULT_MAX_LORA_RANK = 16
MAX_NAME_CHARS = 256
# config.pbtxt's parameter that publishes the adapters' names (a JSON list of strings).
ADAPTERS_PARAMETER = "lora_adapters"
_NAME = re.compile(r"[^\x00-\x1f\x7f]+")


def lora_enabled(engine_args: dict[str, Any]) -> bool:
    """model.json's enable_lora: true/false, or vllm_backend's strings "true"/"false"."""
    value = engine_args.get("enable_lora", False)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ConfigError(f"model.json: 'enable_lora' must be true or false, got {value!r}")


def _max_rank(engine_args: dict[str, Any]) -> int:
    value = engine_args.get("max_lora_rank", DEFAULT_MAX_LORA_RANK)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"model.json: 'max_lora_rank' must be an integer, got {value!r}")
    return value


def _adapter_rank(path: Path, where: str) -> int:
    """The rank r of the adapter in PATH (its adapter_config.json)."""
    config_file = path / ADAPTER_CONFIG
    try:
        raw = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: {path} holds no {ADAPTER_CONFIG} (not a LoRA adapter directory)") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {config_file}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: {config_file} is not valid JSON: {exc}") from None
    rank = raw.get("r") if isinstance(raw, dict) else None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{where}: {config_file} has no LoRA rank 'r' (a positive integer), got {shown(rank)}")
    return rank


def parse_multi_lora(raw: Any, source: Path, max_rank: int) -> list[Adapter]:
    """The adapters of multi_lora.json's content RAW (read from SOURCE; relative
    directories are taken from SOURCE's directory)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} must hold a JSON object mapping adapter names to adapter directories, "
                          f"got {type(raw).__name__}")
    if not raw:
        raise ConfigError(f"{source} names no adapter; enable_lora needs at least one")
    adapters = []
    for int_id, (name, directory) in enumerate(raw.items(), start=1):
        where = f"{source}, adapter {name!r}"
        if not name.strip() or len(name) > MAX_NAME_CHARS or not _NAME.fullmatch(name):
            raise ConfigError(f"{source}: adapter name {name!r} must be 1 to {MAX_NAME_CHARS} printable characters")
        if not isinstance(directory, str) or not directory.strip():
            raise ConfigError(f"{where}: the adapter directory must be a non-empty string, got {shown(directory)}")
        path = Path(directory)
        if not path.is_absolute():
            path = source.parent / path
        if not path.is_dir():
            raise ConfigError(f"{where}: {path} is not a directory")
        rank = _adapter_rank(path, where)
        if rank > max_rank:
            raise ConfigError(f"{where}: the adapter's rank {rank} exceeds max_lora_rank {max_rank}; "
                              "raise max_lora_rank in model.json")
        adapters.append(Adapter(name=name, int_id=int_id, path=str(path)))
    return adapters


def load_adapters(model_json: Path, engine_args: dict[str, Any]) -> tuple[list[Adapter], str]:
    """The adapters a model serves and a line for the log: those of the
    multi_lora.json beside MODEL_JSON when enable_lora is true, else none."""
    source = model_json.parent / MULTI_LORA_JSON
    if not lora_enabled(engine_args):
        note = f"{source} is ignored: model.json does not set enable_lora" if source.exists() else ""
        return [], note
    max_rank = _max_rank(engine_args)
    try:
        text = source.read_text()
    except FileNotFoundError:
        raise ConfigError(f"model.json sets enable_lora, but {source} does not exist: it must map adapter "
                          "names to adapter directories") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {source}: {exc}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source} is not valid JSON: {exc}") from None
    adapters = parse_multi_lora(raw, source, max_rank)
    return adapters, f"LoRA adapters from {source}: {', '.join(a.name for a in adapters)}"


def with_adapters(config: ModelConfig, model_json: Path) -> tuple[ModelConfig, str]:
    """CONFIG with its adapters, and enable_lora as vLLM takes it (a bool)."""
    adapters, note = load_adapters(model_json, config.engine_args)
    engine_args = dict(config.engine_args)
    if "enable_lora" in engine_args:
        engine_args["enable_lora"] = lora_enabled(engine_args)
    return replace(config, engine_args=engine_args, adapters=tuple(adapters)), note


def check_published(model_config: dict[str, Any], adapters: tuple[Adapter, ...]) -> None:
    """Fail when config.pbtxt's ADAPTERS_PARAMETER, where it is set, does not list
    exactly the names of ADAPTERS (in multi_lora.json's order)."""
    entry = (model_config.get("parameters") or {}).get(ADAPTERS_PARAMETER)
    if not isinstance(entry, dict):
        return
    text = str(entry.get("string_value", ""))
    try:
        published = json.loads(text) if text.strip() else []
    except json.JSONDecodeError:
        published = None
    names = [a.name for a in adapters]
    if published != names:
        raise ConfigError(f"config.pbtxt's parameter '{ADAPTERS_PARAMETER}' must be the JSON list of the adapter "
                          f"names the model serves ({json.dumps(names)}, from {MULTI_LORA_JSON} with enable_lora), "
                          f"got {shown(text)}")


def request_lora_name(params: dict[str, Any]) -> str | None:
    """Take the sampling parameter lora_name out of PARAMS and check its type."""
    if LORA_NAME not in params:
        return None
    value = params.pop(LORA_NAME)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_NAME_CHARS:
        raise RequestError(f"sampling parameter '{LORA_NAME}' must be an adapter's name "
                           f"(1 to {MAX_NAME_CHARS} characters), got {shown(value)}")
    return value


def find_adapter(name: str, adapters: tuple[Adapter, ...]) -> Adapter:
    """The adapter a request names, or the client's error (no adapters: LoRA is off)."""
    if not adapters:
        raise RequestError(f"{NOT_ENABLED} This model serves no LoRA adapters (model.json does not set "
                           f"enable_lora), so sampling parameter '{LORA_NAME}' cannot be used; got {shown(name)}")
    for adapter in adapters:
        if adapter.name == name:
            return adapter
    # vllm_backend's sentence first (clients may match on it), then which parameter and where names come from.
    given = name if _NAME.fullmatch(name) else shown(name)
    raise RequestError(f"LoRA {given} is not supported, we currently support {[a.name for a in adapters]}; "
                       f"sampling parameter '{LORA_NAME}' must name an adapter of the model's {MULTI_LORA_JSON}")


def lora_request(adapter: Adapter) -> Any:
    """vLLM's LoRARequest for ADAPTER (a fixed id per name)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.name, lora_int_id=adapter.int_id, lora_path=adapter.path)
