"""The access log: one JSON object per request on stderr with who, what, how long
and how many tokens; never the key, the Authorization header or the prompt."""

from __future__ import annotations

import asyncio
import json

from llmhost.gateway.accesslog import AccessLog
from tests.unit._gateway_fakes import KEY, Fake, client, make_app

PROMPT = "my very private prompt 31337"


def _log_of_requests() -> list[dict[str, object]]:
    lines: list[str] = []
    app = make_app(Fake(), access_log=AccessLog(lines.append))

    async def run() -> None:
        async with client(app) as c:
            body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}]}
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
            assert (await c.post("/v1/chat/completions", json={**body, "stream": True})).status_code == 200
            r = await c.post("/v2/models/m/generate_stream", json={"text_input": PROMPT})
            assert r.status_code == 200
            r = await c.post("/v1/completions?prompt=x", json={"model": "m", "prompt": PROMPT},
                             headers={"Authorization": f"Bearer {KEY}x"})
            assert r.status_code == 401

    asyncio.run(run())
    assert all(line.count("\n") == 0 for line in lines)
    text = "\n".join(lines)
    assert KEY not in text and PROMPT not in text and "Bearer" not in text and "prompt=x" not in text
    return [json.loads(line) for line in lines]


def test_one_json_line_per_request_with_its_fields():
    plain, stream, native, refused = _log_of_requests()
    fields = {"time", "key", "method", "path", "model", "status", "duration_s", "ttft_s", "prompt_tokens",
              "completion_tokens", "upstream", "client"}
    assert set(plain) == fields
    assert plain["key"] == "alice" and plain["method"] == "POST" and plain["path"] == "/v1/chat/completions"
    assert plain["model"] == "m" and plain["status"] == 200 and plain["upstream"] == "up:1"
    assert plain["prompt_tokens"] == 3 and plain["completion_tokens"] == 4 and plain["ttft_s"] is None
    assert plain["client"] == "10.1.2.3:4567" and str(plain["time"]).endswith("+00:00")
    assert isinstance(plain["duration_s"], float) and plain["duration_s"] >= 0
    assert isinstance(stream["ttft_s"], float) and stream["completion_tokens"] == 4
    assert native["path"] == "/v2/models/m/generate_stream" and native["completion_tokens"] == 2
    assert native["prompt_tokens"] == 3
    assert refused["status"] == 401 and refused["key"] is None and refused["upstream"] is None
    assert refused["path"] == "/v1/completions"


def test_a_rate_limited_request_names_the_limit():
    from tests.unit._gateway_fakes import chat, keystore

    lines: list[str] = []
    app = make_app(Fake(), keystore(max_concurrent=1, rpm=1), access_log=AccessLog(lines.append))

    async def run() -> None:
        async with client(app) as c:
            await c.post("/v1/chat/completions", content=chat())
            await c.post("/v1/chat/completions", content=chat())

    asyncio.run(run())
    assert json.loads(lines[1])["status"] == 429 and json.loads(lines[1])["rate_limited"] == "rpm"
