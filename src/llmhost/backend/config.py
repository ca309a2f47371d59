"""model.json: vLLM engine arguments plus llmhost's own serving settings.

A model's ``model.json`` is a JSON object whose keys are vLLM
``AsyncEngineArgs`` fields, plus one key ``llmhost`` holding the settings that
belong to this backend (defaults that vLLM gets wrong for a server, limits, drain).
It is read from the version directory Triton loads (``<model>/<version>/model.json``,
where NVIDIA's vllm_backend keeps it) or else from the model directory
(``<model>/model.json``, where llmhost's templates write it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

SETTINGS_KEY = "llmhost"
MODEL_JSON = "model.json"


class ConfigError(ValueError):
    """model.json is missing, unreadable or holds a bad value."""


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter of multi_lora.json (llmhost.backend.lora): its name, vLLM's integer
    id for it, and its directory."""

    name: str
    int_id: int
    path: str


@dataclass(frozen=True)
class BackendSettings:
    # vLLM's own default is 16 tokens, which cuts answers short (a top complaint
    # of NVIDIA's backend's users); a server wants a real default.
    default_max_tokens: int = 512
    # Largest n (parallel completions) one request may ask for.
    max_n: int = 8
    # On unload, wait this long for in-flight requests before aborting them.
    drain_timeout_s: float = 30.0
    # How often (seconds) one request's cancellation is checked with tritonserver.
    cancel_check_interval_s: float = 0.25
    # Include the prompt in non-streaming text_output (NVIDIA backend's default).
    exclude_input_in_output: bool = False
    # Push aggregated metrics to tritonserver this often (seconds).
    metrics_interval_s: float = 1.0
    # Threads sending responses to tritonserver. Each send waits for tritonserver
    # to take the response; several threads keep several sends in flight.
    response_threads: int = 1
    # 0 (as NVIDIA's vllm_backend): every engine step of a stream is sent at once,
    # one response each. Above 0: a stream's deltas are held up to this long (ms)
    # and sent as one response (fewer round trips under load); a stream's first and
    # last responses never wait. A request may choose its own (request.py).
    stream_interval_ms: float = 0.0
    # Largest prompt a request may send, in bytes: text_input's UTF-8 bytes, or the
    # UTF-8 bytes of all messages' contents. Checked before tokenizing. 0: derived
    # from the engine, max_model_len x the longest token in characters (the bound
    # vLLM's own server puts on a prompt's characters) x 4 bytes (UTF-8's longest
    # character), so no prompt that could fit the context is refused.
    max_prompt_bytes: int = 0
    # Threads tokenizing prompts and rendering chat templates, off the engine's
    # event loop. Prompts over 64 KiB use at most all but one of them, so a few
    # huge prompts never hold up small ones.
    tokenizer_threads: int = 4
    # When vLLM's engine dies after start (EngineCore killed, CUDA error), fail
    # every request and stop tritonserver, so its supervisor restarts it. false:
    # the model only answers errors (and Triton still calls it ready) until the
    # server is restarted by hand; for a server whose other models must not restart.
    exit_server_on_engine_death: bool = True
    # Seconds vLLM's engine may hold requests without handing back anything (an
    # output, a step's statistics) before it counts as hung: a stuck GPU kernel or
    # collective, a deadlocked or stopped EngineCore. It is then handled as a dead
    # one (exit_server_on_engine_death, ENABLE_VLLM_HEALTH_CHECK). A healthy engine
    # hands something back every step; its longest silence is one step, or, with the
    # model's metrics off, one prompt's whole chunked prefill (seconds, a minute for
    # the longest contexts on a slow GPU): 300 s stays far above that. 0: off.
    engine_hang_timeout_s: float = 300.0
    # The GPUs (CUDA_VISIBLE_DEVICES, e.g. "2,3") of a model served KIND_MODEL, set
    # before vLLM starts; the roles write the model's `gpus` here. "": the server's.
    # Under KIND_GPU Triton pins each instance to one GPU itself.
    visible_gpus: str = ""
    # How vLLM starts its engine process (EngineCore) and workers from this stub:
    # "spawn" runs them in a fresh python3 (the venv's: the first on PATH), as vLLM's
    # own server does on CUDA; "fork" copies the stub's process, which runs Python on
    # the stub's embedded libpython (VLLM_WORKER_MULTIPROC_METHOD).
    engine_start_method: str = "spawn"
    # true: push the metrics before each request's final response (or error), so
    # that a client reading /metrics right after its answer finds it counted, as
    # NVIDIA's vllm_backend records them per engine step. It costs round trips to
    # tritonserver per request: on an H100 at 16/64/256 streams the Triton path made
    # 1.13/1.28/1.38x the tokens/s without it (docs/performance.md). false: every
    # metrics_interval_s, which a Prometheus scrape (15 s) never notices.
    fresh_metrics: bool = False
    # KIND_CPU: once the engine is up, move tritonserver's and this stub's threads
    # off the cores vLLM bound its workers to, and vLLM's scheduler onto them
    # (llmhost.backend.cpus). Every token passes through the serving threads; on the
    # workers' cores they stall engine steps. Opt-in: with it on, the system test that
    # stops one of two CPU hosts sharing a 2-core machine saw the model not unload
    # within tritonserver's exit timeout (docs/performance.md).
    pin_frontend_cpus: bool = False
    # The vLLM tool parser (vLLM's --tool-call-parser, e.g. "hermes") that finds tool
    # calls in a chat's output: requests with `tools` and tool_choice auto, required or a
    # named function need one. "": none; tools are only shown to the chat template.
    # The reasoning parser is vLLM's own engine argument `reasoning_parser`.
    tool_parser: str = ""
    # Publish the engine's KV-cache events (vLLM's kv_events_config: the blocks each
    # step stores and evicts) on a ZMQ socket next to the engine socket, where a
    # folder of engine sockets is set, and describe where beside it
    # (llmhost.gateway.routing.kvevents): for a gateway routing by them, the
    # ``kv_events`` policy. Off: the events cost the engine a little each step.
    kv_events: bool = False
    # A model spread over several hosts (vLLM's multi-node runtime: model.json's
    # nnodes, node_rank 0, master_addr, master_port and the layout): the addresses of
    # the other hosts, where `llmhost follow` runs the worker side, separated by
    # commas. The engine must keep a connection to each; once one is gone for
    # follower_grace_s, the engine is handled as dead (exit_server_on_engine_death),
    # so the model reads not ready at once and loads again when the follower is back.
    followers: str = ""
    # Seconds a follower may have no connection to this host's engine before the
    # engine counts as dead.
    follower_grace_s: float = 2.0
    # This host's address on the network the model's hosts share (vLLM's
    # VLLM_HOST_IP), set before vLLM starts. "": vLLM's own guess, which on a host
    # with several interfaces may be the wrong one.
    host_ip: str = ""


@dataclass(frozen=True)
class ModelConfig:
    engine_args: dict[str, Any]
    settings: BackendSettings
    # LoRA adapters from multi_lora.json, when enable_lora is true (llmhost.backend.lora).
    adapters: tuple[Adapter, ...] = field(default=())


# Upper bounds where a larger value is surely a mistake (a typo of units, a runaway thread count).
MAXIMA: dict[str, float] = {"response_threads": 64, "stream_interval_ms": 1000.0, "tokenizer_threads": 64}
# visible_gpus: "" or GPU ids separated by commas.
_GPU_LIST = re.compile(r"(?:\d+(?:,\d+)*)?")
# String settings holding a name (checked against vLLM's registry when the engine starts).
NAMES = ("tool_parser",)
_NAME = re.compile(r"[A-Za-z0-9_.-]*")
# String settings holding host names or addresses, separated by commas.
ADDRESSES = ("followers", "host_ip")
_ADDRESS_LIST = re.compile(r"(?:[A-Za-z0-9_.:-]+(?:,[A-Za-z0-9_.:-]+)*)?")
# String settings with a fixed set of values.
CHOICES: dict[str, tuple[str, ...]] = {"engine_start_method": ("spawn", "fork")}
# Integer settings whose smallest value is not 1.
MINIMA: dict[str, int] = {"max_prompt_bytes": 0}


def _check_setting(name: str, value: Any, default: Any) -> Any:
    value = _check_type(name, value, default)
    limit = MAXIMA.get(name)
    if limit is not None and value > limit:
        raise ConfigError(f"model.json: llmhost.{name} must be <= {limit:g}, got {value:g}")
    return value


def _check_type(name: str, value: Any, default: Any) -> Any:
    if name in CHOICES:
        if not isinstance(value, str) or value not in CHOICES[name]:
            raise ConfigError(f"model.json: llmhost.{name} must be one of {', '.join(CHOICES[name])}, "
                              f"got {value!r}")
        return value
    if name in NAMES:
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise ConfigError(f"model.json: llmhost.{name} must be a parser's name (letters, digits, _ . -) "
                              f"or \"\", got {value!r}")
        return value
    if name in ADDRESSES:
        if not isinstance(value, str) or not _ADDRESS_LIST.fullmatch(value):
            raise ConfigError(f"model.json: llmhost.{name} must be host names or addresses separated by commas "
                              f"(e.g. \"10.0.0.2,10.0.0.3\") or \"\", got {value!r}")
        return value
    if isinstance(default, str):
        if not isinstance(value, str) or not _GPU_LIST.fullmatch(value):
            raise ConfigError(f"model.json: llmhost.{name} must be GPU ids separated by commas "
                              f"(e.g. \"2,3\") or \"\", got {value!r}")
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"model.json: llmhost.{name} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"model.json: llmhost.{name} must be an integer, got {value!r}")
        least = MINIMA.get(name, 1)
        if value < least:
            raise ConfigError(f"model.json: llmhost.{name} must be >= {least}, got {value}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"model.json: llmhost.{name} must be a number, got {value!r}")
    if value < 0:
        raise ConfigError(f"model.json: llmhost.{name} must be >= 0, got {value}")
    return float(value)


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError("model.json must hold a JSON object")
    engine_args = {k: v for k, v in raw.items() if k != SETTINGS_KEY}
    if "model" not in engine_args or not isinstance(engine_args["model"], str):
        raise ConfigError("model.json: 'model' (the weights directory or model id) is required")
    given = raw.get(SETTINGS_KEY, {})
    if not isinstance(given, dict):
        raise ConfigError("model.json: 'llmhost' must be an object")
    defaults = BackendSettings()
    known = {f.name for f in fields(BackendSettings)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(f"model.json: unknown llmhost setting(s) {unknown}; known: {sorted(known)}")
    values = {k: _check_setting(k, v, getattr(defaults, k)) for k, v in given.items()}
    return ModelConfig(engine_args=engine_args, settings=BackendSettings(**values))


def load_model_config(path: Path) -> ModelConfig:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    return parse_model_config(raw)


def model_json_candidates(model_dir: Path, version: str) -> list[Path]:
    """Where model.json may be, in precedence order: the version directory first."""
    candidates = [model_dir / MODEL_JSON]
    if version:
        candidates.insert(0, model_dir / version / MODEL_JSON)
    return candidates


def locate_model_json(model_dir: Path, version: str) -> tuple[Path, list[Path]]:
    """The model.json to read for ``version`` and those that exist but lose to it."""
    candidates = model_json_candidates(model_dir, version)
    present = [p for p in candidates if p.exists()]
    if not present:
        raise ConfigError(f"no model.json: looked for {' and '.join(str(p) for p in candidates)}")
    return present[0], present[1:]
