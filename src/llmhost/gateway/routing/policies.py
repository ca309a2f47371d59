"""Which replica of a model takes a request: the routing policies.

A model's replicas are its routing targets at two levels: the upstreams (Triton
servers, one per host) where the model is ready, and, on an upstream of this host,
the model's engine sockets (one per model instance: one per GPU with ``KIND_GPU``,
or ``instance_count`` of them). Each level picks by the model's policy:

- ``cache_aware`` (the default for generative models): a request with a routing key
  goes to the first target in the key's order (rendezvous hashing: the targets
  sorted by a hash of key and target name) whose load is under the bound
  ``ceil(load_factor * (requests in flight + 1) / targets)``; consistent hashing
  with bounded loads. Requests that share their key (the same prompt prefix, or the
  same session) land on the replica whose prefix cache holds it, unless that one
  has more than its share; the next in the key's order takes the overflow (and so
  builds the same cache). The order depends only on the key and the target names,
  so every gateway worker and every gateway host picks the same replica without
  talking to the others; the load bound uses each one's own count of requests in
  flight. A request without a key goes to the least loaded target.
- ``kv_events``: among this host's engines, by what each engine's cache holds, as its
  KV-cache events tell (llmhost.gateway.routing.kvevents): the engine holding the
  longest run of the prompt's leading blocks, under the same load bound; among equals
  (and where no engine holds a block) the key's order decides, as ``cache_aware``. A
  remote upstream, a session hint, and the time before the events are followed: as
  ``cache_aware``.
- ``least_loaded``: the target with the fewest requests in flight.
- ``round_robin``: the targets in turn.

The routing key (``route_key``): a session hint where the client gave one (the
``x-session-id`` header; the OpenAI ``user`` field where ``session_user`` is set),
else the prompt's leading part: a chat's messages up to and including its first user
message (a conversation's later turns share it), or a completion prompt's start, cut
at ``prefix_chars`` characters (or ``prefix_chars / 4`` token ids). A prompt shorter
than that is its own key.

Each decision is counted by reason (``REASONS``): ``prefix`` or ``session`` (the
key's first choice), ``load_bound`` (its first choice was over the bound: a later one
took it), ``no_key`` (cache-aware, nothing to key on: least loaded), ``no_match``
(kv_events: no engine holds a block of the prompt: the key's order),
``least_loaded``, ``round_robin``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

CACHE_AWARE, KV_EVENTS, LEAST_LOADED, ROUND_ROBIN = "cache_aware", "kv_events", "least_loaded", "round_robin"
POLICIES = (CACHE_AWARE, KV_EVENTS, LEAST_LOADED, ROUND_ROBIN)
# The policies that key requests by their prompt prefix or session.
KEYED = (CACHE_AWARE, KV_EVENTS)
DEFAULT_POLICY = CACHE_AWARE
# The prompt's leading characters that make its key: about 256 tokens at 4 characters
# a token (16 of vLLM's 16-token KV-cache blocks). Prompts that share less than that
# gain little from landing together; prompts that share more (a document, a long
# system prompt, a conversation's first turn) share their key.
DEFAULT_PREFIX_CHARS = 1024
# The bound on a target's load, as a multiple of the mean (consistent hashing with
# bounded loads). A request sent past the bound lands where its prefix is not cached, so
# the bound should stop a hot key from taking a replica over, not even out the ordinary
# spread of keys: 1.5 lets two replicas split 75/25 before a key moves on (1.25 moved
# 5-11 % of a shared-prefix workload's requests and cost more than it balanced).
DEFAULT_LOAD_FACTOR = 1.5
SESSION_HEADER = "x-session-id"
# The most characters of a session hint that count (a longer one is cut).
MAX_SESSION_CHARS = 256
REASONS = ("prefix", "session", "load_bound", "no_key", "no_match", LEAST_LOADED, ROUND_ROBIN)

T = TypeVar("T")


@dataclass(frozen=True)
class RoutingSettings:
    """The gateway's routing settings (GatewayConfig's ``routing`` section)."""

    policy: str = DEFAULT_POLICY
    models: dict[str, str] = field(default_factory=dict)  # model name -> its policy, where not ``policy``
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    load_factor: float = DEFAULT_LOAD_FACTOR
    session_user: bool = False  # the OpenAI ``user`` field pins like the session header

    def policy_of(self, model: str) -> str:
        return self.models.get(model, self.policy)


@dataclass
class Route:
    """One request's routing: its model's policy, its key (None: none), the key's
    kind (``prefix`` or ``session``), the reason of the decision made for it, and
    (kv_events) how many of its prompt's leading blocks each target holds, by the
    target's name, for the level being chosen (None: not known)."""

    policy: str = LEAST_LOADED
    key: bytes | None = None
    kind: str = "prefix"
    load_factor: float = DEFAULT_LOAD_FACTOR
    reason: str | None = None
    matches: dict[str, int] | None = None
    # kv_events: the engine socket request whose prompt is matched, and the names of its
    # blocks by block size once found (llmhost.gateway.routing.kvevents).
    line: dict[str, Any] | None = None
    blocks: dict[int, list[bytes]] | None = None

    def decided(self, reason: str) -> None:
        """Note one level's REASON; a load-bound choice at any level is what the request records."""
        if self.reason != "load_bound":
            self.reason = reason


def _leading_messages(messages: list[dict[str, Any]]) -> list[list[Any]]:
    """A chat's messages up to and including its first user message: (role, content) each."""
    out: list[list[Any]] = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        out.append([role, message.get("content") if isinstance(message, dict) else message])
        if role == "user":
            break
    return out


def prompt_key_text(text_input: str | None, messages: list[dict[str, Any]] | None,
                    token_ids: list[int] | None, prefix_chars: int) -> str | None:
    """The leading part of a prompt that its routing key hashes; None: no prompt."""
    if messages:
        text = json.dumps(_leading_messages(messages), ensure_ascii=False, separators=(",", ":"), default=str)
        return text[:prefix_chars]
    if text_input:
        return text_input[:prefix_chars]
    if token_ids:
        return "ids:" + ",".join(map(str, token_ids[:max(1, prefix_chars // 4)]))
    return None


def route_key(model: str, prompt_text: str | None, session: str | None) -> tuple[bytes | None, str]:
    """(key, kind) for a request of MODEL: its session hint where given, else its prompt's leading part."""
    if session:
        material, kind = "session\0" + session[:MAX_SESSION_CHARS], "session"
    elif prompt_text:
        material, kind = "prefix\0" + prompt_text, "prefix"
    else:
        return None, "prefix"
    digest = hashlib.blake2b(f"{model}\0{material}".encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return digest, kind


def rendezvous_order(key: bytes, names: Sequence[str]) -> list[int]:
    """The indexes of NAMES in KEY's order: highest hash of (key, name) first. The
    order of one key over a set of names is the same in every process and on every
    host, and removing a name moves only the keys whose first choice it was."""
    def score(i: int) -> bytes:
        return hashlib.blake2b(key + b"\0" + names[i].encode("utf-8", "surrogatepass"), digest_size=8).digest()

    return sorted(range(len(names)), key=score, reverse=True)


def load_bound(loads: Sequence[int], load_factor: float) -> int:
    """The most requests in flight a target may have and still take one more."""
    return max(1, math.ceil(load_factor * (sum(loads) + 1) / len(loads)))


class Chooser:
    """Picks one of several targets for a route; keeps the round-robin turn."""

    def __init__(self) -> None:
        self._turns: dict[str, itertools.count[int]] = {}

    def choose(self, route: Route | None, turn: str, targets: Sequence[T], name: Callable[[T], str],
               load: Callable[[T], int]) -> T:
        """One of TARGETS (not empty) for ROUTE (None: least loaded), noting the reason
        on ROUTE. TURN names the round-robin turn (one per model and level)."""
        if len(targets) == 1 and (route is None or route.reason is not None):
            return targets[0]  # nothing to choose: the level above chose, and its reason stands
        policy = route.policy if route is not None else LEAST_LOADED
        if policy == ROUND_ROBIN:
            counter = self._turns.setdefault(turn, itertools.count())
            picked = sorted(targets, key=name)[next(counter) % len(targets)]
            reason = ROUND_ROBIN
        elif policy in KEYED and route is not None and route.key is not None:
            names = [name(t) for t in targets]
            loads = [load(t) for t in targets]
            bound = load_bound(loads, route.load_factor)
            order = rendezvous_order(route.key, names)
            # kv_events: the longest run of the prompt's blocks first; among equals the key's order.
            held = ([route.matches.get(n, 0) for n in names]
                    if policy == KV_EVENTS and route.matches is not None and route.kind == "prefix" else None)
            if held is not None:
                order.sort(key=lambda i: -held[i])
            first = next((i for i in order if loads[i] < bound), order[0])
            picked = targets[first]
            if first != order[0]:
                reason = "load_bound"
            elif held is not None:
                reason = "prefix" if held[first] > 0 else "no_match"
            else:
                reason = route.kind
        else:
            picked = min(targets, key=lambda t: (load(t), name(t)))
            reason = "no_key" if policy in KEYED else LEAST_LOADED
        if route is not None:
            route.decided(reason)
        return picked
