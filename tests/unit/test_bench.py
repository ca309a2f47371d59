from __future__ import annotations

import pytest

from llmhost.bench import LevelResult, Sample, Workload, percentiles, table
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

    from llmhost.bench import Target

    async def headers() -> dict[str, str]:
        t = Target("openai", "http://127.0.0.1:9", "m", api_key="k123")
        await t.open()
        try:
            return dict(t._session.headers)
        finally:
            await t.close()

    assert asyncio.run(headers())["Authorization"] == "Bearer k123"
