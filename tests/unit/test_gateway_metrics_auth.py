"""The gateway's /metrics names the keys: with a token file a scrape needs the token
(Bearer, or basic auth with it as the password), else 401 with no metrics; off
loopback without a token the gateway refuses to start unless asked to."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import httpx
import pytest

from llmhost.gateway.cli import build_parser, metrics_token, settings
from llmhost.gateway.config import ConfigError, GatewayConfig, parse_config
from llmhost.gateway.keys import hash_key
from llmhost.gateway.metrics import GatewayMetrics, metrics_app, presented_token

TOKEN = "metrics-token-0123456789"


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _get(app, headers: dict[str, str], path: str = "/metrics") -> httpx.Response:
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://m") as c:
            return await c.get(path, headers=headers)

    return asyncio.run(run())


def _metrics() -> GatewayMetrics:
    metrics = GatewayMetrics(["m"])
    metrics.requests.labels("m", "alice-key-name", "200").inc()
    return metrics


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer"}, {"Authorization": "Bearer wrong-token-0123456789"},
    {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": f"Token {TOKEN}"}, {"Authorization": TOKEN},
    {"Authorization": _basic("prometheus", "wrong")}, {"Authorization": _basic(TOKEN, "")},
    {"Authorization": "Basic !!notbase64"}, {"Authorization": f"Bearer {hash_key(TOKEN)}"},
])
def test_a_scrape_without_the_token_gets_401_and_no_metrics(headers):
    r = _get(metrics_app(_metrics(), hash_key(TOKEN)), headers)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert "alice-key-name" not in r.text and "llmhost_gateway" not in r.text
    # Nothing else is answered without it either (no 404 telling paths apart).
    assert _get(metrics_app(_metrics(), hash_key(TOKEN)), headers, "/other").status_code == 401


@pytest.mark.parametrize("authorization", [f"Bearer {TOKEN}", f"bearer  {TOKEN} ", _basic("prometheus", TOKEN),
                                           _basic("", TOKEN)])
def test_a_scrape_with_the_token_gets_the_metrics(authorization):
    r = _get(metrics_app(_metrics(), hash_key(TOKEN)), {"Authorization": authorization})
    assert r.status_code == 200 and 'key="alice-key-name"' in r.text
    assert _get(metrics_app(_metrics(), hash_key(TOKEN)), {"Authorization": authorization}, "/x").status_code == 404


def test_without_a_token_file_metrics_are_open_as_before():
    assert _get(metrics_app(_metrics()), {}).status_code == 200


def test_presented_token_reads_bearer_and_basic_only():
    assert presented_token(f"Bearer {TOKEN}".encode()) == TOKEN
    assert presented_token(_basic("u", "p:q").encode()) == "p:q"
    assert presented_token(None) is None and presented_token(b"Digest x") is None


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("listen", ["0.0.0.0:18081", "[::]:18081", "10.0.0.5:18081"])
def test_metrics_off_loopback_need_a_token_or_an_explicit_allowance(listen, tmp_path: Path):
    base = ["--keys-file", "/k", "--model", "m", "--metrics-listen", listen]
    with pytest.raises(ConfigError) as info:
        settings(_args(*base))
    assert "--metrics-token-file" in str(info.value) and "--allow-anonymous-metrics" in str(info.value)
    assert settings(_args(*base, "--allow-anonymous-metrics")).allow_anonymous_metrics
    token_file = tmp_path / "token.sha256"
    token_file.write_text(hash_key(TOKEN) + "\n")
    config = settings(_args(*base, "--metrics-token-file", str(token_file)))
    assert metrics_token(config) == hash_key(TOKEN)
    assert settings(_args("--keys-file", "/k", "--model", "m", "--metrics-listen", "127.0.0.1:1")).metrics_listen


@pytest.mark.parametrize("content", ["", TOKEN, hash_key(TOKEN)[:-1], hash_key(TOKEN) + "0", "z" * 64])
def test_a_token_file_without_a_sha256_is_refused_by_name(content, tmp_path: Path):
    path = tmp_path / "token"
    path.write_text(content)
    with pytest.raises(ConfigError, match="--metrics-token-file") as info:
        metrics_token(GatewayConfig(metrics_token_file=path))
    assert TOKEN not in str(info.value)
    with pytest.raises(ConfigError, match="cannot read"):
        metrics_token(GatewayConfig(metrics_token_file=tmp_path / "missing"))


def test_the_config_file_takes_the_token_file_and_the_allowance(tmp_path: Path):
    got = parse_config("metrics_token_file: token.sha256\nallow_anonymous_metrics: true\n", base=tmp_path)
    assert got == {"metrics_token_file": tmp_path / "token.sha256", "allow_anonymous_metrics": True}
    with pytest.raises(ConfigError, match="allow_anonymous_metrics"):
        parse_config("allow_anonymous_metrics: 1\n")


def test_the_cli_exits_2_naming_a_bad_token_file(tmp_path: Path, capsys):
    from llmhost.cli import main

    keys = tmp_path / "keys.yml"
    keys.write_text(f"keys:\n  - name: t\n    sha256: {hash_key(TOKEN)}\n")
    bad = tmp_path / "token"
    bad.write_text(TOKEN)
    code = main(["gateway", "--keys-file", str(keys), "--model", "m", "--metrics-token-file", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and "--metrics-token-file" in err and TOKEN not in err and "Traceback" not in err
