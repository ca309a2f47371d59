"""The gateway's settings: the YAML config file (unknown keys and bad values named),
flags over the file, TLS files checked (exit 2 naming the file), uvicorn's drain
timeout and TLS, and bad flags refused by name."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from llmhost.gateway import config as config_module
from llmhost.gateway.cli import build_parser, check_loop, check_tls, run, settings, uvicorn_configs
from llmhost.gateway.config import ConfigError, GatewayConfig, parse_config
from tests.harness.certs import self_signed
from tests.unit._gateway_fakes import KEY


def _docstring_example() -> str:
    doc = config_module.__doc__ or ""
    block = doc.split("::\n", 1)[1].split("\n\n", 1)[0]
    return "\n".join(line[4:] for line in block.splitlines())


def test_the_documented_example_is_a_valid_config():
    got = parse_config(_docstring_example(), base=Path("/etc/llmhost"))
    assert got["upstreams"] == ["127.0.0.1:8001", "10.0.0.6:8001"] and got["models"] == ["tiny"]
    assert got["engine_sockets"] == {"127.0.0.1:8001": Path("/run/tritonserver/engine")}
    assert got["listen"] == ("0.0.0.0", 18080) and got["metrics_listen"] == ("127.0.0.1", 18081)
    assert got["keys_file"] == Path("/etc/llmhost/keys.json")
    assert (got["max_concurrent_upstream"], got["max_queue"], got["queue_timeout_s"]) == (1024, 512, 30.0)
    assert got["health_unhealthy_threshold"] == 3
    assert (got["health_interval_s"], got["health_timeout_s"], got["drain_timeout_s"]) == (2.0, 2.0, 30.0)
    assert got["tls_cert"] == Path("/etc/llmhost/gateway.crt") and got["tls_key"] == Path("/etc/llmhost/gateway.key")
    assert got["event_loop"] == "asyncio"
    assert (got["max_connections"], got["header_timeout_s"], got["body_timeout_s"], got["idle_timeout_s"]) == (
        4096, 10.0, 30.0, 5.0)
    GatewayConfig(**got)


def test_relative_paths_are_relative_to_the_config_file(tmp_path):
    path = tmp_path / "gateway.yml"
    path.write_text("keys_file: keys.json\n")
    assert config_module.load_config(path) == {"keys_file": tmp_path / "keys.json"}


@pytest.mark.parametrize(("text", "names"), [
    ("bogus: 1\n", "unknown key 'bogus'"),
    ("limits: {max_queue: 1, bogus: 2}\n", "unknown key 'limits.bogus'"),
    ("tls: {cert: a, certificate: b}\n", "unknown key 'tls.certificate'"),
    ("limits: {max_queue: -1}\n", "limits.max_queue must be an integer >= 0"),
    ("limits: {max_concurrent_upstream: 0}\n", "limits.max_concurrent_upstream must be a positive integer"),
    ("limits: {queue_timeout_s: 0}\n", "limits.queue_timeout_s must be a positive number"),
    ("health: {interval_s: fast}\n", "health.interval_s must be a positive number"),
    ("health: 2\n", "health must be a mapping"),
    ("connections: {max: 0}\n", "connections.max must be a positive integer"),
    ("connections: {header_timeout_s: -1}\n", "connections.header_timeout_s must be a positive number"),
    ("connections: {idle: 3}\n", "unknown key 'connections.idle'"),
    ("upstreams: [\"10.0.0.5:8001\", nohost]\n", "upstreams[1] must be HOST:PORT"),
    ("upstreams: []\n", "upstreams must be a non-empty list"),
    ("models: tiny\n", "models must be a non-empty list"),
    ("listen: 18080\n", "listen must be HOST:PORT"),
    ("max_body_bytes: true\n", "max_body_bytes must be a positive integer"),
    ("log_level: loud\n", "log_level must be one of"),
    ("event_loop: trio\n", "event_loop must be one of asyncio, uvloop"),
    ("keys_file: 3\n", "keys_file must be a path"),
    ("allow_plaintext: yes please\n", "allow_plaintext must be true or false"),
    ("allow_remote_images: 1\n", "allow_remote_images must be true or false"),
    ("- a\n", "must be a mapping"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_config_files_name_the_key(text, names):
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert names in str(info.value)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_flags_override_the_config_file(tmp_path):
    path = tmp_path / "gateway.yml"
    path.write_text("upstreams: ['a:1', 'b:2']\nmodels: [x]\nkeys_file: /k\nlimits: {max_queue: 3}\n"
                    "health: {interval_s: 7}\nlisten: '0.0.0.0:1'\nallow_plaintext: true\n")
    config = settings(_args("--config", str(path), "--max-queue", "5", "--upstream", "c:3", "--upstream", "[::1]:4"))
    assert config.upstreams == ["c:3", "[::1]:4"] and config.max_queue == 5
    assert config.models == ["x"] and config.keys_file == Path("/k") and config.health_interval_s == 7.0
    assert config.listen == ("0.0.0.0", 1) and config.metrics_listen == ("127.0.0.1", 18081)
    config = settings(_args("--config", str(path)))
    assert config.upstreams == ["a:1", "b:2"] and config.max_queue == 3


def test_defaults_without_a_config_file():
    config = settings(_args("--keys-file", "/k", "--model", "m", "--model", "m"))
    assert config.upstreams == ["127.0.0.1:8001"] and config.models == ["m"]
    assert (config.health_interval_s, config.drain_timeout_s, config.tls_cert) == (2.0, 30.0, None)


@pytest.mark.parametrize(("argv", "names"), [
    (["--model", "m"], "--keys-file"),
    (["--keys-file", "/k"], "--model"),
    (["--keys-file", "/k", "--model", "m", "--tls-cert", "/c"], "--tls-key"),
    (["--keys-file", "/k", "--model", "m", "--upstream", "a:1", "--upstream", "a:1"], "twice"),
    (["--keys-file", "/k", "--model", "m", "--upstream", "a:1", "--engine-sockets", "b:1=/run/x"],
     "b:1 is not an upstream"),
])
def test_missing_settings_are_named(argv, names):
    with pytest.raises(ConfigError, match=names):
        settings(_args(*argv))


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from llmhost.cli import main

    code = main(["gateway", *argv])
    return code, capsys.readouterr().err


def test_cli_exits_2_naming_an_unknown_config_key(tmp_path, capsys):
    path = tmp_path / "gateway.yml"
    path.write_text("models: [m]\nmax_tokens: 5\n")
    code, err = _main(["--config", str(path), "--keys-file", "/k"], capsys)
    assert code == 2 and "max_tokens" in err and "Traceback" not in err
    code, err = _main(["--config", str(tmp_path / "missing.yml")], capsys)
    assert code == 2 and "missing.yml" in err


def test_cli_exits_2_naming_a_missing_or_unreadable_tls_file(tmp_path, capsys):
    cert, key = self_signed(tmp_path)
    keys = tmp_path / "keys.yml"
    keys.write_text("keys: []\n")
    base = ["--keys-file", str(keys), "--model", "m"]
    code, err = _main([*base, "--tls-cert", str(cert), "--tls-key", str(tmp_path / "nope.key")], capsys)
    assert code == 2 and "--tls-key" in err and "nope.key" in err
    code, err = _main([*base, "--tls-cert", str(tmp_path / "nope.crt"), "--tls-key", str(key)], capsys)
    assert code == 2 and "--tls-cert" in err and "nope.crt" in err
    code, err = _main([*base, "--tls-cert", str(cert)], capsys)
    assert code == 2 and "--tls-key" in err
    (tmp_path / "other").mkdir()
    other_cert, _ = self_signed(tmp_path / "other")
    code, err = _main([*base, "--tls-cert", str(other_cert), "--tls-key", str(key)], capsys)
    assert code == 2 and "not a matching" in err and KEY not in err


def test_a_good_certificate_and_key_pass_and_reach_uvicorn(tmp_path):
    cert, key = self_signed(tmp_path)
    config = GatewayConfig(models=["m"], tls_cert=cert, tls_key=key, drain_timeout_s=12)
    check_tls(config)
    api, side = uvicorn_configs(object(), object(), config)
    assert api.ssl_certfile == str(cert) and api.ssl_keyfile == str(key)
    assert api.timeout_graceful_shutdown == 12 and (api.host, api.port) == ("127.0.0.1", 18080)
    # /metrics over HTTPS with the same pair, by default when the API has it
    assert side.ssl_certfile == str(cert) and side.ssl_keyfile == str(key)
    assert (side.host, side.port) == ("127.0.0.1", 18081)
    plain, _ = uvicorn_configs(object(), object(), GatewayConfig(models=["m"]))
    assert plain.ssl_certfile is None and plain.timeout_graceful_shutdown == 30


@pytest.mark.parametrize("bad", [["--max-queue", "-1"], ["--queue-timeout-s", "0"], ["--max-concurrent-upstream", "0"],
                                 ["--health-interval-s", "soon"], ["--health-timeout-s", "-1"],
                                 ["--drain-timeout-s", "nan"], ["--metrics-listen", "18081"],
                                 ["--event-loop", "trio"], ["--engine-sockets", "127.0.0.1:8001"],
                                 ["--engine-sockets", "nowhere=/run/x"], ["--health-unhealthy-threshold", "0"],
                                 ["--max-connections", "0"], ["--header-timeout-s", "0"], ["--body-timeout-s", "x"],
                                 ["--idle-timeout-s", "-2"]])
def test_bad_flags_are_refused_by_name(capsys, bad):
    from llmhost.cli import main

    with pytest.raises(SystemExit) as info:
        main(["gateway", "--keys-file", "/k", "--model", "m", *bad])
    assert info.value.code == 2 and bad[0] in capsys.readouterr().err


def test_engine_sockets_from_flags_and_the_file(tmp_path):
    config = settings(_args("--keys-file", "/k", "--model", "m", "--engine-sockets", "127.0.0.1:8001=/run/t/engine"))
    assert config.engine_sockets == {"127.0.0.1:8001": Path("/run/t/engine")}
    path = tmp_path / "gateway.yml"
    path.write_text("engine_sockets: {'[::1]:8001': engine}\nupstreams: ['[::1]:8001']\n")
    assert parse_config(path.read_text(), base=tmp_path)["engine_sockets"] == {"[::1]:8001": tmp_path / "engine"}
    with pytest.raises(ConfigError, match="engine_sockets"):
        parse_config("engine_sockets: [a]\n")


def test_the_event_loop_is_asyncio_unless_uvloop_is_asked_for(tmp_path):
    assert settings(_args("--keys-file", "/k", "--model", "m")).event_loop == "asyncio"
    path = tmp_path / "gateway.yml"
    path.write_text("event_loop: uvloop\n")
    assert settings(_args("--config", str(path), "--keys-file", "/k", "--model", "m")).event_loop == "uvloop"
    assert settings(_args("--config", str(path), "--keys-file", "/k", "--model", "m",
                          "--event-loop", "asyncio")).event_loop == "asyncio"
    check_loop("uvloop")  # installed in the test venv
    seen = []

    async def which() -> None:
        import asyncio

        seen.append(type(asyncio.get_running_loop()).__module__.split(".")[0])

    run(which(), "uvloop")
    run(which(), "asyncio")
    assert seen == ["uvloop", "asyncio"]


def test_uvloop_asked_for_but_not_installed_is_a_clear_error(monkeypatch, tmp_path, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    check_loop("asyncio")
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        check_loop("uvloop")
    keys = tmp_path / "keys.yml"
    keys.write_text("keys: []\n")
    code, err = _main(["--keys-file", str(keys), "--model", "m", "--event-loop", "uvloop"], capsys)
    assert code == 2 and "--event-loop uvloop" in err and "Traceback" not in err


def test_connection_bounds_reach_uvicorns_protocol():
    config = settings(_args("--keys-file", "/k", "--model", "m", "--max-connections", "7", "--header-timeout-s", "3",
                            "--idle-timeout-s", "2", "--body-timeout-s", "9"))
    api, side = uvicorn_configs(object(), object(), config)
    assert api.timeout_keep_alive == 2.0 and config.body_timeout_s == 9.0
    assert api.http.max_connections == 7 and api.http.header_timeout_s == 3.0
    assert side.http.max_connections == 7 and side.timeout_keep_alive == 2.0  # the metrics listener too


@pytest.mark.parametrize("listen", ["0.0.0.0:18080", "[::]:18080", "10.0.0.5:18080", "gateway.example:443"])
def test_plain_http_off_loopback_is_refused_unless_asked_for(listen, tmp_path):
    with pytest.raises(ConfigError) as info:
        settings(_args("--keys-file", "/k", "--model", "m", "--listen", listen))
    assert "--allow-plaintext" in str(info.value) and "--tls-cert" in str(info.value)
    assert settings(_args("--keys-file", "/k", "--model", "m", "--listen", listen, "--allow-plaintext")).allow_plaintext
    cert, key = self_signed(tmp_path)
    assert settings(_args("--keys-file", "/k", "--model", "m", "--listen", listen, "--tls-cert", str(cert),
                          "--tls-key", str(key))).tls_cert == cert
    for loopback in ("127.0.0.1:1", "[::1]:1", "localhost:1", "127.3.4.5:1"):
        assert not settings(_args("--keys-file", "/k", "--model", "m", "--listen", loopback)).allow_plaintext


def test_remote_images_are_off_unless_allowed(tmp_path):
    assert not settings(_args("--keys-file", "/k", "--model", "m")).allow_remote_images
    assert settings(_args("--keys-file", "/k", "--model", "m", "--allow-remote-images")).allow_remote_images
    path = tmp_path / "gateway.yml"
    path.write_text("models: [x]\nkeys_file: /k\nallow_remote_images: true\n")
    assert settings(_args("--config", str(path))).allow_remote_images
