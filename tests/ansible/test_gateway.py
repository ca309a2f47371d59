"""roles/gateway's decisions without a host: the preflight refuses bad API key
entries and settings by name (never printing a key), the demo settings enable
the gateway only with a key, and the keys file and the unit render as intended.

Preflight cases run `ansible-playbook playbooks/serving.yml --tags preflight
--check` against this machine, like test_preflight.py."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.ansible._helpers import REPO, PlaybookRun, ansible_playbook, load_yaml, shared_dir
from tests.ansible.test_preflight import assert_fails_naming, preflight, preflights

KEY = "k" * 12 + "-secret-demo-key"  # 28 characters
SHORT = "short-key-123"  # 13 characters
SHA = hashlib.sha256(b"another key of 16+ chars").hexdigest()
METRICS_TOKEN = "metrics-token-of-the-site-0123"
SHA2 = hashlib.sha256(b"the operators key, 16+ chars").hexdigest()


def keys(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"gateway_api_keys": list(entries)}


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
}


@pytest.fixture(scope="module")
def passing_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PlaybookRun]:
    return preflights(shared_dir(tmp_path_factory), PASSING)


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
]


@pytest.fixture(scope="module")
def case_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PlaybookRun]:
    return preflights(shared_dir(tmp_path_factory), {name: extra for name, extra, _ in CASES})


@pytest.mark.parametrize(("name", "needles"), [(c[0], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_preflight_names_the_bad_setting(
    case_runs: dict[str, PlaybookRun], name: str, needles: tuple[str, ...]
) -> None:
    run = case_runs[name]
    assert_fails_naming(run, *needles)
    for secret in (KEY, SHORT):
        assert secret not in run.output, "the preflight printed a key"


def test_a_local_triton_with_grpc_over_tls_is_not_reached_on_loopback(tmp_path: Path) -> None:
    cert = tmp_path / "grpc.crt"
    cert.write_text("certificate\n")
    tls = {"llmhost_bind_address": "0.0.0.0", "llmhost_allow_public_triton": True,
           "triton_grpc_tls_cert_file": str(cert), "triton_grpc_tls_key_file": str(cert)}
    run = preflight({**keys({"name": "a", "key": KEY}), **tls})
    assert_fails_naming(run, "serves gRPC over TLS", "127.0.0.1:8001", "gateway_upstream_ca_file")
    run = preflight({**keys({"name": "a", "key": KEY}), **tls, "gateway_upstreams": ["10.0.0.11:8001"]})
    assert run.rc == 0, run.output


def test_metrics_on_the_network_pass_with_a_token_or_when_allowed(passing_runs: dict[str, PlaybookRun]) -> None:
    for run in (passing_runs["metrics with a token"], passing_runs["anonymous metrics"]):
        assert run.rc == 0, run.output
        assert "asks for a token, or its absence is allowed" in run.output and METRICS_TOKEN not in run.output


def _render(tmp_path: Path, extra: dict[str, Any]) -> PlaybookRun:
    """Render the keys file and the unit with the role's own vars into tmp_path."""
    play = tmp_path / "render.yml"
    play.write_text(f"""---
- name: Render the gateway's files
  hosts: localhost
  gather_facts: false
  vars_files:
    - {REPO}/roles/llmhost/defaults/main.yml
    - {REPO}/roles/gateway/defaults/main.yml
    - {REPO}/roles/gateway/vars/main.yml
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{REPO}/roles/gateway/templates/{{{{ item.src }}}}"
        dest: "{tmp_path}/{{{{ item.dest }}}}"
        mode: "0600"
      loop:
        - {{src: keys.json.j2, dest: keys.json}}
        - {{src: llmhost-gateway.service.j2, dest: unit}}
        - {{src: llmhost-gateway-tls.path.j2, dest: llmhost-gateway-tls.path}}
        - {{src: llmhost-gateway-tls.service.j2, dest: llmhost-gateway-tls.service}}
      no_log: true
""")
    extra = {"ansible_python_interpreter": "/usr/bin/python3", **extra}
    return ansible_playbook("-i", "localhost,", "-c", "local", "-e", json.dumps(extra), str(play))


def test_keys_file_holds_hashes_and_limits_only(tmp_path: Path) -> None:
    run = _render(tmp_path, {**keys({"name": "alice", "key": KEY, "max_tokens": 256, "rpm": 60},
                                    {"name": "bob", "sha256": SHA.upper(), "max_concurrent": 2, "models": ["tiny"]},
                                    {"name": "ops", "sha256": SHA2, "admin": True}),
                             "llmhost_models": [{"name": "tiny", "source": "tiny"}]})
    assert run.rc == 0, run.output
    text = (tmp_path / "keys.json").read_text()
    assert KEY not in text and KEY not in run.output
    assert json.loads(text) == {"keys": [
        {"name": "alice", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), "max_tokens": 256, "rpm": 60},
        {"name": "bob", "sha256": SHA, "max_concurrent": 2, "models": ["tiny"]},
        {"name": "ops", "sha256": SHA2, "admin": True}]}


def test_unit_runs_the_gateway_hardened_with_every_upstream(tmp_path: Path) -> None:
    run = _render(tmp_path, {**keys({"name": "alice", "key": KEY}),
                             "llmhost_models": [{"name": "tiny", "source": "tiny"}, {"name": "qwen", "source": "tiny"}],
                             "gateway_upstreams": ["10.0.0.1:8001", "[fd00::2]:8001"],
                             "gateway_listen_address": "::", "gateway_drain_timeout_s": 40,
                             "gateway_max_connections": 900, "gateway_header_timeout_s": 4,
                             "gateway_tls_cert_file": "/etc/ssl/gw.crt", "gateway_tls_key_file": "/etc/ssl/gw.key"})
    assert run.rc == 0, run.output
    unit = (tmp_path / "unit").read_text()
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
    run = _render(tmp_path, {**keys({"name": "alice", "key": KEY}), "gateway_port": 443,
                             "gateway_allow_plaintext": True,
                             "gateway_cpu_affinity": "6-7,14", "llmhost_models": [{"name": "tiny", "source": "tiny"}]})
    assert run.rc == 0, run.output
    unit = (tmp_path / "unit").read_text()
    assert "  --allow-plaintext \\\n" in unit
    assert "\nCapabilityBoundingSet=CAP_NET_BIND_SERVICE\n" in unit
    assert "\nCPUAffinity=6-7,14\n" in unit
    assert "ExecReload" not in unit and "--tls-cert" not in unit  # no TLS: nothing to reload


def test_a_renewed_certificate_reaches_the_running_gateway_by_a_reload(tmp_path: Path) -> None:
    """The .path unit watches both files of the pair; the oneshot it starts copies them into
    the folder the gateway reads (key 0640 root:<the gateway's group>) and reloads the
    gateway (SIGHUP), never restarts a stopped one; systemd-analyze verifies both units."""
    run = _render(tmp_path, {**keys({"name": "alice", "key": KEY}), "gateway_group": "gw",
                             "llmhost_models": [{"name": "tiny", "source": "tiny"}],
                             "gateway_tls_cert_file": "/etc/letsencrypt/live/gw/fullchain.pem",
                             "gateway_tls_key_file": "/etc/letsencrypt/live/gw/privkey.pem"})
    assert run.rc == 0, run.output
    path = (tmp_path / "llmhost-gateway-tls.path").read_text()
    assert "\nPathChanged=/etc/letsencrypt/live/gw/fullchain.pem\n" in path
    assert "\nPathChanged=/etc/letsencrypt/live/gw/privkey.pem\n" in path
    assert "\nUnit=llmhost-gateway-tls.service\n" in path and "\nWantedBy=paths.target\n" in path
    copy = (tmp_path / "llmhost-gateway-tls.service").read_text()
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
    unit = (tmp_path / "unit").read_text()
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
        (units / name).write_text((tmp_path / name).read_text())
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


def test_metrics_follow_the_apis_tls_unless_told(tmp_path: Path) -> None:
    """With a certificate the unit serves /metrics over HTTPS with it (--metrics-tls), unless
    gateway_metrics_tls is false; without one, neither flag."""
    base = {**keys({"name": "alice", "key": KEY}), "llmhost_models": [{"name": "tiny", "source": "tiny"}],
            "gateway_tls_cert_file": "/etc/ssl/gw.crt", "gateway_tls_key_file": "/etc/ssl/gw.key"}
    run = _render(tmp_path, base)
    assert run.rc == 0, run.output
    unit = (tmp_path / "unit").read_text()
    assert "  --metrics-tls \\\n" in unit and "--no-metrics-tls" not in unit
    run = _render(tmp_path, {**base, "gateway_metrics_tls": False})
    assert run.rc == 0, run.output
    unit = (tmp_path / "unit").read_text()
    assert "  --no-metrics-tls \\\n" in unit and "  --metrics-tls" not in unit
    run = _render(tmp_path, {**keys({"name": "alice", "key": KEY}),
                             "llmhost_models": [{"name": "tiny", "source": "tiny"}]})
    assert run.rc == 0, run.output
    assert "metrics-tls" not in (tmp_path / "unit").read_text()


def test_with_a_ca_the_unit_talks_grpc_over_tls(tmp_path: Path) -> None:
    run = _render(tmp_path, {**keys({"name": "alice", "key": KEY}),
                             "llmhost_models": [{"name": "tiny", "source": "tiny"}],
                             "gateway_upstreams": ["10.0.0.1:8001"], "gateway_upstream_ca_file": "/etc/llmhost/ca.crt"})
    assert run.rc == 0, run.output
    unit = (tmp_path / "unit").read_text()
    assert "\nLoadCredential=upstream-ca.crt:/etc/llmhost/ca.crt\n" in unit
    assert "  --upstream-ca %d/upstream-ca.crt \\\n" in unit


def test_the_unit_hands_metrics_only_the_tokens_hash(tmp_path: Path) -> None:
    base = {**keys({"name": "alice", "key": KEY}), "llmhost_models": [{"name": "tiny", "source": "tiny"}]}
    run = _render(tmp_path, {**base, "gateway_metrics_token": METRICS_TOKEN})
    assert run.rc == 0, run.output
    unit = (tmp_path / "unit").read_text()
    assert "\nLoadCredential=metrics-token:/etc/llmhost/llmhost-gateway-metrics-token.sha256\n" in unit
    assert "  --metrics-token-file %d/metrics-token \\\n" in unit and METRICS_TOKEN not in unit
    assert "--allow-anonymous-metrics" not in unit
    run = _render(tmp_path, {**base, "gateway_metrics_allow_anonymous": True})
    assert run.rc == 0, run.output
    unit = (tmp_path / "unit").read_text()
    assert "  --allow-anonymous-metrics \\\n" in unit and "metrics-token" not in unit
    run = _render(tmp_path, base)
    unit = (tmp_path / "unit").read_text()
    assert "metrics-token" not in unit and "--allow-anonymous-metrics" not in unit


def test_on_an_inference_host_the_unit_streams_from_the_local_engine_sockets(tmp_path: Path) -> None:
    base = {**keys({"name": "alice", "key": KEY}), "llmhost_models": [{"name": "tiny", "source": "tiny"}]}
    run = _render(tmp_path, base)
    assert run.rc == 0, run.output
    unit = (tmp_path / "unit").read_text()
    assert "--upstream 127.0.0.1:8001" in unit
    assert "--engine-sockets 127.0.0.1:8001=/run/tritonserver/engine" in unit
    assert "\nSupplementaryGroups=llmhost\n" in unit  # tritonserver's group: its sockets are 0660
    for extra in ({"gateway_engine_sockets": False}, {"gateway_upstreams": ["10.0.0.1:8001"]}):
        run = _render(tmp_path, {**base, **extra})
        assert run.rc == 0, run.output
        unit = (tmp_path / "unit").read_text()
        assert "--engine-sockets" not in unit and "SupplementaryGroups" not in unit, extra


# -- a gateway on a host of its own (group gateway) --------------------------------------


def _gateway_only_preflight(tmp_path: Path, gpu1: dict[str, Any], more: dict[str, Any] | None = None) -> PlaybookRun:
    """serving.yml's preflight for `gw`, a host of the group gateway alone (this machine),
    in front of two inference hosts that are only in the inventory (--limit gw)."""
    inventory = {"all": {"children": {
        "gateway": {"hosts": {"gw": {"ansible_connection": "local",
                                     "ansible_python_interpreter": "/usr/bin/python3"}}},
        "inference": {"hosts": {
            "gpu-1": {"ansible_host": "10.0.0.11", "llmhost_models": [{"name": "qwen", "source": "tiny"}], **gpu1},
            "gpu-2": {"ansible_host": "10.0.0.12", "llmhost_bind_address": "0.0.0.0",
                      "llmhost_allow_public_triton": True,
                      "llmhost_models": [{"name": "qwen", "source": "tiny"}, {"name": "tiny", "source": "tiny"},
                                         {"name": "old", "source": "tiny", "state": "absent"}]}}}}}}
    path = tmp_path / "inventory.json"
    path.write_text(json.dumps(inventory))
    # On the network without a certificate: asked for, so that the checks below are what is shown.
    extra = {**keys({"name": "a", "key": KEY}), "gateway_allow_plaintext": True, **(more or {})}
    return ansible_playbook("-i", str(path), "--limit", "gw", "-e", json.dumps(extra),
                            "--tags", "preflight", "--check", "playbooks/serving.yml")


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
    run = _gateway_only_preflight(tmp_path, public, made)
    assert run.rc == 0 and run.recap()["gw"]["failed"] == 0, run.output
    # Preflight makes nothing: the CA comes with the configure phase.
    assert not (tmp_path / "pki").exists()
    run = _gateway_only_preflight(tmp_path, public, {**made, "gateway_upstream_ca_file": "/etc/ssl/mine.crt"})
    failure = run.failure()
    assert "llmhost_grpc_tls_ca is true" in failure, failure[:3000]
    assert "leave gateway_upstream_ca_file unset" in failure, failure[:3000]


def test_with_the_plays_ca_the_unit_verifies_remote_upstreams_with_it(tmp_path: Path) -> None:
    base = {**keys({"name": "alice", "key": KEY}), "llmhost_models": [{"name": "tiny", "source": "tiny"}],
            "llmhost_grpc_tls_ca": True}
    run = _render(tmp_path, {**base, "gateway_upstreams": ["10.0.0.1:8001"]})
    assert run.rc == 0, run.output
    assert "\nLoadCredential=upstream-ca.crt:/etc/llmhost/llmhost-grpc-ca.crt\n" in (tmp_path / "unit").read_text()
    run = _render(tmp_path, {**base, "gateway_upstreams": ["127.0.0.1:8001"]})
    assert run.rc == 0, run.output
    assert "upstream-ca" not in (tmp_path / "unit").read_text()


def test_remote_image_urls_are_fetched_only_when_allowed(tmp_path: Path) -> None:
    base = {**keys({"name": "alice", "key": KEY}), "llmhost_models": [{"name": "tiny", "source": "tiny"}]}
    run = _render(tmp_path, base)
    assert run.rc == 0, run.output
    assert "--allow-remote-images" not in (tmp_path / "unit").read_text()
    run = _render(tmp_path, {**base, "gateway_allow_remote_images": True})
    assert run.rc == 0, run.output
    assert "  --allow-remote-images \\\n" in (tmp_path / "unit").read_text()
