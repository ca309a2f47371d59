"""Routing by the engines' KV-cache events (llmhost.gateway.routing.kvevents, the
``kv_events`` policy): what one engine's events say its cache holds, the choice among
engines by the longest match under the load bound, and the index following vLLM's own
publisher over ZMQ with the tiny model's tokenizer."""

from __future__ import annotations

import asyncio
import json
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import vllm.distributed.kv_events as kv

from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.metrics import GatewayMetrics
from llmhost.gateway.routing.kvevents import EngineBlocks, KvEventsIndex, prompt_blocks
from llmhost.gateway.routing.policies import KV_EVENTS, Chooser, Route
from llmhost.gateway.routing.pool import PoolSettings, UpstreamPool
from llmhost.kv_events.sockets import describe, events_config, read_description, write_description
from tests.unit._gateway_fakes import Fake, client, keystore, make_app

BS = 4


def _stored(hashes: list[int], parent: int | None, tokens: list[int], **extra: Any) -> Any:
    return kv.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                          lora_id=None, medium=extra.pop("medium", "GPU"), lora_name=None, **extra)


def _through_the_wire(events: list[Any]) -> list[Any]:
    """EVENTS as the gateway reads them: encoded by vLLM's publisher's encoder, decoded by its batch type."""
    import msgspec

    payload = msgspec.msgpack.Encoder().encode(kv.KVEventBatch(ts=1.0, events=events))
    return list(msgspec.msgpack.Decoder(type=kv.KVEventBatch).decode(payload).events)


PROMPT = list(range(100, 114))  # 3 full blocks of 4, and 2 tokens over


def test_an_engines_events_tell_which_leading_blocks_of_a_prompt_it_holds():
    blocks = prompt_blocks(PROMPT, BS)
    assert len(blocks) == 3
    engine = EngineBlocks()
    assert engine.matched(blocks) == 0
    # The engine's own hashes (11, 12, 13) are its business: the names follow the tokens.
    engine.apply(_through_the_wire([_stored([11, 12], None, PROMPT[:8])]))
    assert engine.matched(blocks) == 2
    engine.apply(_through_the_wire([_stored([13], 12, PROMPT[8:12])]))
    assert engine.matched(blocks) == 3
    # Another prompt sharing the first block only.
    other = [*PROMPT[:4], 7, 7, 7, 7]
    assert engine.matched(prompt_blocks(other, BS)) == 1
    # Evicting the middle block ends the run there.
    engine.apply(_through_the_wire([kv.BlockRemoved(block_hashes=[12], medium="GPU")]))
    assert engine.matched(blocks) == 1
    engine.apply(_through_the_wire([kv.AllBlocksCleared()]))
    assert engine.matched(blocks) == 0 and not engine.names and not engine.held


def test_blocks_after_an_unknown_parent_offloaded_copies_and_a_restart_count_for_nothing():
    blocks = prompt_blocks(PROMPT, BS)
    engine = EngineBlocks()
    engine.apply(_through_the_wire([_stored([13], 99, PROMPT[8:12]), _stored([11], None, PROMPT[:4], medium="CPU")]))
    assert engine.matched(blocks) == 0 and not engine.held
    assert engine.missed(0) is None
    engine.apply(_through_the_wire([_stored([11, 12, 13], None, PROMPT[:12])]))
    engine.last_seq = 0
    assert engine.missed(1) is None and engine.missed(5) == 1  # batches 1 to 4 did not come
    assert engine.matched(blocks) == 3
    assert engine.missed(0) is None  # the engine started again: its cache is empty, its sequence anew
    assert engine.matched(blocks) == 0 and engine.last_seq == -1
    assert engine.missed(3) == 0


def test_the_same_block_stored_twice_is_held_until_both_are_evicted():
    blocks = prompt_blocks(PROMPT, BS)
    engine = EngineBlocks()
    engine.apply([_stored([11], None, PROMPT[:4]), _stored([21], None, PROMPT[:4])])
    engine.apply([kv.BlockRemoved(block_hashes=[11], medium=None)])
    assert engine.matched(blocks) == 1
    engine.apply([kv.BlockRemoved(block_hashes=[21], medium=None), kv.BlockRemoved(block_hashes=[77], medium=None)])
    assert engine.matched(blocks) == 0


def _pick(route: Route, loads: dict[str, int]) -> str:
    return Chooser().choose(route, "m", sorted(loads), lambda t: t, lambda t: loads[t])


def test_kv_events_takes_the_longest_match_under_the_bound_and_the_keys_order_among_equals():
    route = Route(KV_EVENTS, b"k", matches={"a": 2, "b": 5, "c": 0})
    assert _pick(route, {"a": 0, "b": 1, "c": 1}) == "b" and route.reason == "prefix"
    # b over the bound (ceil(1.5 * 10 / 3) = 5): the next longest match, a.
    route = Route(KV_EVENTS, b"k", matches={"a": 2, "b": 5, "c": 0})
    assert _pick(route, {"a": 2, "b": 5, "c": 2}) == "a" and route.reason == "load_bound"
    # Nobody holds a block, or all hold the same: the key's first choice, as cache_aware
    # (a prefix whose blocks were evicted keeps its home), whatever the loads under the bound.
    loads = {"a": 1, "b": 0, "c": 1}
    for key in (b"key-1", b"key-2", b"key-3", b"key-4"):
        home = _pick(Route("cache_aware", key), loads)
        for held in (0, 3):
            route = Route(KV_EVENTS, key, matches=dict.fromkeys(loads, held))
            assert _pick(route, loads) == home and route.reason == ("prefix" if held else "no_match")
    # Two of three hold the longest run: the one of them first in the key's order.
    for key in (b"key-1", b"key-2", b"key-3", b"key-4"):
        first = _pick(Route("cache_aware", key), {"a": 0, "b": 0, "c": 0})
        route = Route(KV_EVENTS, key, matches={"a": 4, "b": 4, "c": 0} if first != "c" else {"a": 4, "b": 0, "c": 4})
        assert _pick(route, {"a": 0, "b": 0, "c": 0}) == first


def test_kv_events_routes_by_the_key_where_the_matches_are_not_known_or_a_session_pins():
    loads = {"a": 0, "b": 0, "c": 0}
    by_hash = _pick(Route("cache_aware", b"key-1"), loads)
    route = Route(KV_EVENTS, b"key-1")
    assert _pick(route, loads) == by_hash and route.reason == "prefix"
    pinned = _pick(Route("cache_aware", b"key-1", kind="session"), loads)
    route = Route(KV_EVENTS, b"key-1", kind="session", matches={n: int(n != pinned) for n in loads})
    assert _pick(route, loads) == pinned and route.reason == "session"


def _engines_publisher(engine_socket: Path) -> Any:
    """The publisher vLLM's engine makes of the kv_events_config the backend gives it."""
    from vllm.config import KVEventsConfig

    return kv.EventPublisherFactory.create(KVEventsConfig(**events_config(engine_socket)), 0)


class _ModelConfig:
    def __init__(self, tokenizer: Path) -> None:
        self.tokenizer, self.tokenizer_mode, self.tokenizer_revision = str(tokenizer), "auto", None
        self.trust_remote_code, self.max_model_len = False, 512


def test_the_index_follows_vllms_publisher_and_tokenizes_as_the_engine(tiny_model: Path, tmp_path: Path):
    """Two engines' sockets, each described as the backend describes it, with vLLM's own
    ZmqEventPublisher on the address the backend gives it: the index follows both and
    matches a prompt against the blocks each one published."""
    from transformers import AutoTokenizer

    sockets = [tmp_path / "m" / f"1-m_{i}.sock" for i in range(2)]
    sockets[0].parent.mkdir()
    for s in sockets:
        write_description(s, describe(s, _ModelConfig(tiny_model)))
    assert read_description(sockets[0])["endpoint"] == events_config(sockets[0])["endpoint"]
    (tmp_path / "m" / "1-m_2.kv.json").write_text("{not json")
    assert read_description(tmp_path / "m" / "1-m_2.sock") is None
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    prompt = "the same long document, read again and again, " * 8
    ids = tok.encode(prompt, add_special_tokens=True)
    whole = len(ids) // BS * BS

    said: list[str] = []

    async def run() -> dict[str, int] | None:
        index = KvEventsIndex(log=said.append)
        publishers = [_engines_publisher(s) for s in sockets]
        line = {"inputs": {"text_input": prompt}, "parameters": {}}
        groups = {s.name: [s] for s in sockets}
        try:
            for _ in range(600):
                found = await index.matches(groups, Route(KV_EVENTS, line=line))
                if found is not None:
                    break
                await asyncio.sleep(0.05)
            assert found == {"1-m_0.sock": 0, "1-m_1.sock": 0}, found
            # Engine 1 stores the prompt's first two blocks, then the rest (again until
            # seen: a subscriber that is still connecting misses what is sent before).
            hashes = list(range(1000, 1000 + whole // BS))
            for _ in range(200):
                publishers[1].publish(kv.KVEventBatch(ts=1.0, events=[_stored(hashes[:2], None, ids[:2 * BS])]))
                publishers[1].publish(kv.KVEventBatch(ts=1.0, events=[_stored(hashes[2:], hashes[1],
                                                                              ids[2 * BS:whole])]))
                found = await index.matches(groups, Route(KV_EVENTS, line=line))
                if found and found["1-m_1.sock"] == whole // BS:
                    break
                await asyncio.sleep(0.05)
            # An upstream's engines as one target: the most any of them holds.
            upstreams = await index.matches({"u": sockets}, Route(KV_EVENTS, line=line))
            assert upstreams == {"u": whole // BS}, upstreams
            return found
        finally:
            for p in publishers:
                p.shutdown()
            await index.close()

    assert asyncio.run(run()) == {"1-m_0.sock": 0, "1-m_1.sock": whole // BS}
    # What the operator reads: the tokenizer loaded, and each engine followed once its
    # first batch is read (engine 0 published none).
    assert said[0] == f"tokenizer {tiny_model}: loaded for kv_events", said
    followed = [line for line in said if "following" in line]
    assert len(followed) == 1 and followed[0].startswith(f"KV-cache events of {sockets[1]}: following ("), said


class _Dropping:
    """A publisher's PUB socket that drops the batches of the sequence numbers in DROP
    (as ZMQ does for a reader too slow), the publisher keeping them for replay."""

    def __init__(self, sock: Any, drop: set[int]) -> None:
        self.sock, self.drop = sock, drop

    def send_multipart(self, frames: Any, *args: Any, **kwargs: Any) -> Any:
        if int.from_bytes(frames[1], "big") in self.drop:
            return None
        return self.sock.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def test_the_index_replays_what_the_engine_kept_what_it_missed_and_forgets_a_restarted_one(
        tiny_model: Path, tmp_path: Path):
    """vLLM's publisher on the addresses the backend gives it, its replay socket among
    them: a gateway that starts following after the engine stored blocks learns them
    from the replay; a batch the subscription missed is asked for again; an engine that
    starts again (a new publisher, its sequence from 0) is forgotten, then learnt anew."""
    from transformers import AutoTokenizer

    sock = tmp_path / "m" / "1-m_0.sock"
    sock.parent.mkdir()
    write_description(sock, describe(sock, _ModelConfig(tiny_model)))
    config = events_config(sock)
    assert read_description(sock)["replay_endpoint"] == config["replay_endpoint"] == f"ipc://{tmp_path}/m/1-m_0.kv.replay"
    prompt = "the same long document, read again and again, " * 8
    ids = AutoTokenizer.from_pretrained(str(tiny_model)).encode(prompt, add_special_tokens=True)
    whole = len(ids) // BS
    hashes = list(range(1000, 1000 + whole))
    said: list[str] = []

    async def run() -> list[dict[str, int] | None]:
        index = KvEventsIndex(log=said.append)
        line = {"inputs": {"text_input": prompt}, "parameters": {}}
        seen: list[dict[str, int] | None] = []

        async def held(want: int, pub: Any, what: str) -> None:
            for _ in range(400):
                found = await index.matches({"e": [sock]}, Route(KV_EVENTS, line=line))
                if found == {"e": want}:
                    seen.append(found)
                    return
                if pub is not None:  # batches that change nothing, until the subscription reads them
                    pub.publish(kv.KVEventBatch(ts=time.time(), events=[kv.BlockRemoved(block_hashes=[999_999],
                                                                                        medium="GPU")]))
                await asyncio.sleep(0.05)
            raise AssertionError(f"{what}: {found}; said {said}")

        pub = _engines_publisher(sock)
        try:
            # Before the gateway follows, the engine stored the prompt's first two blocks.
            pub.publish(kv.KVEventBatch(ts=1.0, events=[_stored(hashes[:2], None, ids[:2 * BS])]))
            while not pub._buffer:
                await asyncio.sleep(0.01)
            await held(2, None, "the blocks stored before the gateway followed")
            # The next batch is dropped on the way; the one after it comes.
            pub._pub = _Dropping(pub._pub, {1})
            pub.publish(kv.KVEventBatch(ts=1.0, events=[_stored(hashes[2:3], hashes[1], ids[2 * BS:3 * BS])]))
            pub.publish(kv.KVEventBatch(ts=1.0, events=[_stored(hashes[3:], hashes[2], ids[3 * BS:whole * BS])]))
            await held(whole, pub, "the blocks of a batch the subscription missed")
            # The engine starts again: a new publisher, its cache holding the first block only.
            pub.shutdown()
            pub = _engines_publisher(sock)
            # An engine publishes once it has loaded, long after the subscription reconnected
            # (a tenth of a second): the sequence going back to 0 tells the gateway.
            await asyncio.sleep(0.5)
            pub.publish(kv.KVEventBatch(ts=2.0, events=[_stored(hashes[:1], None, ids[:BS])]))
            await held(1, pub, "the blocks of the engine started again")
            return seen
        finally:
            pub.shutdown()
            await index.close()

    assert asyncio.run(run()) == [{"e": 2}, {"e": whole}, {"e": 1}]
    assert f"KV-cache events of {sock}: following (2 blocks held, 1 batches replayed)" in said, said
    missed = [line for line in said if " missed, replayed by the engine" in line]
    assert missed and missed[0].startswith(f"KV-cache events of {sock}: batches 1-"), said
    assert not [line for line in said if "stopped answering" in line or "not understood" in line], said


def test_the_index_reads_every_batch_the_engine_keeps(tmp_path: Path):
    """The engine keeps 10,000 batches (vLLM's buffer_steps) and sends them at once when
    asked: the index takes them all, none dropped over the publisher's high-water mark."""
    sock = tmp_path / "1-m_0.sock"
    write_description(sock, describe(sock, _ModelConfig(tmp_path / "no-tokenizer-needed")))
    kept = 10_000
    said: list[str] = []

    async def run() -> None:
        pub = _engines_publisher(sock)
        index = KvEventsIndex(log=said.append)
        try:
            for i in range(kept):
                pub.publish(kv.KVEventBatch(ts=time.time(), events=[_stored([i], None, [i] * BS)]))
            while len(pub._buffer) < kept:
                await asyncio.sleep(0.05)
            for _ in range(600):
                if index.follow([sock]):
                    break
                await asyncio.sleep(0.05)
            assert len(index.engines[sock].held) == kept and index.engines[sock].last_seq == kept - 1, said
        finally:
            pub.shutdown()
            await index.close()

    asyncio.run(run())
    assert said == [f"KV-cache events of {sock}: following ({kept} blocks held, {kept} batches replayed)"], said


def test_a_description_is_written_whole_and_read_back(tmp_path: Path):
    sock = tmp_path / "1-0.sock"
    write_description(sock, {"endpoint": "ipc:///x", "tokenizer": "/m", "max_model_len": 8})
    assert json.loads((tmp_path / "1-0.kv.json").read_text())["tokenizer"] == "/m"
    assert not list(tmp_path.glob("*.part"))


class _Sockets(Fake):
    """A fake upstream with engine sockets on this host (their names only)."""

    def __init__(self, name: str, folder: Path) -> None:
        super().__init__(name)
        self.folder = folder

    def engine_sockets(self, model: str) -> list[Path]:
        return [self.folder / f"{self.name}-{i}.sock" for i in range(2)]


class _Held:
    """An index whose engines hold what HELD says (socket name -> blocks), asked by the pool."""

    def __init__(self, held: dict[str, int] | None) -> None:
        self.held = held
        self.asked: list[dict[str, list[str]]] = []

    async def matches(self, groups: dict[str, list[Path]], route: Route) -> dict[str, int] | None:
        assert route.line is not None and route.line["inputs"]["messages"]
        self.asked.append({k: [p.name for p in v] for k, v in groups.items()})
        if self.held is None:
            return None
        return {k: max(self.held.get(p.name, 0) for p in v) for k, v in groups.items()}


def _kv_gateway(tmp_path: Path, held: dict[str, int] | None) -> tuple[Any, list[Fake], _Held, GatewayMetrics]:
    fakes: list[Fake] = [_Sockets(n, tmp_path) for n in ("a", "b", "c")]
    pool = UpstreamPool([(f"{f.name}:1", f) for f in fakes], ["m"], PoolSettings())
    index = _Held(held)
    pool.kv_events = index  # type: ignore[assignment]
    cfg = GatewayConfig(upstreams=[m.target for m in pool.members], models=["m"], max_body_bytes=65536,
                        routing_policy=KV_EVENTS)
    metrics = GatewayMetrics(["m"])
    return make_app(pool, keystore(), config=cfg, metrics=metrics), fakes, index, metrics


def _send(app: Any, contents: tuple[str, ...] = ("hello",)) -> None:
    async def run() -> None:
        async with client(app) as c:
            for content in contents:
                body = json.dumps({"model": "m", "max_tokens": 4,
                                   "messages": [{"role": "user", "content": content}]}).encode()
                await c.post("/v1/chat/completions", content=body)

    asyncio.run(run())


def test_the_gateway_sends_a_prompt_to_the_upstream_whose_engines_hold_most_of_it(tmp_path: Path):
    app, fakes, index, metrics = _kv_gateway(tmp_path, {"a-1.sock": 2, "c-0.sock": 7, "b-0.sock": 3})
    _send(app)
    assert [f.name for f in fakes if f.seen] == ["c"]
    assert index.asked == [{f"{n}:1": [f"{n}-0.sock", f"{n}-1.sock"] for n in "abc"}]
    assert _reasons(metrics) == {"prefix": 1.0}


def test_the_gateway_sends_a_prompt_nobody_holds_or_not_known_yet_by_its_key(tmp_path: Path):
    prompts = tuple(f"conversation {i}" for i in range(12))
    app, fakes, _, metrics = _kv_gateway(tmp_path, {})
    _send(app, prompts)
    nobody = {f.name: len(f.seen) for f in fakes}
    assert _reasons(metrics) == {"no_match": 12.0}
    assert sum(1 for n in nobody.values() if n) > 1, nobody  # spread by their keys, not all to the idlest
    app, fakes, _, metrics = _kv_gateway(tmp_path, None)
    _send(app, prompts)
    assert {f.name: len(f.seen) for f in fakes} == nobody  # the key's first choice either way
    assert _reasons(metrics) == {"prefix": 12.0}


def _reasons(metrics: GatewayMetrics) -> dict[str, float]:
    for family in metrics.registry.collect():
        if family.name == "llmhost_gateway_routing_decisions":
            return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total") and s.value}
    return {}


def test_a_level_with_one_target_leaves_the_reason_of_the_level_above():
    """Two upstreams of one engine socket each: the upstream's choice (no engine held a
    block) is what the request records, not the lone socket's key."""
    route = Route(KV_EVENTS, b"k", matches={"a": 0, "b": 0})
    _pick(route, {"a": 0, "b": 0})
    assert route.reason == "no_match"
    route.matches = None  # the socket level: one socket, nothing to match
    assert Chooser().choose(route, "m", ["1-m_0.sock"], lambda t: t, lambda t: 0) == "1-m_0.sock"
    assert route.reason == "no_match"
    lone = Route("cache_aware", b"k")  # nothing above: the lone target's level decides
    Chooser().choose(lone, "m", ["x"], lambda t: t, lambda t: 0)
    assert lone.reason == "prefix"


def test_the_gateway_tokenizes_a_prompt_as_the_backend_does(tiny_model: Path):
    """The gateway's tokens of a request (PromptTokens, from the engine socket's line) are
    the backend's own (PromptEncoder, from the same line parsed as the engine parses it):
    text, a chat, a chat with tools and template arguments; a prompt of token ids as given."""
    from transformers import AutoTokenizer

    from llmhost.backend.config import BackendSettings
    from llmhost.backend.prompts import PromptEncoder
    from llmhost.backend.request import parse_request
    from llmhost.backend.stream_socket import request_inputs
    from llmhost.gateway.routing.kvevents import PromptTokens

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    gateway = PromptTokens(tok, 1)
    tools = [{"type": "function", "function": {"name": "lookup", "description": "find a word",
                                               "parameters": {"type": "object", "properties": {}}}}]
    chat = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hello there"}]
    lines = [
        {"text_input": "the same long document, read again"},
        {"messages": json.dumps(chat)},
        {"messages": json.dumps(chat), "sampling_parameters": json.dumps(
            {"max_tokens": 4, "tools": tools, "chat_template_kwargs": {"enable_thinking": False}})},
        {"prompt_token_ids": [5, 6, 7, 8]},
    ]

    async def both(inputs: dict[str, Any]) -> tuple[list[int] | None, list[int]]:
        encoder = PromptEncoder(tok, 512, 1)
        try:
            job = parse_request(request_inputs(inputs), {}, BackendSettings())
            return await gateway.encode(inputs), await encoder.encode(job)
        finally:
            encoder.close()

    for inputs in lines:
        mine, backends = asyncio.run(both(inputs))
        assert mine == backends and mine, inputs
    assert gateway.ids({"messages": json.dumps([{"role": "user", "content": [{"type": "text", "text": "x"}]}])}) \
        is None


def test_without_vllm_to_read_the_events_it_says_so_once_and_routes_by_key(tmp_path: Path, monkeypatch):
    import llmhost.gateway.routing.kvevents as kvevents

    def no_vllm() -> None:
        raise ModuleNotFoundError("No module named 'vllm'")

    monkeypatch.setattr(kvevents, "_load_decoder", no_vllm)
    sock = tmp_path / "1-m_0.sock"
    write_description(sock, {"endpoint": "ipc:///nowhere", "tokenizer": "/m", "max_model_len": 8})
    said: list[str] = []

    async def run() -> list[Any]:
        index = KvEventsIndex(log=said.append)
        out = []
        for _ in range(5):
            out.append(await index.matches({"a": [sock]}, Route(KV_EVENTS, line={"inputs": {"text_input": "x"}})))
            await asyncio.sleep(0.05)
        assert len(index._followers) <= 1
        await index.close()
        return out

    assert asyncio.run(run()) == [None] * 5
    assert len(said) == 1 and "No module named 'vllm'" in said[0] and "cache_aware" in said[0]


# A process that may not call sched_setscheduler (EPERM), as systemd's
# SystemCallFilter=~@resources makes it: a seccomp filter of its own, installed first.
_DENY_SCHED_SETSCHEDULER = '''
import ctypes, errno, platform, struct
NR = {"x86_64": 144, "aarch64": 119}[platform.machine()]
code = [(0x20, 0, 0, 0), (0x15, 0, 1, NR), (0x06, 0, 0, 0x00050000 | errno.EPERM), (0x06, 0, 0, 0x7FFF0000)]
program = b"".join(struct.pack("HBBI", *c) for c in code)
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(Prog(len(code), program)), 0, 0) == 0, ctypes.get_errno()  # a filter
'''


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="the filter knows x86_64 and aarch64")
def test_where_threads_may_not_set_their_scheduling_it_says_so_instead_of_aborting(tmp_path: Path):
    """libzmq aborts the whole process where its I/O thread may not set its scheduling
    (the gateway under systemd's SystemCallFilter=~@resources died so); the index asks
    first, says once that it cannot read events there, and routes by key."""
    aborted = subprocess.run([sys.executable, "-c", _DENY_SCHED_SETSCHEDULER +
                              "import zmq\nzmq.Context().socket(zmq.SUB).connect('ipc:///nowhere')\nprint('alive')"],
                             capture_output=True, text=True, timeout=120)
    assert aborted.returncode == -signal.SIGABRT and "alive" not in aborted.stdout, aborted
    assert "Operation not permitted" in aborted.stderr, aborted.stderr
    sock = tmp_path / "1-m_0.sock"
    write_description(sock, {"endpoint": f"ipc://{tmp_path}/1-m_0.kv", "tokenizer": "/m", "max_model_len": 8})
    guarded = subprocess.run([sys.executable, "-c", _DENY_SCHED_SETSCHEDULER + f'''
import asyncio, json
from pathlib import Path
from llmhost.gateway.routing.kvevents import KvEventsIndex
from llmhost.gateway.routing.policies import KV_EVENTS, Route
said = []
async def run():
    index = KvEventsIndex(log=said.append)
    out, line = [], {{"inputs": {{"text_input": "x"}}}}
    for _ in range(40):
        out.append(await index.matches({{"a": [Path({str(sock)!r})]}}, Route(KV_EVENTS, line=line)))
        await asyncio.sleep(0.05)
    await index.close()
    return out
print(json.dumps({{"matches": asyncio.run(run()), "said": said}}))
'''], capture_output=True, text=True, timeout=300)
    assert guarded.returncode == 0, guarded.stderr[-3000:]
    out = json.loads(guarded.stdout.splitlines()[-1])
    assert out["matches"] == [None] * 40, out
    assert len(out["said"]) == 1 and "sched_setscheduler" in out["said"][0] and "cache_aware" in out["said"][0], out
