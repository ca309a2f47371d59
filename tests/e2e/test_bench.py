"""`llmhost bench` against the real server: table, JSON and PNG, token counts from the server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_bench_runs_and_writes_json_and_png(server, tmp_path: Path, kind: str):
    url = server.http if kind == "http" else server.grpc
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    cmd = [str(Path(sys.executable).parent / "llmhost"), "bench", "--kind", kind, "--url", url,
           "--model", server.name, "--concurrency", "1,4", "--requests", "8", "--output-tokens", "12",
           "--prompt-words", "8-16", "--json", str(out_json), "--plot", str(out_png)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "out tok/s" in done.stdout
    data = json.loads(out_json.read_text())
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 4]
    for lv in data["levels"]:
        assert lv["requests"] == 8 and lv["errors"] == 0
        # 8 requests x 12 tokens each, counted from the server's num_output_tokens.
        assert lv["output_tokens_per_s"] * lv["duration_s"] == pytest.approx(96, rel=1e-6)
        assert lv["ttft_s"]["p50"] > 0
        # Counted per event that carried output: at least one token an event (an event
        # counted twice, or one without output, would bring it under 1), at most a request's.
        assert 1.0 <= lv["tokens_per_event"] <= 12
    # Per engine step by default: one request at a time on an idle server gets about an
    # event a token (as test_vllm_backend_outputs sees for one stream); a stream window
    # or an uncounted event would show 2 or more.
    assert data["levels"][0]["tokens_per_event"] < 2
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
