"""The CA the play makes for Triton's gRPC between hosts (llmhost_grpc_tls_ca), run as
the roles run it against scratch directories on this machine (as root): the triton
role's key and certificate, the gateway role's CA file, the controller's CA. openssl
checks what they made."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ._helpers import REPO, PlaybookRun, ansible_playbook

VENV = Path(sys.executable).parent.parent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the key is root's: needs root")


def _include(role: str, tasks_from: str) -> dict[str, Any]:
    return {"name": f"Include {role} {tasks_from}", "ansible.builtin.include_role":
            {"name": role, "tasks_from": tasks_from, "public": True}}


def _import(role: str, tasks_from: str, when: str) -> dict[str, Any]:
    """The role's tasks file under the condition its role includes it with."""
    return {"name": f"Import {role} {tasks_from}", "ansible.builtin.import_role":
            {"name": role, "tasks_from": tasks_from}, "when": when}


def pki_book(tmp_path: Path, variables: dict[str, Any]) -> Path:
    """A play of the roles' own tasks as they run with llmhost_grpc_tls_ca: the triton role's key and
    certificate, the gateway role's CA file, in scratch folders under TMP_PATH (etc/ and gw/ must exist)."""
    tasks = [
        _import("triton", "grpc_tls.yml", "_llmhost_grpc_tls_made | bool"),
        _import("gateway", "grpc_ca.yml", "_gateway_make_ca | bool"),
        {"name": "Write what the roles point at", "ansible.builtin.copy": {"dest": str(tmp_path / "pointed.yml"),
         "mode": "0644", "content": "{{ {'cert': triton_grpc_tls_cert_file, 'key': triton_grpc_tls_key_file, "
                                    "'ca': gateway_upstream_ca_file} | to_nice_yaml }}"},
         "when": "not ansible_check_mode"},
        # The roles' handlers would restart services this machine does not run.
        {"name": "Stop before handlers", "ansible.builtin.meta": "end_play"},
    ]
    play = [{"hosts": "localhost", "gather_facts": False, "connection": "local",
             "vars": {"ansible_python_interpreter": sys.executable, "llmhost_profile": "cpu",
                      "llmhost_source_dir": str(REPO), "llmhost_venv_dir": str(VENV),
                      "llmhost_allow_public_triton": True, "llmhost_grpc_tls_ca": True,
                      "llmhost_pki_dir": str(tmp_path / "pki"), "triton_service_config_dir": str(tmp_path / "etc"),
                      "gateway_config_dir": str(tmp_path / "gw"), **variables},
             "tasks": tasks}]
    book = tmp_path / "pki.yml"
    book.write_text(yaml.safe_dump(play))
    return book


def run_book(book: Path, *args: str) -> PlaybookRun:
    run = ansible_playbook("-i", "localhost,", *args, str(book))
    assert run.rc == 0, run.output[-5000:]
    return run


def _openssl(*args: str) -> str:
    return subprocess.run(["openssl", *args], check=True, capture_output=True, text=True).stdout


def _sans(cert: Path) -> list[str]:
    text = _openssl("x509", "-in", str(cert), "-noout", "-ext", "subjectAltName")
    names = text.splitlines()[-1].strip().split(", ")
    return sorted(n.replace("IP Address:", "").replace("DNS:", "") for n in names)


def test_the_play_makes_a_ca_and_a_certificate_the_ca_verifies(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "gw").mkdir()
    variables = {"llmhost_bind_address": "10.9.8.7", "ansible_host": "192.0.2.10",
                 "llmhost_grpc_tls_names": ["triton-a.example"], "gateway_upstreams": ["10.9.8.7:8001"]}
    book = pki_book(tmp_path, variables)
    pki, cert, key = tmp_path / "pki", tmp_path / "etc" / "tritonserver-grpc-tls.crt", \
        tmp_path / "etc" / "tritonserver-grpc-tls.key"
    ca_copy = tmp_path / "gw" / "llmhost-grpc-ca.crt"

    dry = run_book(book, "--check", "--diff")
    assert dry.recap()["localhost"]["changed"] >= 1, dry.output
    assert not pki.exists() and not key.exists() and not cert.exists() and not ca_copy.exists()

    first = run_book(book)
    assert first.recap()["localhost"]["changed"] >= 4, first.output
    # The CA: its key the controller user's alone, in a directory of its own.
    assert stat.S_IMODE(pki.stat().st_mode) == 0o700
    assert stat.S_IMODE((pki / "ca.key").stat().st_mode) == 0o600
    assert ca_copy.read_text() == (pki / "ca.crt").read_text()
    # The host's key: root's alone; never on the controller.
    st = key.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, 0, 0)
    assert _openssl("pkey", "-in", str(key), "-pubout") == _openssl("x509", "-in", str(cert), "-noout", "-pubkey")
    assert "PRIVATE KEY" not in first.output + dry.output
    assert "OK" in _openssl("verify", "-CAfile", str(ca_copy), str(cert))
    assert _sans(cert) == sorted(["10.9.8.7", "192.0.2.10", "localhost", "triton-a.example"])
    assert "TLS Web Server Authentication" in _openssl("x509", "-in", str(cert), "-noout", "-ext", "extendedKeyUsage")
    pointed = yaml.safe_load((tmp_path / "pointed.yml").read_text())
    assert pointed == {"cert": str(cert), "key": str(key), "ca": str(ca_copy)}

    made = cert.read_text(), key.read_text(), (pki / "ca.key").read_text()
    steady = run_book(book)
    assert steady.recap()["localhost"]["changed"] == 0, steady.output
    check = run_book(book, "--check", "--diff")
    assert check.recap()["localhost"]["changed"] == 0, check.output
    assert (cert.read_text(), key.read_text(), (pki / "ca.key").read_text()) == made

    # Another address: a new certificate for the same key, by the same CA; dry first.
    moved = pki_book(tmp_path, {**variables, "llmhost_bind_address": "10.9.8.8"})
    dry = run_book(moved, "--check", "--diff")
    assert dry.recap()["localhost"]["changed"] >= 1 and cert.read_text() == made[0], dry.output
    remade = run_book(moved)
    assert remade.recap()["localhost"]["changed"] >= 1, remade.output
    assert cert.read_text() != made[0] and key.read_text() == made[1]
    assert _sans(cert) == sorted(["10.9.8.8", "192.0.2.10", "localhost", "triton-a.example"])
    assert "OK" in _openssl("verify", "-CAfile", str(ca_copy), str(cert))
    assert run_book(moved).recap()["localhost"]["changed"] == 0


def test_a_certificate_near_its_end_is_made_anew(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "gw").mkdir()
    variables = {"llmhost_bind_address": "10.9.8.7", "gateway_upstreams": ["10.9.8.7:8001"]}
    run_book(pki_book(tmp_path, variables))
    cert = tmp_path / "etc" / "tritonserver-grpc-tls.crt"
    first = cert.read_text()
    # Valid 365 days: renewing 400 days before the end makes it anew on every run.
    renewing = pki_book(tmp_path, {**variables, "llmhost_grpc_tls_valid_days": 500, "llmhost_grpc_tls_renew_days": 400})
    assert run_book(renewing).recap()["localhost"]["changed"] >= 1
    assert cert.read_text() != first
    end = _openssl("x509", "-in", str(cert), "-noout", "-checkend", str(450 * 86400))
    assert "will not expire" in end


def test_gateways_on_loopback_get_no_ca_and_given_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "gw").mkdir()
    run = run_book(pki_book(tmp_path, {"llmhost_bind_address": "127.0.0.1", "gateway_upstreams": ["127.0.0.1:8001"]}))
    assert not (tmp_path / "pki").exists() and not (tmp_path / "gw" / "llmhost-grpc-ca.crt").exists(), run.output
    assert yaml.safe_load((tmp_path / "pointed.yml").read_text()) == {"cert": "", "key": "", "ca": ""}

    given = {"llmhost_bind_address": "10.9.8.7", "triton_grpc_tls_cert_file": "/etc/ssl/mine.crt",
             "triton_grpc_tls_key_file": "/etc/ssl/mine.key"}
    play = [{"hosts": "localhost", "gather_facts": False, "connection": "local",
             "vars": {"ansible_python_interpreter": sys.executable, "llmhost_profile": "cpu",
                      "llmhost_source_dir": str(REPO), "llmhost_venv_dir": str(VENV),
                      "llmhost_allow_public_triton": True, "llmhost_grpc_tls_ca": True, **given},
             "tasks": [_include("triton", "preflight.yml")]}]
    book = tmp_path / "given.yml"
    book.write_text(yaml.safe_dump(play))
    refused = ansible_playbook("-i", "localhost,", str(book))
    assert refused.rc != 0
    assert "leave triton_grpc_tls_cert_file and triton_grpc_tls_key_file unset" in refused.failure()
