"""The admin key: its file (created once, 0600, never rewritten), parsing, and the
tritonserver flags `llmhost serve` passes (the same the systemd unit renders, see
tests/ansible/test_triton.py)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from llmhost.server.admin_key import (
    ENV_NAME,
    HEADER,
    RESTRICTED_APIS,
    AdminKeyError,
    ensure_key_file,
    main,
    parse_key,
    read_key,
    restriction_args,
)
from llmhost.server.layout import TritonInstall


def test_key_file_is_created_once_private_and_kept(tmp_path: Path):
    path = tmp_path / "admin-key"
    key, created = ensure_key_file(path)
    assert created and len(key) == 64 and int(key, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert f"{ENV_NAME}={key}\n" in path.read_text()
    before = path.read_text()
    again, created = ensure_key_file(path)
    assert (again, created) == (key, False) and path.read_text() == before
    assert read_key(path) == key
    assert ensure_key_file(tmp_path / "other")[0] != key


@pytest.mark.parametrize("text,key", [
    (f"{ENV_NAME}={'a1' * 16}\n", "a1" * 16),
    (f"# comment\n\n{ENV_NAME}=\"{'B' * 40}\"\n", "B" * 40),
    (f"{'c' * 64}\n", "c" * 64),
])
def test_parse_key_accepts_env_lines_and_bare_keys(text: str, key: str):
    assert parse_key(text) == key


@pytest.mark.parametrize("text,needle", [
    ("", "one LLMHOST_TRITON_ADMIN_KEY"),
    (f"{ENV_NAME}={'a' * 40}\n{ENV_NAME}={'b' * 40}\n", "one LLMHOST_TRITON_ADMIN_KEY"),
    ("OTHER=x\n", "one LLMHOST_TRITON_ADMIN_KEY"),
    (f"{ENV_NAME}=short\n", "32 to 256 letters and digits"),
    (f"{ENV_NAME}={'a' * 40}:x=y\n", "32 to 256 letters and digits"),
])
def test_parse_key_names_what_is_wrong(text: str, needle: str):
    with pytest.raises(AdminKeyError, match=needle):
        parse_key(text)


def test_unreadable_or_bad_key_file_errors_name_the_file_not_its_path(tmp_path: Path):
    with pytest.raises(AdminKeyError) as missing:
        read_key(tmp_path / "nope")
    assert "nope" in str(missing.value) and str(tmp_path) not in str(missing.value)
    bad = tmp_path / "bad"
    bad.write_text("x=1\n")
    with pytest.raises(AdminKeyError, match="admin key file bad: expected one"):
        ensure_key_file(bad)


def test_restriction_args_cover_every_admin_api_on_both_protocols():
    key = "f" * 64
    groups = "model-repository,statistics,trace,logging,shared-memory"
    assert restriction_args(key) == [f"--http-restricted-api={groups}:{HEADER}={key}",
                                     f"--grpc-restricted-protocol={groups}:{HEADER}={key}"]
    # Reading a model's configuration stays open: the gateway reads its LoRA adapters there.
    assert not {"health", "metadata", "inference", "model-config"} & set(RESTRICTED_APIS)


def test_script_creates_the_file_and_never_prints_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "k.env"
    assert main([str(path)]) == 0
    key = read_key(path)
    assert main([str(path)]) == 0
    out = capsys.readouterr()
    assert out.out.split() == ["created", "exists"] and key not in out.out + out.err
    assert main([]) == 2
    assert main([str(tmp_path / "missing-dir" / "k")]) == 1
    assert "cannot create the admin key file k" in capsys.readouterr().err


def test_serve_restricts_admin_apis_and_binds_metrics_apart(tmp_path: Path):
    from llmhost.cli import build_parser
    from llmhost.server.serve import ServeOptions, server_command

    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--host", "0.0.0.0",
                                      "--metrics-host", "127.0.0.2", "--admin-key-file", str(tmp_path / "k")])
    assert (args.host, args.metrics_host, args.admin_key_file) == ("0.0.0.0", "127.0.0.2", tmp_path / "k")
    assert build_parser().parse_args(["serve", "--model", str(tmp_path)]).metrics_host == "127.0.0.1"
    opts = ServeOptions(model=tmp_path, host=args.host, metrics_host=args.metrics_host)
    key = "0" * 64
    cmd = server_command(TritonInstall.from_pytriton(), tmp_path, opts, "cpu", key)
    assert "--http-address=0.0.0.0" in cmd and "--grpc-address=0.0.0.0" in cmd
    assert "--metrics-address=127.0.0.2" in cmd
    assert all(a in cmd for a in restriction_args(key))
