"""`llmhost bench`: a streaming load generator with a concurrency sweep.

Targets: our Triton endpoint over HTTP SSE (`/generate_stream`) or gRPC streaming,
and any OpenAI-compatible server (`/v1/completions`, e.g. vLLM's own) for
side-by-side runs. Output tokens are counted from what the server reports
(`num_output_tokens`, or OpenAI's `usage.completion_tokens`), never from events.
With `turns` > 1 (OpenAI servers only) a worker holds conversations instead: each
turn goes to `/v1/chat/completions` with the whole history so far (the system prompt,
the earlier user turns and the model's own replies) and the conversation's
`x-session-id` header, as a chat application resends it; a request is a turn.

`processes` > 1 spreads each level's concurrency over that many client processes
(one asyncio loop each), so that one Python process's CPU does not cap what a fast
server can be shown to do; they start each level together and their samples are
merged (`merge_parts`). Each level records the client's CPU seconds.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

KEEPALIVE_S = 2.0
WORDS = ("def", "return", "self", "import", "class", "for", "in", "if", "else", "value", "data", "list",
         "print", "range", "while", "True", "None", "yield", "lambda", "with", "open", "file", "path")


@dataclass(frozen=True)
class Workload:
    requests: int = 64
    duration_s: float | None = None
    prompt_words: int = 64
    prompt_words_max: int | None = None
    output_tokens: int = 128
    output_tokens_max: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    # Shared prefixes (a cache-aware router's workload, as vLLM's prefix_repetition):
    # request i's prompt is prefix i mod SHARED_PREFIXES (PREFIX_WORDS words), then its
    # own prompt words. The prefixes come from PREFIX_SEED (None: seed), which client
    # processes share while their own words differ.
    shared_prefixes: int = 0
    prefix_words: int = 0
    prefix_seed: int | None = None
    # Multi-turn chat: TURNS user turns a conversation, its system prompt the shared
    # prefix of its index (none without shared prefixes).
    turns: int = 1

    def prefixes(self) -> list[str]:
        rng = random.Random(f"prefixes {self.seed if self.prefix_seed is None else self.prefix_seed}")
        return [" ".join([f"Context {i}:", *(rng.choice(WORDS) for _ in range(self.prefix_words))])
                for i in range(self.shared_prefixes)]

    def items(self, n: int) -> list[tuple[str, int]]:
        rng = random.Random(self.seed)
        prefixes = self.prefixes()
        out = []
        for i in range(n):
            words = rng.randint(self.prompt_words, self.prompt_words_max or self.prompt_words)
            tokens = rng.randint(self.output_tokens, self.output_tokens_max or self.output_tokens)
            prompt = " ".join(rng.choice(WORDS) for _ in range(words))
            out.append((f"{prefixes[i % len(prefixes)]}\n{prompt}" if prefixes else prompt, tokens))
        return out

    def conversations(self, n: int) -> list[Conversation]:
        """N conversations of TURNS turns, each turn's words and reply length as items()
        draws them; conversation i's system prompt is shared prefix i mod SHARED_PREFIXES."""
        prefixes = self.prefixes()
        turns = replace(self, shared_prefixes=0, turns=1).items(n * self.turns)
        return [Conversation(prefixes[i % len(prefixes)] if prefixes else None,
                             tuple(turns[i * self.turns:(i + 1) * self.turns])) for i in range(n)]


@dataclass(frozen=True)
class Conversation:
    system: str | None
    turns: tuple[tuple[str, int], ...]  # (user text, reply tokens) a turn


@dataclass
class Sample:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    error: str = ""
    # Streamed events that carried output (SSE events, gRPC responses): with `tokens`,
    # how the server streamed (one token an event, or several grouped or merged).
    events: int = 0
    # The reply's text (chat turns: the next turn's history holds it).
    text: str = ""

    @property
    def itl(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.ok and self.tokens > 1 else None


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_s: dict[str, float] = field(default_factory=dict)
    itl_s: dict[str, float] = field(default_factory=dict)
    e2e_s: dict[str, float] = field(default_factory=dict)
    first_error: str = ""
    # CPU seconds (user + system) the client's processes used during the level, and
    # how many processes ran it.
    client_cpu_s: float = 0.0
    client_processes: int = 1
    # The busiest client process's CPU seconds (near duration_s: that process was the limit).
    client_cpu_max_s: float = 0.0
    # When the level started (seconds since the epoch), to line it up with other samples.
    started_at: float = 0.0
    # Output tokens per streamed event over the level's good requests: 1.0 is one event a
    # token; more is grouped (a stream interval) or merged (a server that fell behind).
    tokens_per_event: float = 0.0


@dataclass
class LevelPart:
    """One client process's share of a level: its samples and its own clock and CPU."""

    concurrency: int
    samples: list[Sample]
    elapsed_s: float
    cpu_s: float
    started_at: float = 0.0


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)

    def q(p: float) -> float:
        k = (len(values) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(values) - 1)
        return values[lo] + (values[hi] - values[lo]) * (k - lo)

    return {"p50": q(0.5), "p95": q(0.95), "p99": q(0.99), "mean": statistics.fmean(values)}


class Target:
    """One kind of endpoint; ``one`` sends a streaming request and times it."""

    def __init__(self, kind: str, url: str, model: str, api_key: str | None = None) -> None:
        url = url.rstrip("/")
        if kind == "openai":
            # An OpenAI base URL as clients are given it (`.../v1`) or the server's root.
            url = url.removesuffix("/v1")
        self.kind, self.url, self.model = kind, url, model
        self.api_key = api_key  # sent as `Authorization: Bearer` (the llmhost gateway)
        self._session: Any = None
        self._grpc: Any = None

    async def open(self) -> None:
        if self.kind == "grpc":
            import tritonclient.grpc.aio as grpcaio

            self._grpc = grpcaio.InferenceServerClient(self.url)
        else:
            import aiohttp

            # Idle pooled connections are dropped after 2 s, before a server's own
            # keep-alive timeout (uvicorn's, under vLLM's server, is 5 s) closes
            # them: aiohttp's default (15 s) reuses such a connection and the
            # request fails with "Server disconnected" at the start of a level.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                timeout=aiohttp.ClientTimeout(total=600),
                headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else None)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._grpc is not None:
            await self._grpc.close()

    async def one(self, prompt: str, max_tokens: int, ignore_eos: bool,
                  history: list[dict[str, str]] | None = None, session: str | None = None) -> Sample:
        """One streamed request: PROMPT, or (OpenAI chat) the HISTORY of messages with
        SESSION as its x-session-id."""
        t0 = time.perf_counter()
        try:
            if self.kind == "grpc":
                return await self._grpc_one(t0, prompt, max_tokens, ignore_eos)
            return await self._http_one(t0, prompt, max_tokens, ignore_eos, history, session)
        except Exception as exc:  # noqa: BLE001 - every failure is a counted error
            return Sample(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])

    async def _http_one(self, t0: float, prompt: str, max_tokens: int, ignore_eos: bool,
                        history: list[dict[str, str]] | None = None, session: str | None = None) -> Sample:
        headers = {"x-session-id": session} if session else None
        text: list[str] = []
        if self.kind == "openai":
            url = f"{self.url}/v1/completions" if history is None else f"{self.url}/v1/chat/completions"
            body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens,
                                    "stream": True, "ignore_eos": ignore_eos, "temperature": 1.0,
                                    "stream_options": {"include_usage": True}}
            body.update({"prompt": prompt} if history is None else {"messages": history})
        else:
            url = f"{self.url}/v2/models/{self.model}/generate_stream"
            body = {"text_input": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": ignore_eos,
                    "temperature": 1.0, "return_num_output_tokens": True}
        ttft = 0.0
        tokens = events = 0
        async with self._session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                return Sample(ok=False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    return Sample(ok=False, error=str(event["error"])[:300])
                if not ttft:
                    ttft = time.perf_counter() - t0
                if self.kind == "openai":
                    usage = event.get("usage")
                    if usage:
                        tokens = int(usage["completion_tokens"])
                    choices = event.get("choices")
                    events += bool(choices)  # the usage-only chunk carries no output
                    if history is not None and choices:
                        text.append(choices[0].get("delta", {}).get("content") or "")
                else:
                    counts = event.get("num_output_tokens")  # this response's own tokens
                    if counts is not None:
                        tokens += int(counts if isinstance(counts, int) else sum(counts))
                    events += 1
        return Sample(ok=tokens > 0, ttft=ttft, e2e=time.perf_counter() - t0, tokens=tokens, events=events,
                      error="" if tokens > 0 else "server reported no output tokens", text="".join(text))

    async def _grpc_one(self, t0: float, prompt: str, max_tokens: int, ignore_eos: bool) -> Sample:
        import numpy as np
        import tritonclient.grpc.aio as grpcaio

        def make_inputs() -> list[Any]:
            values = (("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                      ("stream", np.array([True]), "BOOL"),
                      ("return_num_output_tokens", np.array([True]), "BOOL"))
            out = []
            for name, arr, dtype in values:
                t = grpcaio.InferInput(name, [1], dtype)
                t.set_data_from_numpy(arr)
                out.append(t)
            return out

        async def requests_iter() -> Any:
            yield {"model_name": self.model, "inputs": make_inputs(), "request_id": str(id(t0)),
                   "parameters": {"max_tokens": max_tokens, "ignore_eos": ignore_eos, "temperature": 1.0}}

        ttft = 0.0
        tokens = events = 0
        # Through the gateway's gRPC door the key goes as `authorization` metadata.
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else None
        async for result, error in self._grpc.stream_infer(requests_iter(), headers=headers):
            if error is not None:
                return Sample(ok=False, error=str(error)[:300])
            if not ttft:
                ttft = time.perf_counter() - t0
            counts = result.as_numpy("num_output_tokens")  # this response's own tokens
            if counts is not None:
                tokens += int(counts.sum())
                events += 1
        return Sample(ok=tokens > 0, ttft=ttft, e2e=time.perf_counter() - t0, tokens=tokens, events=events)


async def run_part(target: Target, workload: Workload, concurrency: int, progress: bool = True) -> LevelPart:
    """Run CONCURRENCY workers of WORKLOAD against TARGET in this process."""
    total = workload.requests if workload.duration_s is None else 10**9
    items = workload.items(min(total, 100_000)) if workload.turns == 1 else []
    conversations = workload.conversations(min(-(-total // workload.turns), 100_000)) if workload.turns > 1 else []
    samples: list[Sample] = []
    next_index = 0
    next_conversation = 0
    cpu0 = _cpu_s()
    started_at = time.time()
    t0 = time.perf_counter()
    deadline = t0 + workload.duration_s if workload.duration_s else None

    def take() -> bool:
        """Whether another request may start (and count it)."""
        nonlocal next_index
        if deadline is not None and time.perf_counter() >= deadline:
            return False
        if deadline is None and next_index >= workload.requests:
            return False
        next_index += 1
        return True

    def done(sample: Sample) -> None:
        samples.append(sample)
        if progress:
            _progress(concurrency, len(samples), workload.requests if deadline is None else None,
                      time.perf_counter() - t0)

    async def worker() -> None:
        while take():
            prompt, max_tokens = items[(next_index - 1) % len(items)]
            done(await target.one(prompt, max_tokens, workload.ignore_eos))

    async def talker() -> None:
        nonlocal next_conversation
        while True:
            index = next_conversation
            next_conversation += 1
            conversation = conversations[index % len(conversations)]
            history = [{"role": "system", "content": conversation.system}] if conversation.system else []
            for text, max_tokens in conversation.turns:
                if not take():
                    return
                history.append({"role": "user", "content": text})
                sample = await target.one(text, max_tokens, workload.ignore_eos, history=list(history),
                                          session=f"bench-{workload.seed}-{index}")
                done(sample)
                if not sample.ok:
                    break
                history.append({"role": "assistant", "content": sample.text})

    await asyncio.gather(*((worker if workload.turns == 1 else talker)() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    if progress:
        print(file=sys.stderr)
    return LevelPart(concurrency=concurrency, samples=samples, elapsed_s=elapsed, cpu_s=_cpu_s() - cpu0,
                     started_at=started_at)


async def run_level(target: Target, workload: Workload, concurrency: int, progress: bool = True) -> LevelResult:
    return merge_parts(concurrency, [await run_part(target, workload, concurrency, progress)])


def merge_parts(concurrency: int, parts: list[LevelPart]) -> LevelResult:
    """One level's result from the parts that client processes ran at the same time:
    requests, errors, tokens/s, requests/s and CPU seconds summed (each part's rate
    over its own elapsed time), latency percentiles over every part's samples, the
    level's duration the longest part's. Parts that ran no worker count for nothing."""
    parts = [p for p in parts if p.concurrency > 0]
    samples = [s for p in parts for s in p.samples]
    good = [s for s in samples if s.ok]
    errors = [s for s in samples if not s.ok]

    def rate(p: LevelPart, what: str) -> float:
        ok = [s for s in p.samples if s.ok]
        n = sum(s.tokens for s in ok) if what == "tokens" else len(ok)
        return n / p.elapsed_s if p.elapsed_s > 0 else 0.0

    events = sum(s.events for s in good)
    return LevelResult(
        concurrency=concurrency,
        requests=len(samples),
        errors=len(errors),
        duration_s=max((p.elapsed_s for p in parts), default=0.0),
        requests_per_s=sum(rate(p, "requests") for p in parts),
        output_tokens_per_s=sum(rate(p, "tokens") for p in parts),
        ttft_s=percentiles([s.ttft for s in good]),
        itl_s=percentiles([v for s in good if (v := s.itl) is not None]),
        e2e_s=percentiles([s.e2e for s in good]),
        first_error=errors[0].error if errors else "",
        client_cpu_s=round(sum(p.cpu_s for p in parts), 3),
        client_processes=len(parts),
        client_cpu_max_s=round(max((p.cpu_s for p in parts), default=0.0), 3),
        started_at=min((p.started_at for p in parts), default=0.0),
        tokens_per_event=round(sum(s.tokens for s in good) / events, 2) if events else 0.0,
    )


def shares(total: int, n: int) -> list[int]:
    """TOTAL split over N as evenly as possible, the larger shares first."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def part_workload(workload: Workload, index: int, offset: int, share: int, concurrency: int) -> Workload:
    """Client process INDEX's workload when it runs workers [OFFSET, OFFSET + SHARE)
    of CONCURRENCY: the same lengths and duration, prompts of its own (seed + index, so
    the processes do not send the same prompts at once) and, in request-count mode,
    its workers' part of the requests."""
    requests = workload.requests
    if workload.duration_s is None:
        requests = sum(shares(workload.requests, concurrency)[offset:offset + share])
    prefix_seed = workload.seed if workload.prefix_seed is None else workload.prefix_seed
    return replace(workload, seed=workload.seed + index, requests=requests, prefix_seed=prefix_seed)


def _cpu_s() -> float:
    """This process's CPU seconds, all threads, user + system (nanosecond clock)."""
    return time.process_time()


def _progress(concurrency: int, done: int, total: int | None, elapsed: float) -> None:
    if total:
        width = 30
        filled = int(width * done / total)
        bar = "#" * filled + "-" * (width - filled)
        print(f"\r  c={concurrency:<3} [{bar}] {done}/{total} {elapsed:6.1f}s", end="", file=sys.stderr)
    else:
        print(f"\r  c={concurrency:<3} {done} requests {elapsed:6.1f}s", end="", file=sys.stderr)


async def warm_up(target: Target) -> None:
    """One short request so the first level does not pay for it. If it fails, so would
    every measured one (a wrong URL, kind, model or key): stop before measuring."""
    sample = await target.one("def warm_up():", 4, True)
    if not sample.ok:
        raise RuntimeError(f"the first request to {target.url} ({target.kind}) failed, nothing was measured: "
                           f"{sample.error}")


async def sweep(target: Target, workload: Workload, levels: list[int], progress: bool = True) -> list[LevelResult]:
    await target.open()
    try:
        await warm_up(target)
        return [await run_level(target, workload, c, progress) for c in levels]
    finally:
        await target.close()


def sweep_processes(spec: dict[str, Any], workload: Workload, levels: list[int], processes: int,
                    progress: bool = True) -> tuple[list[LevelResult], float]:
    """The sweep run by PROCESSES client processes, each level's concurrency shared
    out (`shares`) and started by all of them together; SPEC holds `Target`'s
    arguments. Returns the merged levels and the CPU seconds of the whole client (this
    process and its children, start-up included). One process: `sweep` in this one."""
    cpu0 = _cpu_s() + _children_cpu_s()
    if processes <= 1:
        results = asyncio.run(sweep(Target(**spec), workload, levels, progress))
        return results, round(_cpu_s() + _children_cpu_s() - cpu0, 3)
    import queue as queue_mod

    ctx = multiprocessing.get_context("spawn")  # no inherited threads or event loops
    barrier = ctx.Barrier(processes)
    results_q = ctx.Queue()
    procs = [ctx.Process(target=_client_main, name=f"bench-client-{i}", daemon=True,
                         args=(i, processes, spec, workload, levels, barrier, results_q))
             for i in range(processes)]
    for proc in procs:
        proc.start()
    got: dict[int, list[LevelPart] | str] = {}
    try:
        while len(got) < processes:
            try:
                i, parts = results_q.get(timeout=1.0)
                got[i] = parts
                if isinstance(parts, str):
                    break  # one failed: the others would wait for it at the next level
            except queue_mod.Empty:
                dead = [p.name for k, p in enumerate(procs) if k not in got and p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"client process(es) {', '.join(dead)} exited without results") from None
        for proc in procs:
            proc.join(timeout=30)
    finally:
        barrier.abort()  # frees any process still waiting for a level
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    failed = {i: v for i, v in got.items() if isinstance(v, str)}
    if failed:
        raise RuntimeError("client process(es) failed: " + "; ".join(f"{i}: {v}" for i, v in sorted(failed.items())))
    merged = [merge_parts(c, [got[i][k] for i in range(processes)])  # type: ignore[index]
              for k, c in enumerate(levels)]
    if progress:
        print(f"  {processes} client processes done", file=sys.stderr)
    return merged, round(_cpu_s() + _children_cpu_s() - cpu0, 3)


def _children_cpu_s() -> float:
    t = os.times()
    return t.children_user + t.children_system


def _client_main(index: int, processes: int, spec: dict[str, Any], workload: Workload, levels: list[int],
                 barrier: Any, results_q: Any) -> None:
    """One client process of `sweep_processes`: its share of every level, sent back as
    LevelParts (or a string saying why it failed)."""
    try:
        parts: list[LevelPart] | str = asyncio.run(_client(index, processes, spec, workload, levels, barrier))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the run
        parts = f"{type(exc).__name__}: {exc}"[:300]
    results_q.put((index, parts))


async def _client(index: int, processes: int, spec: dict[str, Any], workload: Workload, levels: list[int],
                  barrier: Any) -> list[LevelPart]:
    target = Target(**spec)
    await target.open()
    try:
        await warm_up(target)
        parts = []
        for c in levels:
            share = shares(c, processes)
            # Every process waits here, so each level starts in all of them at once.
            await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 900)
            if share[index]:
                w = part_workload(workload, index, sum(share[:index]), share[index], c)
                parts.append(await run_part(target, w, share[index], progress=False))
            else:
                parts.append(LevelPart(concurrency=0, samples=[], elapsed_s=0.0, cpu_s=0.0))
        return parts
    finally:
        await target.close()


def table(results: list[LevelResult]) -> str:
    head = (f"{'conc':>4} {'reqs':>5} {'err':>4} {'req/s':>7} {'out tok/s':>10} "
            f"{'TTFT p50':>9} {'p95':>7} {'p99':>7} {'ITL p50':>8} {'p95':>7} {'E2E p50':>8} {'p95':>7} {'p99':>7} "
            f"{'tok/event':>9}")
    rows = [head]
    for r in results:
        def ms(d: dict[str, float], k: str) -> str:
            return f"{d[k] * 1000:.0f}ms" if k in d else "-"

        rows.append(
            f"{r.concurrency:>4} {r.requests:>5} {r.errors:>4} {r.requests_per_s:>7.2f} {r.output_tokens_per_s:>10.1f} "
            f"{ms(r.ttft_s, 'p50'):>9} {ms(r.ttft_s, 'p95'):>7} {ms(r.ttft_s, 'p99'):>7} "
            f"{ms(r.itl_s, 'p50'):>8} {ms(r.itl_s, 'p95'):>7} "
            f"{ms(r.e2e_s, 'p50'):>8} {ms(r.e2e_s, 'p95'):>7} {ms(r.e2e_s, 'p99'):>7} {r.tokens_per_event:>9.2f}"
        )
    errors = [f"c={r.concurrency}: {r.first_error}" for r in results if r.first_error]
    if errors:
        rows.append("first errors: " + "; ".join(errors))
    return "\n".join(rows)


def write_json(results: list[LevelResult], path: Path, meta: dict[str, Any]) -> None:
    path.write_text(json.dumps({"meta": meta, "levels": [asdict(r) for r in results]}, indent=2) + "\n")


def plot(series: dict[str, list[LevelResult]], path: Path, title: str) -> None:
    """Throughput and latency against concurrency, one line per labelled run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, results in series.items():
        xs = [r.concurrency for r in results]
        a.plot(xs, [r.output_tokens_per_s for r in results], marker="o", label=label)
        b.plot(xs, [r.ttft_s.get("p50", float("nan")) * 1000 for r in results], marker="o", label=f"{label} TTFT p50")
        b.plot(xs, [r.e2e_s.get("p95", float("nan")) * 1000 for r in results], marker="x", linestyle="--",
               label=f"{label} E2E p95")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    a.set_ylabel("output tokens/s")
    b.set_ylabel("ms")
    b.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
