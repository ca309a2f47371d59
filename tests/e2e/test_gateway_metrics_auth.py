"""The gateway's /metrics with a token, as the gateway process serves it (one process,
and the supervisor of several workers): a scrape without the token is refused (401,
no metrics, no key names), one with it (Bearer, or basic auth as Prometheus sends it)
gets the metrics. No upstream needs to run: the listener is the gateway's own."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmhost.gateway.keys import hash_key
from tests.harness.gateway import KEY, start_gateway, stop_gateway
from tests.harness.net import free_port

TOKEN = "scrape-token-0123456789abcdef"


@pytest.fixture(params=[1, 2], ids=["one-process", "two-workers"])
def metrics_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    keys = tmp_path / "keys.yml"
    keys.write_text(f"keys:\n  - name: tenant-alice\n    sha256: {hash_key(KEY)}\n")
    token = tmp_path / "metrics-token.sha256"
    token.write_text(hash_key(TOKEN) + "\n")
    port, metrics_port = free_port(), free_port()
    log = tmp_path / "gateway.log"
    url = f"http://127.0.0.1:{port}/v1"
    cmd = [str(Path(sys.executable).parent / "llmhost"), "gateway", "--upstream", f"127.0.0.1:{free_port()}",
           "--listen", f"127.0.0.1:{port}", "--keys-file", str(keys), "--model", "m",
           "--metrics-listen", f"127.0.0.1:{metrics_port}", "--metrics-token-file", str(token),
           "--workers", str(request.param)]
    proc = start_gateway(cmd, log, url)
    try:
        # A request of the key, so that its name is in the metrics.
        httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}).raise_for_status()
        yield f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        stop_gateway(proc, log)


def test_an_unauthenticated_scrape_is_refused(metrics_url: str):
    for auth in [None, ("prometheus", "wrong-password"), ("prometheus", KEY)]:
        r = httpx.get(metrics_url, auth=auth)
        assert r.status_code == 401, r.text
        assert "tenant-alice" not in r.text and "llmhost_gateway" not in r.text
    r = httpx.get(metrics_url, headers={"Authorization": f"Bearer {KEY}"})  # an API key is not the token
    assert r.status_code == 401


def test_the_token_gets_the_metrics(metrics_url: str):
    for kwargs in [{"headers": {"Authorization": f"Bearer {TOKEN}"}}, {"auth": ("prometheus", TOKEN)}]:
        r = httpx.get(metrics_url, **kwargs)
        assert r.status_code == 200, r.text
        assert 'key="tenant-alice"' in r.text and "llmhost_gateway_requests_total" in r.text
