"""Prometheus scrapes the gateway's /metrics with the token, as roles/prometheus
configures it: a real gateway (a token file, no upstream needed) and Debian's real
Prometheus with the prometheus.yml the role renders for an inventory in which the
gateway asks for a token. The gateway target is up and its series arrive; with another
token in the credentials file the scrape gets 401 and the target goes down."""

from __future__ import annotations

import json
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import httpx

from llmhost.gateway.keys import hash_key
from tests.harness.gateway import KEY, start_gateway, stop_gateway
from tests.harness.net import free_port
from tests.harness.prom import Prometheus
from tests.monitoring.test_prometheus_config import inventory, render

TOKEN = "gateway-scrape-token-0123456789"


def _gateway_target(prom: Prometheus, deadline_s: float, want: str) -> dict[str, object]:
    """The gateway job's target once its health is WANT (or the last seen when time runs out)."""
    deadline = time.monotonic() + deadline_s
    target: dict[str, object] = {}
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{prom.url}/api/v1/targets", timeout=5) as r:
            active = json.loads(r.read())["data"]["activeTargets"]
        target = next((t for t in active if t["labels"]["job"] == "gateway"), {})
        if target.get("health") == want:
            return target
        time.sleep(0.5)
    return target


def test_prometheus_scrapes_the_gateway_with_its_token(tmp_path: Path):
    keys = tmp_path / "keys.yml"
    keys.write_text(f"keys:\n  - name: tenant-alice\n    sha256: {hash_key(KEY)}\n")
    token_hash = tmp_path / "metrics-token.sha256"
    token_hash.write_text(hash_key(TOKEN) + "\n")
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}/v1"
    log = tmp_path / "gateway.log"
    cmd = [str(Path(sys.executable).parent / "llmhost"), "gateway", "--upstream", f"127.0.0.1:{free_port()}",
           "--listen", f"127.0.0.1:{port}", "--keys-file", str(keys), "--model", "m",
           "--metrics-listen", f"127.0.0.1:{metrics_port}", "--metrics-token-file", str(token_hash), "--workers", "1"]
    gateway = start_gateway(cmd, log, url)
    try:
        httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}).raise_for_status()
        inv = inventory(tmp_path, {"gw-01": {
            "ansible_host": "127.0.0.1", "prometheus_scrape_address": "127.0.0.1",
            "llmhost_metrics_bind_address": "127.0.0.1", "gateway_api_keys": [{"name": "a", "sha256": "0" * 64}],
            "gateway_metrics_port": metrics_port, "gateway_metrics_token": TOKEN}}, monitoring="mon-01")
        credentials = tmp_path / "gateway-metrics-token"
        credentials.write_text(TOKEN)
        r = render(tmp_path, inv, prometheus_gateway_metrics_token=TOKEN, prometheus_scrape_interval="1s",
                   prometheus_scrape_timeout="1s", _prometheus_gateway_token_file=str(credentials))
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        config = (tmp_path / "out" / "prometheus.yml").read_text()
        assert TOKEN not in config
        with Prometheus(tmp_path / "prometheus", config) as prom:
            target = _gateway_target(prom, 60, "up")
            assert target.get("health") == "up", target
            assert target["scrapeUrl"] == f"http://127.0.0.1:{metrics_port}/metrics"
            query = urllib.parse.quote('llmhost_gateway_requests_total{job="gateway"}')
            with urllib.request.urlopen(f"{prom.url}/api/v1/query?query={query}", timeout=5) as q:
                series = json.loads(q.read())["data"]["result"]
            assert {s["metric"]["key"] for s in series} == {"tenant-alice"}, series

            credentials.write_text("another-token-0123456789")  # read again at every scrape
            target = _gateway_target(prom, 60, "down")
            assert target.get("health") == "down" and "401" in str(target.get("lastError")), target
    finally:
        stop_gateway(gateway, log)


def test_prometheus_scrapes_a_gateway_with_tls_over_https_with_its_ca(tmp_path: Path):
    """A gateway with a certificate serves /metrics over HTTPS with it; the prometheus.yml
    the role renders for it (gateway_tls_cert_file set) scrapes with scheme https and the
    CA file: up, series arrive. With another CA in that file the scrape fails and the
    target goes down."""
    import ssl

    from tests.harness.certs import self_signed

    cert, key = self_signed(tmp_path / "tls")
    other, _ = self_signed(tmp_path / "other")
    keys = tmp_path / "keys.yml"
    keys.write_text(f"keys:\n  - name: tenant-alice\n    sha256: {hash_key(KEY)}\n")
    token_hash = tmp_path / "metrics-token.sha256"
    token_hash.write_text(hash_key(TOKEN) + "\n")
    port, metrics_port = free_port(), free_port()
    url = f"https://127.0.0.1:{port}/v1"
    log = tmp_path / "gateway.log"
    cmd = [str(Path(sys.executable).parent / "llmhost"), "gateway", "--upstream", f"127.0.0.1:{free_port()}",
           "--listen", f"127.0.0.1:{port}", "--keys-file", str(keys), "--model", "m",
           "--metrics-listen", f"127.0.0.1:{metrics_port}", "--metrics-token-file", str(token_hash),
           "--tls-cert", str(cert), "--tls-key", str(key), "--workers", "1"]
    trust = ssl.create_default_context(cafile=str(cert))
    gateway = start_gateway(cmd, log, url, verify=trust)
    try:
        httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}, verify=trust).raise_for_status()
        inv = inventory(tmp_path, {"gw-01": {
            "ansible_host": "127.0.0.1", "prometheus_scrape_address": "127.0.0.1",
            "llmhost_metrics_bind_address": "127.0.0.1", "gateway_api_keys": [{"name": "a", "sha256": "0" * 64}],
            "gateway_metrics_port": metrics_port, "gateway_metrics_token": TOKEN,
            "gateway_tls_cert_file": "/etc/ssl/gw.crt", "gateway_tls_key_file": "/etc/ssl/gw.key"}},
            monitoring="mon-01")
        credentials = tmp_path / "gateway-metrics-token"
        credentials.write_text(TOKEN)
        ca = tmp_path / "gateway-ca.crt"
        ca.write_bytes(cert.read_bytes())
        r = render(tmp_path, inv, prometheus_gateway_metrics_token=TOKEN, prometheus_scrape_interval="1s",
                   prometheus_scrape_timeout="1s", _prometheus_gateway_token_file=str(credentials),
                   prometheus_gateway_metrics_ca_file=str(ca))
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        config = (tmp_path / "out" / "prometheus.yml").read_text()
        with Prometheus(tmp_path / "prometheus", config) as prom:
            target = _gateway_target(prom, 60, "up")
            assert target.get("health") == "up", target
            assert target["scrapeUrl"] == f"https://127.0.0.1:{metrics_port}/metrics"
            query = urllib.parse.quote('llmhost_gateway_requests_total{job="gateway"}')
            with urllib.request.urlopen(f"{prom.url}/api/v1/query?query={query}", timeout=5) as q:
                series = json.loads(q.read())["data"]["result"]
            assert {s["metric"]["key"] for s in series} == {"tenant-alice"}, series

            ca.write_bytes(other.read_bytes())  # a CA that did not sign the gateway's certificate
            target = _gateway_target(prom, 60, "down")
            assert target.get("health") == "down" and "certificate" in str(target.get("lastError")), target
    finally:
        stop_gateway(gateway, log)
