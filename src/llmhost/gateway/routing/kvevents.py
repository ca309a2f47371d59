"""Routing by the engines' own KV-cache events: the ``kv_events`` policy.

Each engine of a model on this host publishes, per step, the KV-cache blocks it stored
and evicted (vLLM's ``kv_events_config``; the backend's ``kv_events`` setting puts the
publisher next to the engine socket: llmhost.kv_events.sockets). The gateway follows
every engine's events and keeps, per engine, the blocks its cache holds, each named by
a hash of its tokens chained over the blocks before it (``chain_hash``): a block is
the same wherever the same tokens lead to it, whatever hash the engine itself gave it.

A request's prompt is tokenized as the engine will (``PromptTokens``: the engine's
tokenizer, the model's chat template with the request's tools and template arguments;
a prompt given as token ids as it is), cut into the engine's blocks and named the same
way; each engine's match is how many of the prompt's leading blocks its cache
holds. The policy (llmhost.gateway.routing.policies) sends the request to the engine
with the longest match whose load is under the bound; among equals, and where no
engine holds a block, the prompt's key decides as in ``cache_aware``, so a prefix whose
blocks were evicted everywhere goes back to its home instead of to whoever is idle
(which, with caches that evict much, spread each prefix over every engine: measured in
docs/performance.md).

Each batch carries a sequence number. Where the engine's publisher keeps its recent
batches for replay (the backend gives it a replay socket: ``replay_endpoint`` in the
description), the gateway asks it for every batch it keeps as it starts following (a
gateway started after the engine learns what its cache already holds), and for the
batches it missed whenever the sequence skips some (ZMQ drops them for a slow reader).
What it does not know: batches older than the publisher keeps (vLLM's ``buffer_steps``,
10,000 steps), or lost where the engine keeps none: those blocks match nowhere, or,
evicted, somewhere they no longer are, and the request is served all the same. An
engine that restarts starts its events' sequence again: its blocks are then
forgotten. The policy applies among this
host's engines, whether the sockets of one upstream or upstreams of this host; with a
remote upstream among the candidates it routes as ``cache_aware`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmhost.kv_events.sockets import read_description

ROOT = bytes(16)
# The most tokens of a prompt the routing looks at: past them a longer match changes
# little, and hashing them costs the gateway.
MAX_ROUTED_TOKENS = 32768
# A replay that sends nothing for this long is given up (the engine stopped meanwhile).
REPLAY_TIMEOUT_S = 5.0
# A replay comes in one go: this long without a batch once some came, and the rest was dropped.
REPLAY_QUIET_S = 1.0
# Replayed batches applied between two turns of the event loop.
REPLAY_YIELD_EVERY = 256
# At most one log line a minute per engine about the batches it replayed.
REPLAY_LOG_EVERY_S = 60.0


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a block of TOKENS that follows the block named PARENT (ROOT: first)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def _digest(payload: bytes) -> bytes:
    """What tells a batch from another of the same sequence number (its time is in it)."""
    return hashlib.blake2b(payload, digest_size=8).digest()


def prompt_blocks(ids: Sequence[int], block_size: int) -> list[bytes]:
    """The names of the full blocks of a prompt of token IDS."""
    out: list[bytes] = []
    parent = ROOT
    end = min(len(ids), MAX_ROUTED_TOKENS) // block_size * block_size
    for start in range(0, end, block_size):
        parent = chain_hash(parent, ids[start:start + block_size])
        out.append(parent)
    return out


class EngineBlocks:
    """The blocks one engine's cache holds, as its events told."""

    def __init__(self) -> None:
        self.names: dict[Any, bytes] = {}  # the engine's block hash -> the block's name
        self.held: dict[bytes, int] = {}  # name -> how many of the engine's blocks have it
        self.block_size = 0
        self.last_seq = -1
        self.replay_said = -REPLAY_LOG_EVERY_S  # when a replay of missed batches was last logged

    def clear(self) -> None:
        self.names.clear()
        self.held.clear()

    def missed(self, seq: int) -> int | None:
        """Before the batch SEQ: the first batch missed before it, None where none was
        (one not after the last means the engine started again: its cache is forgotten,
        and its sequence starts over)."""
        if seq <= self.last_seq:
            self.clear()
            self.last_seq = -1
        return self.last_seq + 1 if seq > self.last_seq + 1 else None

    def apply(self, events: Sequence[Any]) -> None:
        """One batch's events (vLLM's BlockStored, BlockRemoved, AllBlocksCleared)."""
        for event in events:
            kind = type(event).__name__
            offloaded = getattr(event, "medium", None) not in (None, "GPU")
            if offloaded or getattr(event, "group_idx", None) not in (None, 0):
                continue  # an offloaded copy, or another KV-cache group's blocks
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                for block in event.block_hashes:
                    name = self.names.pop(block, None)
                    if name is not None:
                        self._drop(name)
            elif kind == "AllBlocksCleared":
                self.clear()

    def _stored(self, event: Any) -> None:
        size = int(event.block_size)
        if event.parent_block_hash is None:
            parent: bytes | None = ROOT
        else:
            parent = self.names.get(event.parent_block_hash)
        if parent is None or size <= 0:
            return  # follows a block never heard of: its tokens' place is unknown
        self.block_size = size
        tokens = event.token_ids
        for i, block in enumerate(event.block_hashes):
            parent = chain_hash(parent, tokens[i * size:(i + 1) * size])
            if block not in self.names:
                self.names[block] = parent
                self.held[parent] = self.held.get(parent, 0) + 1

    def _drop(self, name: bytes) -> None:
        left = self.held.get(name, 0) - 1
        if left > 0:
            self.held[name] = left
        else:
            self.held.pop(name, None)

    def matched(self, blocks: Sequence[bytes]) -> int:
        """How many of BLOCKS, from the first, this engine holds."""
        n = 0
        for name in blocks:
            if name not in self.held:
                break
            n += 1
        return n


def _check_thread_scheduling() -> None:
    """libzmq's I/O thread sets its own scheduling as it starts (pthread_setschedparam, to
    what it already is) and aborts the whole process where the system refuses that (a
    seccomp filter such as systemd's ``SystemCallFilter=~@resources``): ask the same for
    this thread first, and raise where it is refused."""
    try:
        os.sched_setscheduler(0, os.sched_getscheduler(0), os.sched_getparam(0))
    except OSError as exc:
        raise PermissionError(exc.errno, "this process may not set its threads' scheduling (sched_setscheduler), "
                              "which libzmq's I/O thread does as it starts") from exc


def _load_decoder() -> tuple[Any, Any]:
    """(pyzmq's asyncio module, a decoder of vLLM's event batches), imported off the event
    loop, where libzmq can start its I/O thread."""
    _check_thread_scheduling()
    import msgspec
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch

    return zmq.asyncio, msgspec.msgpack.Decoder(type=KVEventBatch)


def _load_tokenizer(description: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(description["tokenizer"], revision=description.get("tokenizer_revision"),
                                         trust_remote_code=bool(description.get("trust_remote_code")))


class PromptTokens:
    """A request's prompt as token ids, as the engine's tokenizer and chat template make
    them, on a pool of threads (each with its own copy of the tokenizer). Requests the
    engine renders otherwise (pictures, contents given as parts) are not tokenized: they
    route by their key."""

    def __init__(self, tokenizer: Any, threads: int) -> None:
        import concurrent.futures
        import threading

        self._original = tokenizer
        self._local = threading.local()
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, threads), "llmhost-route-tokenize")

    def _tokenizer(self) -> Any:
        import copy

        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self._original)
        return tok

    def ids(self, inputs: dict[str, Any]) -> list[int] | None:
        """The token ids of an engine socket request's INPUTS; None where not told here."""
        if inputs.get("image"):
            return None
        given = inputs.get("prompt_token_ids")
        if isinstance(given, list):
            return [int(t) for t in given]
        tok = self._tokenizer()
        if isinstance(inputs.get("text_input"), str):
            return list(tok.encode(inputs["text_input"], add_special_tokens=True))
        messages = json.loads(inputs["messages"]) if isinstance(inputs.get("messages"), str) else None
        if not isinstance(messages, list) or any(not isinstance(m, dict) or not isinstance(m.get("content", ""), str)
                                                 for m in messages):
            return None
        sampling = json.loads(inputs.get("sampling_parameters") or "{}")
        extra = sampling.get("chat_template_kwargs") if isinstance(sampling, dict) else None
        tools = sampling.get("tools") if isinstance(sampling, dict) else None
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       **({"tools": tools} if tools else {}),
                                       **({k: v for k, v in extra.items() if k not in ("tokenize", "chat_template")}
                                          if isinstance(extra, dict) else {}))
        return list(tok.encode(text, add_special_tokens=False))

    async def encode(self, inputs: dict[str, Any]) -> list[int] | None:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self.ids, inputs)
        except Exception:  # noqa: BLE001 - a prompt the template refuses: the engine will say so; it routes by key
            return None


def _to_stderr(line: str) -> None:
    print(f"llmhost gateway: {line}", file=sys.stderr, flush=True)


class KvEventsIndex:
    """The engines of this host, followed by their events: their blocks, and each
    model's tokenizer as its engines describe it."""

    def __init__(self, tokenizer_threads: int = 2, log: Callable[[str], None] = _to_stderr) -> None:
        self.engines: dict[Path, EngineBlocks] = {}
        self.log = log
        self.tokenizer_threads = tokenizer_threads
        self._followers: dict[Path, asyncio.Task[None]] = {}
        self._described: dict[Path, dict[str, Any]] = {}  # each followed engine's description
        self._caught_up: set[Path] = set()  # engines whose kept events were replayed (or that keep none)
        self._decoder: asyncio.Task[tuple[Any, Any]] | None = None
        self._encoders: dict[str, asyncio.Task[PromptTokens]] = {}
        self._context: Any = None

    def follow(self, sockets: Sequence[Path]) -> bool:
        """Follow the events of each of SOCKETS' engines (from now on); whether every one
        of them is followed already (its engine describes its events, the decoder is
        loaded, and what the engine kept of its earlier events is read)."""
        if self._decoder is None:
            self._decoder = asyncio.create_task(asyncio.to_thread(_load_decoder))
            self._decoder.add_done_callback(self._decoder_loaded)
        if self._decoder.done() and (self._decoder.cancelled() or self._decoder.exception() is not None):
            return False  # no vLLM to read the events with (logged once): requests route by their key
        ready = self._decoder.done()
        for socket in sockets:
            task = self._followers.get(socket)
            if task is not None and not task.done():
                continue
            description = read_description(socket)
            if description is None:
                ready = False
                continue
            self.engines[socket] = EngineBlocks()
            self._described[socket] = description
            self._caught_up.discard(socket)
            task = self._followers[socket] = asyncio.create_task(self._follow(socket, description))
            task.add_done_callback(lambda t, s=socket: self._stopped(s, t))
            ready = False
        return ready and all(s in self._caught_up for s in sockets)

    def _decoder_loaded(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.log(f"KV-cache events cannot be read here ({type(exc).__name__}: {exc}); "
                     "kv_events routes as cache_aware")

    def _stopped(self, socket: Path, task: asyncio.Task[None]) -> None:
        """A follower ended other than by close(): said (unless the decoder could not load:
        said once already), and followed again at the next look."""
        if task.cancelled() or (exc := task.exception()) is None:
            return
        decoder = self._decoder
        if decoder is not None and decoder.done() and not decoder.cancelled() and decoder.exception() is not None:
            return
        self.log(f"KV-cache events of {socket}: stopped following ({type(exc).__name__}: {exc})")

    def prepare(self, sockets: Sequence[Path]) -> None:
        """Follow SOCKETS' engines and load their model's tokenizer, ahead of the first request."""
        if not sockets:
            return
        self.follow(sockets)
        if (description := self._described.get(sockets[0])) is not None:
            self._encoder(description)

    async def _follow(self, socket: Path, description: dict[str, Any]) -> None:
        assert self._decoder is not None
        zmq_asyncio, decoder = await self._decoder
        if self._context is None:
            self._context = zmq_asyncio.Context()
        import zmq

        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, str(description.get("topic", "")).encode())
        sub.connect(description["endpoint"])
        replay = description.get("replay_endpoint")
        replay = replay if isinstance(replay, str) and replay else None
        blocks = self.engines[socket]
        said = False
        # The batches a replay applied (sequence number -> digest): the subscription
        # receives them too, next, unless the engine started again meanwhile.
        replayed: dict[int, bytes] = {}
        try:
            if replay is not None:  # what the engine's cache holds already, as far as its publisher keeps
                await self._replay(socket, replay, 0, blocks, decoder, replayed)
                if replayed:
                    said = True
                    self.log(f"KV-cache events of {socket}: following ({len(blocks.held)} blocks held, "
                             f"{len(replayed)} batches replayed)")
            self._caught_up.add(socket)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if replayed:
                    if replayed.get(seq) == _digest(frames[2]):
                        continue
                    replayed.clear()  # past the replayed ones: no more of them come
                first = blocks.missed(seq)
                if first is not None and replay is not None:
                    oldest = await self._replay(socket, replay, first, blocks, decoder, replayed)
                    self._say_replayed(socket, blocks, first, seq, oldest)
                    if replayed.get(seq) == _digest(frames[2]):  # this batch came with the replay
                        continue
                self._apply(socket, blocks, decoder, frames[2])
                blocks.last_seq = seq
                if not said:  # the first batch read: the operator's sign that kv_events sees this engine
                    said = True
                    self.log(f"KV-cache events of {socket}: following ({len(blocks.held)} blocks held)")
        finally:
            sub.close(linger=0)

    def _apply(self, socket: Path, blocks: EngineBlocks, decoder: Any, payload: bytes) -> None:
        try:
            batch = decoder.decode(payload)
        except Exception as exc:  # noqa: BLE001 - one batch it cannot read; the next may do
            self.log(f"KV-cache events of {socket}: a batch not understood ({exc})")
            return
        blocks.apply(batch.events)

    async def _replay(self, socket: Path, endpoint: str, first: int, blocks: EngineBlocks, decoder: Any,
                      replayed: dict[int, bytes]) -> int | None:
        """Ask the engine's publisher (vLLM's replay socket: a ROUTER) for the batches it
        keeps from FIRST on, and apply them in order, each noted in REPLAYED (its digest);
        the sequence number of the oldest it sent (None: it sent none). The publisher
        sends a replay at once and drops what is over its high-water mark for a reader
        too slow to take it, its end mark too: past a batch missing in the middle, or a
        silence after some came, the rest is asked for again, as long as each round
        brings some."""
        oldest: int | None = None
        while True:
            brought, complete, answered = await self._replay_round(socket, endpoint, blocks, decoder, replayed)
            if brought is not None and oldest is None:
                oldest = brought
            if not answered:
                self.log(f"KV-cache events of {socket}: the replay from batch {blocks.last_seq + 1} stopped "
                         f"answering for {REPLAY_TIMEOUT_S:g} s; following without it")
                return oldest
            if complete or brought is None:
                return oldest

    async def _replay_round(self, socket: Path, endpoint: str, blocks: EngineBlocks, decoder: Any,
                            replayed: dict[int, bytes]) -> tuple[int | None, bool, bool]:
        """One replay request, from the batch after the last applied: (the first batch
        applied, or None; whether the replay came whole to its end mark; whether the
        publisher answered at all). A socket of its own: what is left of an earlier
        round never mixes in."""
        import zmq

        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)  # this side takes in all that comes
        first: int | None = None
        answered = False
        try:
            dealer.connect(endpoint)
            await dealer.send_multipart((b"", (blocks.last_seq + 1).to_bytes(8, "big")))
            while True:
                # The publisher sends a replay in one go: a silence once some came means
                # the rest, its end mark with it, was dropped.
                if not await dealer.poll((REPLAY_QUIET_S if answered else REPLAY_TIMEOUT_S) * 1000):
                    return first, False, answered
                answered = True
                frames = await dealer.recv_multipart()
                if len(frames) != 4:  # (empty, topic, sequence number, batch)
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq < 0:  # the publisher's end of the replay
                    return first, True, True
                if seq <= blocks.last_seq:
                    continue
                if first is not None and seq != blocks.last_seq + 1:  # dropped in the middle: ask again
                    return first, False, True
                # The first may be past the one asked for: older ones the engine no longer keeps.
                first = seq if first is None else first
                self._apply(socket, blocks, decoder, frames[3])
                blocks.last_seq = seq
                replayed[seq] = _digest(frames[3])
                if len(replayed) % REPLAY_YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        finally:
            dealer.close(linger=0)

    def _say_replayed(self, socket: Path, blocks: EngineBlocks, first: int, seq: int, oldest: int | None) -> None:
        """Log a replay of the batches FIRST to SEQ - 1, missed (OLDEST: the first the
        engine still kept), at most once every REPLAY_LOG_EVERY_S per engine."""
        now = time.monotonic()
        if now - blocks.replay_said < REPLAY_LOG_EVERY_S:
            return
        blocks.replay_said = now
        lost = seq - first if oldest is None else min(seq, max(oldest, first)) - first
        self.log(f"KV-cache events of {socket}: batches {first}-{seq - 1} missed, "
                 + (f"replayed by the engine but {lost} it no longer kept" if lost else "replayed by the engine"))

    def _encoder(self, description: dict[str, Any]) -> PromptTokens | None:
        """The prompt tokens of a model's engines (None while the tokenizer loads, or where it cannot load)."""
        key = json.dumps([description.get(k) for k in ("tokenizer", "tokenizer_revision", "trust_remote_code")])
        task = self._encoders.get(key)
        if task is None:
            async def load() -> PromptTokens:
                tokenizer = await asyncio.to_thread(_load_tokenizer, description)
                self.log(f"tokenizer {description['tokenizer']}: loaded for kv_events")
                return PromptTokens(tokenizer, self.tokenizer_threads)

            task = self._encoders[key] = asyncio.create_task(load())
            task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                                   or self.log(f"tokenizer {description['tokenizer']}: {t.exception()}"))
        if not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return task.result()

    async def prompt_blocks(self, sockets: Sequence[Path], line: dict[str, Any]) -> dict[int, list[bytes]] | None:
        """The names of the prompt's blocks, by block size (each of SOCKETS' engines'),
        for the request LINE (an engine socket's request: its ``inputs`` and
        ``parameters``) and SOCKETS' engines, followed; None where that cannot be told
        yet (the tokenizer loading) or at all (a prompt the engine will refuse, pictures)."""
        encoder = self._encoder(self._described[sockets[0]])
        if encoder is None:
            return None
        ids = await encoder.encode(line["inputs"])
        if not ids:
            return None
        sizes = {self.engines[s].block_size for s in sockets if self.engines[s].block_size > 0}
        return {size: prompt_blocks(ids, size) for size in sizes}

    def held(self, socket: Path, blocks: dict[int, list[bytes]]) -> int:
        """How many of the prompt's leading blocks (BLOCKS) SOCKET's engine holds."""
        engine = self.engines.get(socket)
        if engine is None or engine.block_size not in blocks:
            return 0
        return engine.matched(blocks[engine.block_size])

    async def matches(self, groups: dict[str, list[Path]], route: Any) -> dict[str, int] | None:
        """{name: the most of the prompt's leading blocks one of its engines holds} for
        GROUPS (a routing target's name -> its engine sockets: an upstream's, or one
        socket), the prompt being ROUTE's (``line``; its ``blocks``, named here once per
        request and kept on it). None where that cannot be told (see prompt_blocks)."""
        if route.line is None or not groups or not all(groups.values()):
            return None
        every = [s for group in groups.values() for s in group]
        if not self.follow(every):
            return None
        if route.blocks is None:
            route.blocks = await self.prompt_blocks(every, route.line)
        if route.blocks is None:
            return None
        return {name: max(self.held(s, route.blocks) for s in group) for name, group in groups.items()}

    async def close(self) -> None:
        for task in list(self._followers.values()) + list(self._encoders.values()):
            task.cancel()
        for task in self._followers.values():
            with contextlib.suppress(BaseException):
                await task
        self._followers.clear()
        if self._context is not None:
            self._context.term()
            self._context = None
