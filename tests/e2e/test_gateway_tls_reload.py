"""A renewed certificate without a restart: the real gateway process, given SIGHUP,
serves new connections with the certificate now in its files, and keeps the one in
use when the files do not hold a matching pair; on the API and on /metrics, which
has TLS with the same certificate when the API has it."""

from __future__ import annotations

import shutil
import signal
import ssl
import sys
import time
from pathlib import Path

import httpx
import pytest

from llmhost.gateway.keys import hash_key
from tests.harness.certs import self_signed
from tests.harness.gateway import KEY, start_gateway, stop_gateway
from tests.harness.net import free_port


def _served_certificate(port: int) -> str:
    return ssl.get_server_certificate(("127.0.0.1", port), timeout=10)


def _pem(path: Path) -> str:
    return ssl.DER_cert_to_PEM_cert(ssl.PEM_cert_to_DER_cert(path.read_text()))


def _wait_for_line(log: Path, line: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in log.read_text():
        assert time.monotonic() < deadline, f"not in the log within {timeout_s:.0f} s: {line}\n{log.read_text()}"
        time.sleep(0.2)


def _renewable_pair(tmp_path: Path) -> tuple[Path, Path, Path, Path, Path, Path]:
    """Two self-signed pairs, a and b, and the live files the gateway reads, holding a's:
    (cert_a, key_a, cert_b, key_b, live cert, live key)."""
    (tmp_path / "live").mkdir()
    cert_a, key_a = self_signed(tmp_path / "a")
    cert_b, key_b = self_signed(tmp_path / "b")
    cert, key = tmp_path / "live" / "gateway.crt", tmp_path / "live" / "gateway.key"
    shutil.copy(cert_a, cert)
    shutil.copy(key_a, key)
    return cert_a, key_a, cert_b, key_b, cert, key


def test_sighup_reloads_the_certificate_and_a_bad_pair_keeps_the_old_one(tmp_path):
    cert_a, key_a, cert_b, key_b, cert, key = _renewable_pair(tmp_path)
    keys = tmp_path / "keys.yml"
    keys.write_text(f"keys:\n  - name: tester\n    sha256: {hash_key(KEY)}\n")
    port = free_port()
    url = f"https://127.0.0.1:{port}/v1"
    log = tmp_path / "gateway.log"
    cmd = [str(Path(sys.executable).parent / "llmhost"), "gateway", "--upstream", f"127.0.0.1:{free_port()}",
           "--model", "m", "--listen", f"127.0.0.1:{port}", "--keys-file", str(keys),
           "--metrics-listen", f"127.0.0.1:{free_port()}", "--tls-cert", str(cert), "--tls-key", str(key)]
    proc = start_gateway(cmd, log, url, verify=ssl.create_default_context(cafile=str(cert_a)))
    try:
        assert _served_certificate(port) == _pem(cert_a)

        shutil.copy(cert_b, cert)
        shutil.copy(key_b, key)
        proc.send_signal(signal.SIGHUP)
        _wait_for_line(log, f"certificate reloaded from {cert}")
        assert _served_certificate(port) == _pem(cert_b)
        trust_b = ssl.create_default_context(cafile=str(cert_b))
        r = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}, verify=trust_b, timeout=10)
        assert r.status_code == 200, r.text

        shutil.copy(key_a, key)  # B's certificate with A's key: not a pair
        proc.send_signal(signal.SIGHUP)
        _wait_for_line(log, "kept the certificate in use")
        assert _served_certificate(port) == _pem(cert_b)
        r = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"}, verify=trust_b, timeout=10)
        assert r.status_code == 200, r.text
        assert proc.poll() is None
    finally:
        stop_gateway(proc, log)


METRICS_TOKEN = "scrape-token-0123456789abcdef"


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_metrics_are_served_over_tls_and_a_renewed_certificate_reaches_them_on_sighup(tmp_path, workers):
    """With TLS on the API, /metrics answers TLS with the same certificate and nothing in
    plaintext; after SIGHUP (to the one process, or to the supervisor of two workers) its
    new connections get the renewed certificate, and the token still gets the metrics."""
    cert_a, _, cert_b, key_b, cert, key = _renewable_pair(tmp_path)
    keys = tmp_path / "keys.yml"
    keys.write_text(f"keys:\n  - name: tenant-alice\n    sha256: {hash_key(KEY)}\n")
    token = tmp_path / "metrics-token.sha256"
    token.write_text(hash_key(METRICS_TOKEN) + "\n")
    port, metrics_port = free_port(), free_port()
    url = f"https://127.0.0.1:{port}/v1"
    log = tmp_path / "gateway.log"
    cmd = [str(Path(sys.executable).parent / "llmhost"), "gateway", "--upstream", f"127.0.0.1:{free_port()}",
           "--model", "m", "--listen", f"127.0.0.1:{port}", "--keys-file", str(keys),
           "--metrics-listen", f"127.0.0.1:{metrics_port}", "--metrics-token-file", str(token),
           "--tls-cert", str(cert), "--tls-key", str(key), "--workers", str(workers)]
    trust_a = ssl.create_default_context(cafile=str(cert_a))
    proc = start_gateway(cmd, log, url, verify=trust_a)
    bearer = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    try:
        assert _served_certificate(metrics_port) == _pem(cert_a)
        r = httpx.get(f"https://127.0.0.1:{metrics_port}/metrics", headers=bearer, verify=trust_a, timeout=10)
        assert r.status_code == 200 and "llmhost_gateway" in r.text, r.text
        with pytest.raises(httpx.TransportError):  # plaintext: no answer, no metrics
            httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", headers=bearer, timeout=10)

        shutil.copy(cert_b, cert)
        shutil.copy(key_b, key)
        proc.send_signal(signal.SIGHUP)
        # One process reloads the API's and /metrics' contexts at once; a supervisor its /metrics.
        _wait_for_line(log, f"certificate reloaded from {cert}" + (" (/metrics)" if workers > 1 else ""))
        assert _served_certificate(metrics_port) == _pem(cert_b)
        trust_b = ssl.create_default_context(cafile=str(cert_b))
        r = httpx.get(f"https://127.0.0.1:{metrics_port}/metrics", headers=bearer, verify=trust_b, timeout=10)
        assert r.status_code == 200 and "llmhost_gateway" in r.text, r.text
        r = httpx.get(f"https://127.0.0.1:{metrics_port}/metrics", verify=trust_b, timeout=10)
        assert r.status_code == 401 and "llmhost_gateway" not in r.text
        assert proc.poll() is None
    finally:
        stop_gateway(proc, log)
