"""roles/gateway's decisions without a host: the preflight refuses bad API key
entries and settings by name (never printing a key), the demo settings enable
the gateway only with a key, and the keys file and the unit render as intended.

Preflight cases run `ansible-playbook playbooks/serving.yml --tags preflight
--check` against this machine, like test_preflight.py."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.ansible._helpers import (
    REPO,
    PlaybookRun,
    ansible_playbook,
    ansible_playbook_on_hosts,
    host_name,
    load_yaml,
    shared_dir,
)
from tests.ansible.test_preflight import assert_fails_naming, preflights

KEY = "k" * 12 + "-secret-demo-key"  # 28 characters
SHORT = "short-key-123"  # 13 characters
SHA = hashlib.sha256(b"another key of 16+ chars").hexdigest()
METRICS_TOKEN = "metrics-token-of-the-site-0123"
SHA2 = hashlib.sha256(b"the operators key, 16+ chars").hexdigest()


def keys(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"gateway_api_keys": list(entries)}


def _publishing_events(name: str) -> list[dict[str, Any]]:
    """inventory/demo.yml's models, NAME's engines publishing their KV-cache events."""
    return [{**m, "settings": {**(m.get("settings") or {}), "kv_events": True}} if m["name"] == name else m
            for m in load_yaml(REPO / "inventory" / "demo.yml")["llmhost_models"]]


# Settings that pass preflight, by the test that runs them.
PASSING: dict[str, dict[str, Any]] = {
    "demo": {},
    "valid key": keys({"name": "alice", "key": KEY, "rpm": 60}, {"name": "bob", "sha256": SHA.upper()}),
    "plain HTTP asked for": {**keys({"name": "alice", "key": KEY}), "gateway_listen_address": "0.0.0.0",
                             "gateway_allow_plaintext": True},
    "metrics with a token": {**keys({"name": "a", "key": KEY}), "gateway_metrics_listen_address": "0.0.0.0",
                             "gateway_metrics_token": METRICS_TOKEN},
    "anonymous metrics": {**keys({"name": "a", "key": KEY}), "gateway_metrics_listen_address": "0.0.0.0",
                          "gateway_metrics_allow_anonymous": True},
    # The demo's models: tiny and embed.
    "routing per model": {**keys({"name": "a", "key": KEY}), "gateway_routing": "round_robin",
                          "gateway_model_routing": {"embed": "least_loaded", "tiny": "cache_aware"},
                          "gateway_routing_prefix_chars": 512, "gateway_routing_load_factor": 2,
                          "gateway_routing_session_user": True},
    "kv_events of a model that publishes them": {**keys({"name": "a", "key": KEY}),
                                                 "llmhost_models": _publishing_events("tiny"),
                                                 "gateway_model_routing": {"tiny": "kv_events"}},
}


def local_triton_over_tls(cert: Path) -> dict[str, Any]:
    """Triton on this host, on the network with gRPC over TLS (`cert` as its certificate and key)."""
    return {**keys({"name": "a", "key": KEY}), "llmhost_bind_address": "0.0.0.0", "llmhost_allow_public_triton": True,
            "triton_grpc_tls_cert_file": str(cert), "triton_grpc_tls_key_file": str(cert)}


@pytest.fixture(scope="module")
def preflight_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], PlaybookRun]:
    """Every preflight case of this module that needs no inventory of its own, in as few
    ansible-playbook runs as preflights makes: PASSING as ("passing", name), CASES as
    ("case", name), the local Triton over TLS as ("local TLS", "loopback" / "remote upstream")."""
    shared = shared_dir(tmp_path_factory)
    cert = shared / "gateway-grpc.crt"
    # Written aside and renamed: another xdist worker may read the same path in the shared folder.
    aside = cert.with_name(f"{cert.name}.{os.getpid()}")
    aside.write_text("certificate\n")
    aside.replace(cert)
    tls = local_triton_over_tls(cert)
    overrides: dict[tuple[str, str], dict[str, Any]] = {
        **{("passing", name): extra for name, extra in PASSING.items()},
        **{("case", name): extra for name, extra, _ in CASES},
        ("local TLS", "loopback"): tls,
        ("local TLS", "remote upstream"): {**tls, "gateway_upstreams": ["10.0.0.11:8001"]},
    }
    return preflights(shared, overrides)


@pytest.fixture(scope="module")
def passing_runs(preflight_runs: dict[tuple[str, str], PlaybookRun]) -> dict[str, PlaybookRun]:
    return {name: run for (kind, name), run in preflight_runs.items() if kind == "passing"}


def test_without_keys_the_gateway_is_off(passing_runs: dict[str, PlaybookRun]) -> None:
    run = passing_runs["demo"]
    assert run.rc == 0, run.output
    task = run.output.split("gateway : Assert every API key entry is valid]", 1)[1]
    assert task.split("TASK [", 1)[0].split("*\n", 1)[1].strip() == "skipping: [localhost]", run.output


def test_a_valid_key_passes_preflight(passing_runs: dict[str, PlaybookRun]) -> None:
    run = passing_runs["valid key"]
    assert run.rc == 0, run.output
    assert "Assert every API key entry is valid" in run.output
    assert KEY not in run.output


def test_plain_http_on_the_network_passes_only_when_asked_for(passing_runs: dict[str, PlaybookRun]) -> None:
    run = passing_runs["plain HTTP asked for"]
    assert run.rc == 0, run.output
    assert "serves HTTPS, or plain HTTP is asked for" in run.output


CASES: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("missing name", keys({"key": KEY}), ("gateway_api_keys[0]", "name missing or invalid")),
    ("duplicate name", keys({"name": "a", "key": KEY}, {"name": "a", "sha256": SHA}),
     ("gateway_api_keys[1] (a)", "used twice")),
    ("key and sha256", keys({"name": "a", "key": KEY, "sha256": SHA}), ("gateway_api_keys[0] (a)", "exactly one")),
    ("neither key nor sha256", keys({"name": "a"}), ("gateway_api_keys[0] (a)", "exactly one")),
    ("short key", keys({"name": "a", "key": SHORT}), ("gateway_api_keys[0] (a)", "at least 16 characters")),
    ("malformed sha256", keys({"name": "a", "sha256": "abc123"}), ("gateway_api_keys[0] (a)", "64 hex digits")),
    ("unknown field", keys({"name": "a", "key": KEY, "rps": 3}), ("gateway_api_keys[0] (a)", "rps")),
    ("bad limit", keys({"name": "a", "key": KEY, "tpm": 0}), ("gateway_api_keys[0] (a)", "tpm")),
    ("enabled without keys", {"gateway_enabled": True}, ("gateway_api_keys is empty",)),
    ("TLS cert without key", {**keys({"name": "a", "key": KEY}), "gateway_tls_cert_file": "/etc/ssl/certs/x.pem"},
     ("gateway_tls_cert_file", "gateway_tls_key_file")),
    ("TLS files missing", {**keys({"name": "a", "key": KEY}), "gateway_tls_cert_file": "/nonexistent/gw.crt",
                           "gateway_tls_key_file": "/nonexistent/gw.key"}, ("/nonexistent/gw.crt", "not a file")),
    ("upstream CA missing", {**keys({"name": "a", "key": KEY}), "gateway_upstream_ca_file": "/nonexistent/ca.crt"},
     ("/nonexistent/ca.crt", "gateway_upstream_ca_file", "not a file")),
    ("upstream CA relative", {**keys({"name": "a", "key": KEY}), "gateway_upstream_ca_file": "ca.crt"},
     ("gateway_upstream_ca_file must be empty or an absolute path",)),
    ("CPU weight out of range", {**keys({"name": "a", "key": KEY}), "gateway_cpu_weight": 20000},
     ("gateway_cpu_weight", "1 to 10000")),
    ("CPU affinity not CPUs", {**keys({"name": "a", "key": KEY}), "gateway_cpu_affinity": "cores 1"},
     ("gateway_cpu_affinity", "CPU numbers or ranges")),
    ("port clash", {**keys({"name": "a", "key": KEY}), "gateway_port": 18081}, ("gateway_port",)),
    ("gRPC port clash", {**keys({"name": "a", "key": KEY}), "gateway_grpc_port": 18080}, ("gateway_grpc_port",)),
    ("plaintext gRPC on the network", {**keys({"name": "a", "key": KEY}), "gateway_grpc_port": 18082,
                                       "gateway_grpc_listen_address": "0.0.0.0"},
     ("gRPC API would take API keys and prompts in plaintext on", "0.0.0.0", "gateway_tls_cert_file")),
    ("plain HTTP on the network", {**keys({"name": "a", "key": KEY}), "gateway_listen_address": "0.0.0.0"},
     ("plain HTTP on 0.0.0.0", "gateway_tls_cert_file", "gateway_allow_plaintext: true")),
    ("plaintext not a boolean", {**keys({"name": "a", "key": KEY}), "gateway_allow_plaintext": "maybe"},
     ("gateway_allow_plaintext", "maybe")),
    ("metrics on the network without a token", {**keys({"name": "a", "key": KEY}),
                                                "gateway_metrics_listen_address": "0.0.0.0"},
     ("/metrics on 0.0.0.0", "gateway_metrics_token", "gateway_metrics_allow_anonymous: true")),
    ("short metrics token", {**keys({"name": "a", "key": KEY}), "gateway_metrics_token": SHORT},
     ("gateway_metrics_token", "at least 16 characters")),
    ("metrics over TLS without a certificate", {**keys({"name": "a", "key": KEY}), "gateway_metrics_tls": True},
     ("gateway_metrics_tls serves /metrics over HTTPS", "gateway_tls_cert_file")),
    ("models not a list", keys({"name": "a", "key": KEY, "models": "tiny"}), ("gateway_api_keys[0] (a)", "models")),
    ("admin not a boolean", keys({"name": "a", "key": KEY, "admin": "yes"}), ("gateway_api_keys[0] (a)", "admin")),
    ("unknown model", {**keys({"name": "a", "key": KEY}), "gateway_models": ["llama"]}, ("gateway_models", "llama")),
    ("bad upstream", {**keys({"name": "a", "key": KEY}), "gateway_upstreams": ["localhost"]}, ("gateway_upstreams",)),
    ("unknown routing policy", {**keys({"name": "a", "key": KEY}), "gateway_routing": "fastest"},
     ("gateway_routing", "fastest")),
    ("model routing of a model not served", {**keys({"name": "a", "key": KEY}),
                                             "gateway_model_routing": {"llama": "round_robin"}},
     ("gateway_model_routing", "llama")),
    ("unknown model routing policy", {**keys({"name": "a", "key": KEY}), "gateway_model_routing": {"tiny": "random"}},
     ("gateway_model_routing", "random")),
    ("kv_events of a model that publishes none", {**keys({"name": "a", "key": KEY}),
                                                  "gateway_model_routing": {"tiny": "kv_events"}},
     ("routes tiny by kv_events", "settings: {kv_events: true}")),
    ("kv_events for every model, one publishing", {**keys({"name": "a", "key": KEY}), "gateway_routing": "kv_events",
                                                   "llmhost_models": _publishing_events("tiny")},
     ("routes embed by kv_events", "gateway_routing: kv_events", "another policy in gateway_model_routing")),
    ("routing load factor under 1", {**keys({"name": "a", "key": KEY}), "gateway_routing_load_factor": 0.5},
     ("gateway_routing_load_factor", ">= 1")),
    ("routing prefix chars zero", {**keys({"name": "a", "key": KEY}), "gateway_routing_prefix_chars": 0},
     ("gateway_routing_prefix_chars", ">= 1")),
]


@pytest.fixture(scope="module")
def case_runs(preflight_runs: dict[tuple[str, str], PlaybookRun]) -> dict[str, PlaybookRun]:
    return {name: run for (kind, name), run in preflight_runs.items() if kind == "case"}


@pytest.mark.parametrize(("name", "needles"), [(c[0], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_preflight_names_the_bad_setting(
    case_runs: dict[str, PlaybookRun], name: str, needles: tuple[str, ...]
) -> None:
    run = case_runs[name]
    assert_fails_naming(run, *needles)
    for secret in (KEY, SHORT):
        assert secret not in run.output, "the preflight printed a key"


def test_a_local_triton_with_grpc_over_tls_is_not_reached_on_loopback(
    preflight_runs: dict[tuple[str, str], PlaybookRun],
) -> None:
    run = preflight_runs[("local TLS", "loopback")]
    assert_fails_naming(run, "serves gRPC over TLS", "127.0.0.1:8001", "gateway_upstream_ca_file")
    run = preflight_runs[("local TLS", "remote upstream")]
    assert run.rc == 0, run.output


def test_metrics_on_the_network_pass_with_a_token_or_when_allowed(passing_runs: dict[str, PlaybookRun]) -> None:
    for run in (passing_runs["metrics with a token"], passing_runs["anonymous metrics"]):
        assert run.rc == 0, run.output
        assert "asks for a token, or its absence is allowed" in run.output and METRICS_TOKEN not in run.output


ALICE = keys({"name": "alice", "key": KEY})
TINY = {**ALICE, "llmhost_models": [{"name": "tiny", "source": "tiny"}]}
TLS = {**TINY, "gateway_tls_cert_file": "/etc/ssl/gw.crt", "gateway_tls_key_file": "/etc/ssl/gw.key"}
PLAYS_CA = {**TINY, "llmhost_grpc_tls_ca": True}

# The settings the tests below render the keys file and the units with, by name.
RENDERS: dict[str, dict[str, Any]] = {
    "keys file": {**keys({"name": "alice", "key": KEY, "max_tokens": 256, "rpm": 60},
                         {"name": "bob", "sha256": SHA.upper(), "max_concurrent": 2, "models": ["tiny"]},
                         {"name": "ops", "sha256": SHA2, "admin": True}),
                  "llmhost_models": [{"name": "tiny", "source": "tiny"}]},
    "hardened": {**ALICE, "llmhost_models": [{"name": "tiny", "source": "tiny"}, {"name": "qwen", "source": "tiny"}],
                 "gateway_upstreams": ["10.0.0.1:8001", "[fd00::2]:8001"],
                 "gateway_listen_address": "::", "gateway_drain_timeout_s": 40,
                 "gateway_max_connections": 900, "gateway_header_timeout_s": 4,
                 "gateway_tls_cert_file": "/etc/ssl/gw.crt", "gateway_tls_key_file": "/etc/ssl/gw.key"},
    "plain HTTP on port 443": {**ALICE, "gateway_port": 443, "gateway_allow_plaintext": True,
                               "gateway_cpu_affinity": "6-7,14",
                               "llmhost_models": [{"name": "tiny", "source": "tiny"}]},
    "renewed certificate": {**TINY, "gateway_group": "gw",
                            "gateway_tls_cert_file": "/etc/letsencrypt/live/gw/fullchain.pem",
                            "gateway_tls_key_file": "/etc/letsencrypt/live/gw/privkey.pem"},
    "plain": TINY,
    "TLS": TLS,
    "TLS without metrics TLS": {**TLS, "gateway_metrics_tls": False},
    "upstream CA": {**TINY, "gateway_upstreams": ["10.0.0.1:8001"], "gateway_upstream_ca_file": "/etc/llmhost/ca.crt"},
    "metrics token": {**TINY, "gateway_metrics_token": METRICS_TOKEN},
    "anonymous metrics": {**TINY, "gateway_metrics_allow_anonymous": True},
    "no engine sockets": {**TINY, "gateway_engine_sockets": False},
    "remote upstream": {**TINY, "gateway_upstreams": ["10.0.0.1:8001"]},
    "play's CA, remote upstream": {**PLAYS_CA, "gateway_upstreams": ["10.0.0.1:8001"]},
    "play's CA, local upstream": {**PLAYS_CA, "gateway_upstreams": ["127.0.0.1:8001"]},
    "remote images": {**TINY, "gateway_allow_remote_images": True},
    "gRPC": {**TLS, "gateway_grpc_port": 18082, "gateway_grpc_listen_address": "::"},
    "routing per model": {**ALICE, "llmhost_models": [{"name": "tiny", "source": "tiny"},
                                                      {"name": "embed", "source": "tiny"},
                                                      {"name": "qwen", "source": "tiny"}],
                          "gateway_listen_address": "127.0.0.1", "gateway_routing": "least_loaded",
                          "gateway_model_routing": {"tiny": "cache_aware", "embed": "round_robin"},
                          "gateway_routing_prefix_chars": 2048, "gateway_routing_load_factor": 1.75,
                          "gateway_routing_session_user": True},
    "kv_events of a model that publishes them": {**keys({"name": "a", "key": KEY}),
                                                 "llmhost_models": _publishing_events("tiny"),
                                                 "gateway_model_routing": {"tiny": "kv_events"}},
}

# Renders every host's files into the folder of its host var _render_dir. The role's
# defaults and vars are the group vars of all (see render_inventory).
RENDER_PLAY = f"""---
- name: Render the gateway's files
  hosts: all
  gather_facts: false
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{REPO}/roles/gateway/templates/{{{{ item.src }}}}"
        dest: "{{{{ _render_dir }}}}/{{{{ item.dest }}}}"
        mode: "0600"
      loop:
        - {{src: keys.json.j2, dest: keys.json}}
        - {{src: llmhost-gateway.service.j2, dest: unit}}
        - {{src: llmhost-gateway-tls.path.j2, dest: llmhost-gateway-tls.path}}
        - {{src: llmhost-gateway-tls.service.j2, dest: llmhost-gateway-tls.service}}
      no_log: true
"""


def render_inventory(cases: list[tuple[Path, dict[str, Any]]]) -> dict[str, Any]:
    """One local host per (folder, settings). The role's own defaults and vars (later files
    win, as in a play's vars_files) are vars of the group all, and each case's settings are
    its host's vars, which beat them as -e did."""
    role_vars: dict[str, Any] = {}
    for path in ("roles/llmhost/defaults/main.yml", "roles/gateway/defaults/main.yml", "roles/gateway/vars/main.yml"):
        role_vars.update(load_yaml(REPO / path) or {})
    hosts = {host_name(i): {"ansible_connection": "local", "ansible_python_interpreter": "/usr/bin/python3",
                            "_render_dir": str(folder), **settings}
             for i, (folder, settings) in enumerate(cases)}
    return {"all": {"vars": role_vars, "hosts": hosts}}


@dataclass
class Rendered:
    run: PlaybookRun  # the output of this case's host alone
    folder: Path  # keys.json, unit, llmhost-gateway-tls.path and .service

    def read(self, name: str) -> str:
        return (self.folder / name).read_text()


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Rendered]:
    """Every case of RENDERS rendered with the role's own vars, all in one ansible-playbook run."""
    base = tmp_path_factory.mktemp("renders")
    folders = {name: base / f"case-{i:03d}" for i, name in enumerate(RENDERS)}
    for folder in folders.values():
        folder.mkdir()
    play = base / "render.yml"
    play.write_text(RENDER_PLAY)
    inventory = render_inventory([(folders[name], settings) for name, settings in RENDERS.items()])
    runs = ansible_playbook_on_hosts(inventory, len(RENDERS), str(play))
    return {name: Rendered(run, folders[name]) for name, run in zip(RENDERS, runs, strict=True)}


def test_keys_file_holds_hashes_and_limits_only(renders: dict[str, Rendered]) -> None:
    run = renders["keys file"].run
    assert run.rc == 0, run.output
    text = renders["keys file"].read("keys.json")
    assert KEY not in text and KEY not in run.output
    assert json.loads(text) == {"keys": [
        {"name": "alice", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), "max_tokens": 256, "rpm": 60},
        {"name": "bob", "sha256": SHA, "max_concurrent": 2, "models": ["tiny"]},
        {"name": "ops", "sha256": SHA2, "admin": True}]}


def test_unit_runs_the_gateway_hardened_with_every_upstream(renders: dict[str, Rendered]) -> None:
    run = renders["hardened"].run
    assert run.rc == 0, run.output
    unit = renders["hardened"].read("unit")
    for want in ("User=llmhost-gateway", "--listen [::]:18080", "--upstream 10.0.0.1:8001",
                 "--upstream [fd00::2]:8001", "--model tiny", "--model qwen", "--keys-file %d/keys.json",
                 "--tls-cert /etc/ssl/llmhost-gateway/tls.crt --tls-key /etc/ssl/llmhost-gateway/tls.key",
                 "\nExecReload=/bin/kill -HUP $MAINPID\n",
                 "--drain-timeout-s 40", "TimeoutStopSec=55", "--max-connections 900",
                 "--header-timeout-s 4", "--body-timeout-s 30", "--idle-timeout-s 5", "--key-max-concurrent 512",
                 "CPUWeight=1000",
                 "KillSignal=SIGTERM", "Restart=on-failure",
                 "NoNewPrivileges=true", "ProtectSystem=strict", "MemoryDenyWriteExecute=true",
                 "ProcSubset=pid", "ProtectProc=invisible", "SystemCallFilter=@system-service", "UMask=0077",
                 "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", "\nCapabilityBoundingSet=\n"):
        assert want in unit, want
    assert "LoadCredential=tls" not in unit  # credentials are copied at start only: no reload
    assert "CPUAffinity" not in unit  # any CPU unless asked
    assert "--allow-plaintext" not in unit
    assert "upstream-ca" not in unit  # gRPC over TLS only with a CA
    run = renders["plain HTTP on port 443"].run
    assert run.rc == 0, run.output
    unit = renders["plain HTTP on port 443"].read("unit")
    assert "  --allow-plaintext \\\n" in unit
    assert "\nCapabilityBoundingSet=CAP_NET_BIND_SERVICE\n" in unit
    assert "\nCPUAffinity=6-7,14\n" in unit
    assert "ExecReload" not in unit and "--tls-cert" not in unit  # no TLS: nothing to reload


def test_a_renewed_certificate_reaches_the_running_gateway_by_a_reload(
    renders: dict[str, Rendered], tmp_path: Path
) -> None:
    """The .path unit watches both files of the pair; the oneshot it starts copies them into
    the folder the gateway reads (key 0640 root:<the gateway's group>) and reloads the
    gateway (SIGHUP), never restarts a stopped one; systemd-analyze verifies both units."""
    renewed = renders["renewed certificate"]
    run = renewed.run
    assert run.rc == 0, run.output
    path = renewed.read("llmhost-gateway-tls.path")
    assert "\nPathChanged=/etc/letsencrypt/live/gw/fullchain.pem\n" in path
    assert "\nPathChanged=/etc/letsencrypt/live/gw/privkey.pem\n" in path
    assert "\nUnit=llmhost-gateway-tls.service\n" in path and "\nWantedBy=paths.target\n" in path
    copy = renewed.read("llmhost-gateway-tls.service")
    execs = [line for line in copy.splitlines() if line.startswith("ExecStart=")]
    assert execs == [
        "ExecStart=/usr/bin/install -o root -g gw -m 0644 /etc/letsencrypt/live/gw/fullchain.pem "
        "/etc/ssl/llmhost-gateway/tls.crt",
        "ExecStart=/usr/bin/install -o root -g gw -m 0640 /etc/letsencrypt/live/gw/privkey.pem "
        "/etc/ssl/llmhost-gateway/tls.key",
        "ExecStart=/bin/systemctl try-reload-or-restart llmhost-gateway.service",
    ]
    for want in ("\nType=oneshot\n", "\nProtectSystem=strict\n", "\nReadWritePaths=/etc/ssl/llmhost-gateway\n",
                 "\nUMask=0077\n", "\nNoNewPrivileges=true\n"):
        assert want in copy, want
    unit = renewed.read("unit")
    assert "--tls-cert /etc/ssl/llmhost-gateway/tls.crt --tls-key /etc/ssl/llmhost-gateway/tls.key" in unit
    # The hardening stays: the folder is read under ProtectSystem=strict like the rest of /etc.
    for want in ("\nProtectSystem=strict\n", "\nProtectHome=true\n", "\nPrivateTmp=true\n",
                 "\nExecReload=/bin/kill -HUP $MAINPID\n", "\nUser=llmhost-gateway\n", "\nGroup=gw\n"):
        assert want in unit, want
    analyze = shutil.which("systemd-analyze")
    # The test machines (Debian 12 with systemd-container) have it: the check must run.
    assert analyze is not None, "systemd-analyze is needed to verify the rendered units"
    units = tmp_path / "units"
    units.mkdir()
    for name in ("llmhost-gateway-tls.path", "llmhost-gateway-tls.service"):
        (units / name).write_text(renewed.read(name))
    verify = subprocess.run([analyze, "verify", *(str(p) for p in sorted(units.iterdir()))],
                            capture_output=True, text=True, check=False, timeout=120)
    assert verify.returncode == 0 and not verify.stderr.strip(), verify.stdout + verify.stderr


def test_a_new_certificate_reloads_the_gateway_and_a_restart_wins() -> None:
    """The role's copy of the pair notifies the reload handler (SIGHUP), not the restart;
    the reload handler runs after the restart handlers and only when they did not run."""
    tasks = load_yaml(REPO / "roles" / "gateway" / "tasks" / "configure.yml")
    copy = next(t for t in tasks if t["name"] == "Copy the certificate and key where the gateway reads them")
    assert copy["notify"] == "gateway reload" and copy["ansible.builtin.copy"]["remote_src"] is True
    modes = {i["dest"]: i["mode"] for i in copy["loop"]}
    assert modes == {"{{ _gateway_tls_cert }}": "0644", "{{ _gateway_tls_key }}": "0640"}
    assert copy["ansible.builtin.copy"]["group"] == "{{ gateway_group }}" and copy["diff"] is False
    handlers = load_yaml(REPO / "roles" / "gateway" / "handlers" / "main.yml")
    listens = [h.get("listen") for h in handlers]
    reload_at = listens.index("gateway reload")
    reload = handlers[reload_at]
    assert reload["ansible.builtin.systemd_service"]["state"] == "reloaded"
    assert "not _gateway_restarted" in reload["when"]
    restarts = [i for i, h in enumerate(handlers) if h.get("listen") == "gateway restart"]
    assert restarts and max(restarts) < reload_at
    noted = [h for h in handlers if h.get("listen") == "gateway restart" and "ansible.builtin.set_fact" in h]
    assert noted and noted[0]["ansible.builtin.set_fact"] == {"_gateway_restarted": True}
    restart = next(h for h in handlers
                   if "ansible.builtin.systemd_service" in h and h.get("listen") == "gateway restart")
    assert restart["ansible.builtin.systemd_service"]["state"] == "restarted"


def test_metrics_follow_the_apis_tls_unless_told(renders: dict[str, Rendered]) -> None:
    """With a certificate the unit serves /metrics over HTTPS with it (--metrics-tls), unless
    gateway_metrics_tls is false; without one, neither flag."""
    run = renders["TLS"].run
    assert run.rc == 0, run.output
    unit = renders["TLS"].read("unit")
    assert "  --metrics-tls \\\n" in unit and "--no-metrics-tls" not in unit
    run = renders["TLS without metrics TLS"].run
    assert run.rc == 0, run.output
    unit = renders["TLS without metrics TLS"].read("unit")
    assert "  --no-metrics-tls \\\n" in unit and "  --metrics-tls" not in unit
    run = renders["plain"].run
    assert run.rc == 0, run.output
    assert "metrics-tls" not in renders["plain"].read("unit")


def test_the_grpc_api_is_served_only_when_given_a_port(renders: dict[str, Rendered]) -> None:
    unit = renders["gRPC"].read("unit")
    assert "  --grpc-listen [::]:18082 \\\n" in unit
    assert "--tls-cert /etc/ssl/llmhost-gateway/tls.crt" in unit  # the same TLS as the API
    assert "--grpc-listen" not in renders["plain"].read("unit")


def test_with_a_ca_the_unit_talks_grpc_over_tls(renders: dict[str, Rendered]) -> None:
    run = renders["upstream CA"].run
    assert run.rc == 0, run.output
    unit = renders["upstream CA"].read("unit")
    assert "\nLoadCredential=upstream-ca.crt:/etc/llmhost/ca.crt\n" in unit
    assert "  --upstream-ca %d/upstream-ca.crt \\\n" in unit


def test_the_unit_hands_metrics_only_the_tokens_hash(renders: dict[str, Rendered]) -> None:
    run = renders["metrics token"].run
    assert run.rc == 0, run.output
    unit = renders["metrics token"].read("unit")
    assert "\nLoadCredential=metrics-token:/etc/llmhost/llmhost-gateway-metrics-token.sha256\n" in unit
    assert "  --metrics-token-file %d/metrics-token \\\n" in unit and METRICS_TOKEN not in unit
    assert "--allow-anonymous-metrics" not in unit
    run = renders["anonymous metrics"].run
    assert run.rc == 0, run.output
    unit = renders["anonymous metrics"].read("unit")
    assert "  --allow-anonymous-metrics \\\n" in unit and "metrics-token" not in unit
    unit = renders["plain"].read("unit")
    assert "metrics-token" not in unit and "--allow-anonymous-metrics" not in unit


def test_on_an_inference_host_the_unit_streams_from_the_local_engine_sockets(renders: dict[str, Rendered]) -> None:
    run = renders["plain"].run
    assert run.rc == 0, run.output
    unit = renders["plain"].read("unit")
    assert "--upstream 127.0.0.1:8001" in unit
    assert "--engine-sockets 127.0.0.1:8001=/run/tritonserver/engine" in unit
    assert "\nSupplementaryGroups=llmhost\n" in unit  # tritonserver's group: its sockets are 0660
    for name in ("no engine sockets", "remote upstream"):
        run = renders[name].run
        assert run.rc == 0, run.output
        unit = renders[name].read("unit")
        assert "--engine-sockets" not in unit and "SupplementaryGroups" not in unit, RENDERS[name]


# -- a gateway on a host of its own (group gateway) --------------------------------------


def _gateway_only_inventory(gpu1: dict[str, Any], gateways: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The hosts `gateways` (this machine, with their host vars) in the group gateway alone, in
    front of two inference hosts that are only in the inventory."""
    local = {"ansible_connection": "local", "ansible_python_interpreter": "/usr/bin/python3"}
    return {"all": {"children": {
        "gateway": {"hosts": {name: {**local, **host_vars} for name, host_vars in gateways.items()}},
        "inference": {"hosts": {
            "gpu-1": {"ansible_host": "10.0.0.11", "llmhost_models": [{"name": "qwen", "source": "tiny"}], **gpu1},
            "gpu-2": {"ansible_host": "10.0.0.12", "llmhost_bind_address": "0.0.0.0",
                      "llmhost_allow_public_triton": True,
                      "llmhost_models": [{"name": "qwen", "source": "tiny"}, {"name": "tiny", "source": "tiny"},
                                         {"name": "old", "source": "tiny", "state": "absent"}]}}}}}}


def _gateway_only_extra(more: dict[str, Any] | None) -> str:
    """The -e of a gateway-only preflight. On the network without a certificate: asked for, so
    that the checks below are what is shown."""
    return json.dumps({**keys({"name": "a", "key": KEY}), "gateway_allow_plaintext": True, **(more or {})})


def _gateway_only_preflight(tmp_path: Path, gpu1: dict[str, Any], more: dict[str, Any] | None = None) -> PlaybookRun:
    """serving.yml's preflight for `gw`, a host of the group gateway alone (this machine),
    in front of two inference hosts that are only in the inventory (--limit gw)."""
    path = tmp_path / "inventory.json"
    path.write_text(json.dumps(_gateway_only_inventory(gpu1, {"gw": {}})))
    return ansible_playbook("-i", str(path), "--limit", "gw", "-e", _gateway_only_extra(more),
                            "--tags", "preflight", "--check", "playbooks/serving.yml")


def _gateway_only_preflights(gpu1: dict[str, Any], more: dict[str, Any],
                             gateways: list[dict[str, Any]]) -> list[PlaybookRun]:
    """_gateway_only_preflight(gpu1, more) for several gateway hosts in one run: the i-th with
    the host vars gateways[i]; per host what a run on it alone prints, the host shown as gw."""
    inventory = _gateway_only_inventory(gpu1, {host_name(i): host_vars for i, host_vars in enumerate(gateways)})
    return ansible_playbook_on_hosts(inventory, len(gateways), "--limit", "gateway", "-e", _gateway_only_extra(more),
                                     "--tags", "preflight", "--check", "playbooks/serving.yml", shown_as="gw")


def test_a_gateway_only_host_fronts_every_inference_host(tmp_path: Path) -> None:
    run = _gateway_only_preflight(tmp_path, {"llmhost_bind_address": "10.0.0.11", "llmhost_allow_public_triton": True,
                                             "triton_grpc_port": 9001})
    assert run.rc == 0, run.output
    assert run.recap()["gw"]["failed"] == 0, run.output
    # Upstreams from the inventory: gpu-1 at its bind address and own port, gpu-2 (0.0.0.0) at its ansible_host.
    assert "gateway: models qwen, tiny on upstreams 10.0.0.11:9001, 10.0.0.12:8001" in run.output, run.output
    # The venv: no vLLM, no Triton server; tritonclient's gRPC side and the gateway's packages.
    assert "gateway only: tritonclient[grpc]==2.73.0 starlette==" in run.output, run.output
    assert "vllm" not in run.output.split("Show the packages this host gets", 1)[1].split("TASK [", 1)[0]


def test_a_gateway_only_host_refuses_an_inference_host_with_triton_on_loopback(tmp_path: Path) -> None:
    run = _gateway_only_preflight(tmp_path, {})  # gpu-1: Triton on 127.0.0.1 (the default), another machine
    failure = run.failure()
    assert run.recap()["gw"]["failed"] == 1, run.output
    assert "cannot reach Triton on gpu-1" in failure and "loopback" in failure, failure[:3000]
    assert KEY not in run.output


def test_with_the_plays_ca_a_gateway_only_host_is_pointed_at_it_and_refuses_another(tmp_path: Path) -> None:
    public = {"llmhost_bind_address": "10.0.0.11", "llmhost_allow_public_triton": True}
    made = {"llmhost_grpc_tls_ca": True, "llmhost_pki_dir": str(tmp_path / "pki")}
    # Both gateways in one run: the play's CA alone, and beside it a CA file of the operator's.
    run, mine = _gateway_only_preflights(public, made, [{}, {"gateway_upstream_ca_file": "/etc/ssl/mine.crt"}])
    assert run.rc == 0 and run.recap()["gw"]["failed"] == 0, run.output
    # Preflight makes nothing: the CA comes with the configure phase.
    assert not (tmp_path / "pki").exists()
    run = mine
    failure = run.failure()
    assert "llmhost_grpc_tls_ca is true" in failure, failure[:3000]
    assert "leave gateway_upstream_ca_file unset" in failure, failure[:3000]


def test_with_the_plays_ca_the_unit_verifies_remote_upstreams_with_it(renders: dict[str, Rendered]) -> None:
    remote, local = renders["play's CA, remote upstream"], renders["play's CA, local upstream"]
    assert remote.run.rc == 0, remote.run.output
    assert "\nLoadCredential=upstream-ca.crt:/etc/llmhost/llmhost-grpc-ca.crt\n" in remote.read("unit")
    assert local.run.rc == 0, local.run.output
    assert "upstream-ca" not in local.read("unit")


def test_remote_image_urls_are_fetched_only_when_allowed(renders: dict[str, Rendered]) -> None:
    run = renders["plain"].run
    assert run.rc == 0, run.output
    assert "--allow-remote-images" not in renders["plain"].read("unit")
    run = renders["remote images"].run
    assert run.rc == 0, run.output
    assert "  --allow-remote-images \\\n" in renders["remote images"].read("unit")


def _exec_start(unit: str) -> list[str]:
    """ExecStart= of a unit file as systemd splits it (continuation lines joined)."""
    lines = [ln for ln in unit.replace("\\\n", " ").splitlines() if ln.startswith("ExecStart=")]
    assert len(lines) == 1, unit
    return shlex.split(lines[0].removeprefix("ExecStart="))


def test_preflight_passes_routing_settings_of_served_models(passing_runs: dict[str, PlaybookRun]) -> None:
    run = passing_runs["routing per model"]
    assert run.rc == 0, run.output
    assert "Assert gateway_model_routing gives served models a routing policy" in run.output
    # kv_events where the model's engines publish their events.
    run = passing_runs["kv_events of a model that publishes them"]
    assert run.rc == 0, run.output
    assert "Assert the models routed by kv_events publish their KV-cache events" in run.output


def test_the_unit_routes_cache_aware_by_default(renders: dict[str, Rendered]) -> None:
    run = renders["plain"].run
    assert run.rc == 0, run.output
    unit = renders["plain"].read("unit")
    for want in ("  --routing cache_aware \\\n", "  --routing-prefix-chars 1024 \\\n",
                 "  --routing-load-factor 1.5 \\\n"):
        assert want in unit, want
    assert "--model-routing" not in unit and "--routing-session-user" not in unit


def test_kv_events_lets_libzmq_set_its_threads_scheduling(renders: dict[str, Rendered]) -> None:
    """A model routed by kv_events: the gateway reads the engines' events with libzmq, whose
    I/O thread sets its own scheduling (sched_setscheduler, of @resources) as it starts and
    aborts where it may not; without kv_events the unit keeps the whole filter."""
    case = renders["kv_events of a model that publishes them"]
    assert case.run.rc == 0, case.run.output
    unit = case.read("unit")
    assert "  --model-routing tiny=kv_events \\\n" in unit, unit
    assert "SystemCallFilter=~@privileged @resources\n" in unit
    assert "\nSystemCallFilter=sched_setscheduler\n" in unit.split("SystemCallFilter=~@privileged @resources", 1)[1]
    for name in ("plain", "routing per model", "hardened"):
        assert "sched_setscheduler" not in renders[name].read("unit"), name


def test_the_unit_renders_the_routing_settings(renders: dict[str, Rendered]) -> None:
    """A policy per model: one --model-routing each, sorted by name; the unit's command line is
    one `llmhost gateway` takes, with the settings the inventory gave."""
    from llmhost.gateway.cli import build_parser, settings

    case = renders["routing per model"]
    assert case.run.rc == 0, case.run.output
    unit = case.read("unit")
    assert ("  --routing least_loaded \\\n  --model-routing embed=round_robin \\\n"
            "  --model-routing tiny=cache_aware \\\n  --routing-prefix-chars 2048 \\\n"
            "  --routing-load-factor 1.75 \\\n  --routing-session-user \\\n") in unit, unit
    argv = _exec_start(unit)
    assert argv[0].endswith("/bin/llmhost") and argv[1] == "gateway", argv
    config = settings(build_parser().parse_args(argv[2:]))
    assert config.models == ["tiny", "embed", "qwen"]
    assert config.routing_policy == "least_loaded"
    assert config.model_routing == {"embed": "round_robin", "tiny": "cache_aware"}
    assert (config.routing_prefix_chars, config.routing_load_factor, config.routing_session_user) == (2048, 1.75, True)
    assert config.routing.policy_of("qwen") == "least_loaded" and config.routing.policy_of("embed") == "round_robin"


def test_role_and_gateway_agree_on_the_routing_policies() -> None:
    from llmhost.gateway.routing.policies import DEFAULT_LOAD_FACTOR, DEFAULT_POLICY, DEFAULT_PREFIX_CHARS, POLICIES

    role_vars = load_yaml(REPO / "roles" / "gateway" / "vars" / "main.yml")
    assert role_vars["_gateway_routing_policies"] == list(POLICIES)
    options = load_yaml(REPO / "roles" / "gateway" / "meta" / "argument_specs.yml")["argument_specs"]["main"]["options"]
    assert options["gateway_routing"]["choices"] == list(POLICIES)
    defaults = load_yaml(REPO / "roles" / "gateway" / "defaults" / "main.yml")
    assert (defaults["gateway_routing"], defaults["gateway_routing_prefix_chars"],
            defaults["gateway_routing_load_factor"]) == (DEFAULT_POLICY, DEFAULT_PREFIX_CHARS, DEFAULT_LOAD_FACTOR)
