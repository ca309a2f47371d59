"""/metrics over HTTPS: by default when the API has TLS, with the same certificate and
key (--metrics-tls / --no-metrics-tls, metrics_tls: in the config file); SIGHUP loads
the pair again into every listener's context, and a pair that does not load leaves
all of them as they were."""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import pytest

from llmhost.gateway.cli import build_parser, metrics_tls, reload_tls, settings, uvicorn_configs
from llmhost.gateway.config import ConfigError, GatewayConfig
from tests.harness.certs import self_signed


def _settings(*argv: str) -> GatewayConfig:
    return settings(build_parser().parse_args(["--keys-file", "/k", "--model", "m", *argv]))


def _handshake(server: ssl.SSLContext, cafile: Path) -> bool:
    """Whether a client that trusts only CAFILE completes a TLS handshake with SERVER."""
    client = ssl.create_default_context(cafile=str(cafile))
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname="127.0.0.1")
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(10):
        for name, side, out, peer_in in (("c", c, c_out, s_in), ("s", s, s_out, c_in)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLError:
                    return False
            peer_in.write(out.read())
        if all(done.values()):
            return True
    return False


def test_metrics_follow_the_apis_tls_unless_told(tmp_path: Path):
    cert, key = self_signed(tmp_path)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    config = _settings(*tls)
    assert metrics_tls(config)
    _, side = uvicorn_configs(object(), object(), config)
    assert (side.ssl_certfile, side.ssl_keyfile) == (str(cert), str(key))

    config = _settings(*tls, "--no-metrics-tls")
    assert not metrics_tls(config)
    api, side = uvicorn_configs(object(), object(), config)
    assert side.ssl_certfile is None and api.ssl_certfile == str(cert)

    config = _settings()
    assert not metrics_tls(config)
    assert uvicorn_configs(object(), object(), config)[1].ssl_certfile is None


def test_metrics_tls_without_a_certificate_is_refused_by_name():
    with pytest.raises(ConfigError) as info:
        _settings("--metrics-tls")
    assert "--metrics-tls" in str(info.value) and "--tls-cert" in str(info.value)


def test_the_config_file_sets_metrics_tls(tmp_path: Path):
    cert, key = self_signed(tmp_path)
    conf = tmp_path / "gateway.yml"
    conf.write_text(f"metrics_tls: false\ntls:\n  cert: {cert}\n  key: {key}\n")
    config = _settings("--config", str(conf))
    assert config.metrics_tls is False and not metrics_tls(config)
    assert _settings("--config", str(conf), "--metrics-tls").metrics_tls is True  # the flag wins
    conf.write_text("metrics_tls: sometimes\n")
    with pytest.raises(ConfigError) as info:
        _settings("--config", str(conf))
    assert "metrics_tls" in str(info.value)


def test_sighup_reloads_every_listener_and_a_bad_pair_keeps_them(tmp_path: Path):
    cert_a, key_a = self_signed(tmp_path / "a")
    cert_b, key_b = self_signed(tmp_path / "b")
    (tmp_path / "live").mkdir()
    cert, key = tmp_path / "live" / "tls.crt", tmp_path / "live" / "tls.key"
    shutil.copy(cert_a, cert)
    shutil.copy(key_a, key)
    config = _settings("--tls-cert", str(cert), "--tls-key", str(key))
    contexts = []
    for uv in uvicorn_configs(object(), object(), config):  # the API's and /metrics' contexts, as uvicorn makes them
        uv.load()
        contexts.append(uv.ssl)
    assert all(_handshake(c, cert_a) and not _handshake(c, cert_b) for c in contexts)

    shutil.copy(cert_b, cert)
    shutil.copy(key_b, key)
    assert reload_tls(contexts, config)
    assert all(_handshake(c, cert_b) and not _handshake(c, cert_a) for c in contexts)

    shutil.copy(key_a, key)  # B's certificate with A's key: not a pair
    assert not reload_tls(contexts, config)
    assert all(_handshake(c, cert_b) for c in contexts)
