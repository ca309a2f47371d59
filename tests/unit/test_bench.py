from __future__ import annotations

import json

import pytest

from llmhost.bench.loadgen import (
    LevelPart,
    LevelResult,
    Sample,
    Workload,
    merge_parts,
    part_workload,
    percentiles,
    shares,
    table,
)
from llmhost.cli import build_parser


def test_workload_is_seeded_and_ranged():
    w = Workload(prompt_words=3, prompt_words_max=9, output_tokens=10, output_tokens_max=20, seed=5)
    a, b = w.items(50), w.items(50)
    assert a == b
    assert all(3 <= len(p.split()) <= 9 and 10 <= t <= 20 for p, t in a)
    assert len({t for _, t in a}) > 1
    assert Workload(seed=6, output_tokens_max=500).items(20) != Workload(seed=5, output_tokens_max=500).items(20)


def test_percentiles_and_itl():
    p = percentiles([float(v) for v in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert percentiles([]) == {}
    assert Sample(ok=True, ttft=0.1, e2e=1.1, tokens=11).itl == pytest.approx(0.1)
    assert Sample(ok=True, ttft=0.1, e2e=0.1, tokens=1).itl is None


def test_table_shows_errors():
    r = LevelResult(concurrency=4, requests=10, errors=2, duration_s=1.0, requests_per_s=8.0,
                    output_tokens_per_s=100.0, ttft_s={"p50": 0.01, "p95": 0.02, "p99": 0.03},
                    first_error="HTTP 400: nope")
    out = table([r])
    assert "   4    10    2" in out and "c=4: HTTP 400: nope" in out


@pytest.mark.parametrize("argv", [["--concurrency", "0"], ["--concurrency", "a,b"], ["--output-tokens", "9-3"]])
def test_bad_bench_arguments(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", *argv])
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, "  \n"])
def test_an_unreadable_or_empty_key_file_is_a_clear_error(content, tmp_path, capsys):
    from llmhost.cli import main

    key = tmp_path / "key"
    if content is not None:
        key.write_text(content)
    rc = main(["bench", "--kind", "openai", "--url", "http://127.0.0.1:9", "--api-key-file", str(key)])
    err = capsys.readouterr().err
    assert rc == 2 and "--api-key-file" in err and ("cannot read" if content is None else "is empty") in err


def test_the_api_key_is_sent_as_a_bearer_token():
    import asyncio

    from llmhost.bench.loadgen import Target

    async def headers() -> dict[str, str]:
        t = Target("openai", "http://127.0.0.1:9", "m", api_key="k123")
        await t.open()
        try:
            return dict(t._session.headers)
        finally:
            await t.close()

    assert asyncio.run(headers())["Authorization"] == "Bearer k123"


# --- several client processes (`llmhost bench --processes N`) -------------------------

def _part(c: int, tokens: list[int], elapsed: float, cpu: float = 0.5, errors: int = 0) -> LevelPart:
    samples = [Sample(ok=True, ttft=0.01 * (i + 1), e2e=1.0 + i, tokens=t) for i, t in enumerate(tokens)]
    samples += [Sample(ok=False, error=f"boom {i}") for i in range(errors)]
    return LevelPart(concurrency=c, samples=samples, elapsed_s=elapsed, cpu_s=cpu, started_at=99.0 + elapsed)


def test_merged_parts_sum_rates_and_take_percentiles_over_all_samples():
    a = _part(2, [100, 100], elapsed=2.0, cpu=0.25)       # 100 tok/s, 1 req/s
    b = _part(1, [100, 100, 100], elapsed=1.0, cpu=0.5, errors=1)  # 300 tok/s, 3 req/s
    idle = LevelPart(concurrency=0, samples=[], elapsed_s=0.0, cpu_s=0.0)
    r = merge_parts(3, [a, b, idle])
    assert (r.concurrency, r.requests, r.errors, r.first_error) == (3, 6, 1, "boom 0")
    assert r.output_tokens_per_s == pytest.approx(400.0) and r.requests_per_s == pytest.approx(4.0)
    assert r.duration_s == 2.0 and r.client_cpu_s == pytest.approx(0.75) and r.client_processes == 2
    assert r.client_cpu_max_s == pytest.approx(0.5) and r.started_at == 100.0
    # Percentiles over the five good samples of both parts, not a mean of the parts' own.
    assert r.ttft_s == percentiles([0.01, 0.02, 0.01, 0.02, 0.03])
    assert r.e2e_s["p50"] == pytest.approx(2.0)


def test_tokens_per_event_tells_how_the_server_streamed():
    per_token = [Sample(ok=True, ttft=0.1, e2e=1.0, tokens=8, events=8)] * 2
    grouped = [Sample(ok=True, ttft=0.1, e2e=1.0, tokens=8, events=2), Sample(ok=True, ttft=0.1, e2e=1.0, tokens=4,
                                                                             events=2)]
    failed = [Sample(ok=False, error="boom", events=3)]  # a failed request's events count for nothing
    assert merge_parts(2, [LevelPart(2, per_token + failed, elapsed_s=1.0, cpu_s=0.1)]).tokens_per_event == 1.0
    assert merge_parts(2, [LevelPart(2, grouped, elapsed_s=1.0, cpu_s=0.1)]).tokens_per_event == 3.0
    assert merge_parts(1, [LevelPart(1, failed, elapsed_s=1.0, cpu_s=0.1)]).tokens_per_event == 0.0
    assert "tok/event" in table([merge_parts(2, [LevelPart(2, grouped, elapsed_s=1.0, cpu_s=0.1)])])


def test_one_part_is_the_single_process_result():
    r = merge_parts(4, [_part(4, [10, 20], elapsed=0.5, cpu=0.1)])
    assert r.output_tokens_per_s == pytest.approx(60.0) and r.client_processes == 1 and r.requests == 2


def test_concurrency_and_requests_are_shared_out():
    assert shares(16, 8) == [2] * 8 and shares(1, 8) == [1] + [0] * 7 and shares(10, 4) == [3, 3, 2, 2]
    w = Workload(requests=10, seed=7)
    # c=4 over 2 processes: workers 0-1 and 2-3; requests 3,3,2,2 per worker.
    assert part_workload(w, 0, 0, 2, 4).requests == 6 and part_workload(w, 1, 2, 2, 4).requests == 4
    assert part_workload(w, 1, 2, 2, 4).seed == 8  # prompts of its own
    d = Workload(duration_s=5.0, seed=7)
    assert part_workload(d, 3, 3, 1, 4).duration_s == 5.0 and part_workload(d, 3, 3, 1, 4).seed == 10


def test_processes_argument():
    assert build_parser().parse_args(["bench"]).processes == 1
    assert build_parser().parse_args(["bench", "--processes", "8"]).processes == 8


@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_bad_processes_argument(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--processes", value])
    assert "--processes" in capsys.readouterr().err


def _fake_triton(status: int = 200, hits: list[str] | None = None) -> tuple[str, object]:
    """A /generate_stream that streams 3 events and reports 3 tokens, on a thread; with
    STATUS other than 200 it answers every request with that status (each request's
    path appended to HITS)."""
    import asyncio
    import threading

    from aiohttp import web

    async def handler(request: web.Request) -> web.StreamResponse:
        if hits is not None:
            hits.append(request.path)
        if status != 200:
            return web.json_response({"error": "no such model"}, status=status)
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = min(3, int(body["max_tokens"]))
        for i in range(n):
            event = {"text_output": "x", "num_output_tokens": i + 1 if i == n - 1 else None}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            await asyncio.sleep(0.005)
        return resp

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v2/models/m/generate_stream", handler)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)

    return f"http://127.0.0.1:{port}", stop


def test_two_client_processes_against_a_fake_server(tmp_path):
    from llmhost.cli import main

    url, stop = _fake_triton()
    try:
        out = tmp_path / "r.json"
        rc = main(["bench", "--url", url, "--model", "m", "--concurrency", "1,3", "--requests", "6",
                   "--processes", "2", "--quiet", "--json", str(out)])
    finally:
        stop()  # type: ignore[operator]
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["meta"]["processes"] == 2 and record["meta"]["client_cpu_s"] > 0
    one, three = record["levels"]
    assert (one["requests"], one["errors"], one["client_processes"]) == (6, 0, 1)  # c=1: one process works
    assert (three["requests"], three["errors"], three["client_processes"]) == (6, 0, 2)
    assert three["output_tokens_per_s"] > 0 and 0 < three["client_cpu_max_s"] <= three["client_cpu_s"]
    # 3 events of one token each (the fake server's counts: None, None, 3).
    assert one["tokens_per_event"] == three["tokens_per_event"] == 1.0


@pytest.mark.parametrize("processes", [1, 2])
def test_a_failing_first_request_stops_before_measuring(processes, tmp_path, capsys):
    """A wrong URL or model fails the warm-up: a clear error and exit 1, not a sweep of
    failed requests, and no client process left waiting for the others."""
    from llmhost.cli import main

    hits: list[str] = []
    url, stop = _fake_triton(status=404, hits=hits)
    try:
        out = tmp_path / "r.json"
        rc = main(["bench", "--url", url, "--model", "m", "--concurrency", "1,4", "--duration", "30",
                   "--processes", str(processes), "--quiet", "--json", str(out)])
    finally:
        stop()  # type: ignore[operator]
    err = capsys.readouterr().err
    assert rc == 1 and "failed, nothing was measured: HTTP 404" in err and "no such model" in err
    assert len(hits) <= processes and not out.exists()


@pytest.mark.parametrize(("kind", "url", "expected"), [
    ("openai", "http://127.0.0.1:18080/v1", "http://127.0.0.1:18080"),
    ("openai", "http://127.0.0.1:18080/v1/", "http://127.0.0.1:18080"),
    ("openai", "http://127.0.0.1:18080", "http://127.0.0.1:18080"),
    ("http", "http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
])
def test_an_openai_base_url_is_taken_with_or_without_v1(kind, url, expected):
    from llmhost.bench.loadgen import Target

    assert Target(kind, url, "m").url == expected


def test_shared_prefixes_start_every_prompt_and_client_processes_share_them():
    w = Workload(prompt_words=5, seed=3, shared_prefixes=4, prefix_words=50)
    items = w.items(12)
    prefixes = w.prefixes()
    assert len(prefixes) == 4 and len(set(prefixes)) == 4
    assert all(len(p.split()) == 52 for p in prefixes)  # "Context i:" and 50 words
    for i, (prompt, _) in enumerate(items):
        head, _, own = prompt.partition("\n")
        assert head == prefixes[i % 4] and len(own.split()) == 5
    assert len({p for p, _ in items}) == 12  # each prompt's own words differ
    # A second client process: its own words, the same prefixes.
    other = part_workload(w, 1, 0, 1, 1)
    assert other.prefixes() == prefixes and other.items(4) != w.items(4)
    assert Workload(seed=4, shared_prefixes=4, prefix_words=50).prefixes() != prefixes
    assert Workload(prompt_words=5).prefixes() == []


def test_bench_refuses_half_a_shared_prefix_workload(capsys: pytest.CaptureFixture[str]):
    from llmhost.cli import main

    assert main(["bench", "--shared-prefixes", "8"]) == 2
    assert "--shared-prefixes N and --prefix-words N go together" in capsys.readouterr().err


# --- multi-turn chat (`llmhost bench --turns N`) -------------------------------------

def test_conversations_take_their_system_prompt_from_the_shared_prefixes():
    w = Workload(prompt_words=3, seed=5, shared_prefixes=2, prefix_words=10, turns=3)
    conversations = w.conversations(4)
    prefixes = w.prefixes()
    assert [c.system for c in conversations] == [prefixes[0], prefixes[1], prefixes[0], prefixes[1]]
    assert all(len(c.turns) == 3 for c in conversations)
    texts = [t for c in conversations for t, _ in c.turns]
    assert len(set(texts)) == len(texts) and all(len(t.split()) == 3 for t in texts)
    assert all(c.system is None for c in Workload(prompt_words=3, turns=2).conversations(2))


class _ChatRecorder:
    """Stands in for a Target: records each turn's history and session, replies with
    the turn's number (the NTH reply fails when FAIL_AT is N)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[list[dict[str, str]], str | None]] = []
        self.fail_at = fail_at

    async def one(self, prompt: str, max_tokens: int, ignore_eos: bool,
                  history: list[dict[str, str]] | None = None, session: str | None = None) -> Sample:
        assert history is not None and history[-1] == {"role": "user", "content": prompt}
        self.calls.append((history, session))
        if len(self.calls) == self.fail_at:
            return Sample(ok=False, error="HTTP 503")
        return Sample(ok=True, ttft=0.01, e2e=0.02, tokens=max_tokens, text=f"reply {len(self.calls)}")


def test_each_turn_resends_the_history_with_the_conversations_session():
    import asyncio

    from llmhost.bench.loadgen import run_part

    w = Workload(requests=7, prompt_words=2, output_tokens=4, shared_prefixes=1, prefix_words=5, turns=3)
    fake = _ChatRecorder()
    part = asyncio.run(run_part(fake, w, concurrency=1, progress=False))  # type: ignore[arg-type]
    assert len(part.samples) == 7 and all(s.ok for s in part.samples)
    sessions = [s for _, s in fake.calls]
    assert sessions == ["bench-0-0"] * 3 + ["bench-0-1"] * 3 + ["bench-0-2"]
    third, fourth = fake.calls[2][0], fake.calls[3][0]
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in third if m["role"] == "assistant"] == ["reply 1", "reply 2"]
    assert [m["role"] for m in fourth] == ["system", "user"]  # a new conversation starts over


def test_a_failed_turn_ends_its_conversation():
    import asyncio

    from llmhost.bench.loadgen import run_part

    fake = _ChatRecorder(fail_at=2)
    part = asyncio.run(run_part(fake, Workload(requests=4, prompt_words=2, turns=3), concurrency=1,  # type: ignore[arg-type]
                                progress=False))
    assert [s.ok for s in part.samples] == [True, False, True, True]
    assert [s for _, s in fake.calls] == ["bench-0-0", "bench-0-0", "bench-0-1", "bench-0-1"]


@pytest.mark.parametrize("argv", [["--turns", "2"], ["--turns", "2", "--kind", "openai", "--client", "vllm"]])
def test_bench_refuses_turns_without_the_openai_chat_client(argv: list[str], capsys: pytest.CaptureFixture[str]):
    from llmhost.cli import main

    assert main(["bench", *argv]) == 2
    assert "--turns needs --kind openai" in capsys.readouterr().err
