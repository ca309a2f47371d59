"""Where an engine publishes its KV-cache events, and how a gateway finds them.

With the backend setting ``kv_events`` and a folder of engine sockets, each model
instance's engine publishes vLLM's KV-cache events (``kv_events_config``: a batch per
engine step of the blocks it stored, the blocks it evicted, or that it dropped them
all) on a ZMQ socket next to its engine socket, keeps its recent batches for a
subscriber that missed some to ask for again (vLLM's replay socket), and, once the
engine is up, writes a description beside them: their addresses and what a gateway
needs to tokenize a prompt as the engine does (the engine's tokenizer, its mode,
max_model_len).

- ``<version>-<instance>.sock``: the engine socket (llmhost.backend.stream_socket);
- ``<version>-<instance>.kv``: the events (ZMQ PUB over IPC, topic ``kv-events``);
- ``<version>-<instance>.kv.replay``: their replay (ZMQ ROUTER over IPC: the batches
  from a sequence number on, as far as the engine keeps them);
- ``<version>-<instance>.kv.json``: the description.

The gateway's ``kv_events`` routing (llmhost.gateway.routing.kvevents) reads them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TOPIC = "kv-events"
EVENTS_SUFFIX = ".kv"
REPLAY_SUFFIX = ".kv.replay"
DESCRIPTION_SUFFIX = ".kv.json"


def events_socket(engine_socket: Path) -> Path:
    """Where the engine of ENGINE_SOCKET publishes its events."""
    return engine_socket.with_suffix(EVENTS_SUFFIX)


def replay_socket(engine_socket: Path) -> Path:
    """Where the engine of ENGINE_SOCKET answers requests to replay its events."""
    return engine_socket.with_suffix(REPLAY_SUFFIX)


def description_path(engine_socket: Path) -> Path:
    """Where the description of ENGINE_SOCKET's events lies."""
    return engine_socket.with_suffix(DESCRIPTION_SUFFIX)


def events_config(engine_socket: Path) -> dict[str, Any]:
    """vLLM's kv_events_config (as model.json gives it) for the engine of ENGINE_SOCKET."""
    return {"enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"ipc://{events_socket(engine_socket)}",
            "replay_endpoint": f"ipc://{replay_socket(engine_socket)}", "topic": TOPIC}


def describe(engine_socket: Path, model_config: Any) -> dict[str, Any]:
    """The description of ENGINE_SOCKET's events, from its engine's vLLM ModelConfig."""
    return {
        "endpoint": f"ipc://{events_socket(engine_socket)}",
        "replay_endpoint": f"ipc://{replay_socket(engine_socket)}",
        "topic": TOPIC,
        "tokenizer": str(model_config.tokenizer),
        "tokenizer_mode": str(getattr(model_config, "tokenizer_mode", "auto")),
        "tokenizer_revision": getattr(model_config, "tokenizer_revision", None),
        "trust_remote_code": bool(getattr(model_config, "trust_remote_code", False)),
        "max_model_len": int(model_config.max_model_len),
    }


def write_description(engine_socket: Path, description: dict[str, Any]) -> None:
    """Write DESCRIPTION beside ENGINE_SOCKET whole (a reader never sees half of it), and
    open the events' sockets to the group, as the engine socket is (the engine bound them
    under the unit's umask)."""
    for events in (events_socket(engine_socket), replay_socket(engine_socket)):
        if events.exists():
            os.chmod(events, 0o660)
    path = description_path(engine_socket)
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(description, indent=1) + "\n")
    os.chmod(part, 0o640)
    os.replace(part, path)


def remove_description(engine_socket: Path) -> None:
    for path in (description_path(engine_socket), events_socket(engine_socket), replay_socket(engine_socket)):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def read_description(engine_socket: Path) -> dict[str, Any] | None:
    """The description beside ENGINE_SOCKET; None where there is none (its engine
    publishes no events) or it cannot be read."""
    try:
        found = json.loads(description_path(engine_socket).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or not isinstance(found.get("endpoint"), str) \
            or not isinstance(found.get("tokenizer"), str):
        return None
    return found
