"""Security of the converged host: `systemd-analyze security` exposure of our units
against the same units without their hardening block, where Triton listens
(inference and metrics apart), Triton's admin APIs behind the host's key (HTTP and
gRPC), and that no task can log a secret.

Env-file and model-directory permissions are in test_provision.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import yaml

from llmhost.server.admin_key import GRPC_HEADER, HEADER, parse_key
from tests.harness.booted import BootedHost
from tests.harness.paths import ROOT
from tests.system._converge import METRICS_ADDRESS, Converged

# Documented in docs/reliability.md. Measured on the booted host (profile cpu):
# tritonserver 1.5 (9.2 without its hardening block), llmhost-smoke@ 1.6 (9.6),
# llmhost-gateway 1.2 (test_gateway_on_host.py).
EXPOSURE_MAX = {"tritonserver.service": 2.0, "llmhost-smoke@tiny.service": 2.0, "llmhost-gateway.service": 1.5}
SECRETS = ("grafana_admin_password", "model_repository_hf_token", "model_repository_modelscope_token",
           "_triton_service_admin_key_slurp", "grafana_secret_key", "_grafana_secret_key_read",
           "grafana_datasource_basic_auth_password", "prometheus_scrape_basic_auth_password",
           "gateway_api_keys")
# Made from a secret but holding none: roles/gateway's list of what is wrong with
# gateway_api_keys names entries by index and name only (tests/ansible/test_gateway.py
# checks that a refused key is not printed), and gateway_enabled is its length.
NOT_SECRET = {"_gateway_key_problems", "gateway_enabled"}


def _exposure(host: BootedHost, *args: str) -> float:
    r = host.exec(["systemd-analyze", "security", "--no-pager", *args])
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr
    return float(m.group(1))


def _without_hardening(unit_text: str) -> str:
    out, skip = [], False
    for line in unit_text.splitlines():
        if line.startswith("# BEGIN hardening"):
            skip = True
        elif line.startswith("# END hardening"):
            skip = False
        elif not skip:
            out.append(line)
    assert not skip, "no '# END hardening' line"
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("unit,path", [
    ("tritonserver.service", "/etc/systemd/system/tritonserver.service"),
    ("llmhost-smoke@tiny.service", "/etc/systemd/system/llmhost-smoke@.service"),
    ("llmhost-gateway.service", "/etc/systemd/system/llmhost-gateway.service"),
])
def test_exposure_is_low_and_lower_than_without_hardening(converged: Converged, unit: str, path: str):
    host = converged.host
    text = host.exec(["cat", path], check=True).stdout
    assert "# BEGIN hardening" in text
    plain = _without_hardening(text)
    assert plain.count("\n") < text.count("\n") - 10
    work = "/tmp/llmhost-exposure"
    name = unit.replace("@", "-at-")
    host.exec(f"rm -rf {work} && mkdir -p {work}", check=True)
    for suffix, body in (("hardened", text), ("plain", plain)):
        host.exec(["python3", "-c", "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
                   f"{work}/{suffix}-{name}", body], check=True)
    live = _exposure(host, unit)
    hardened = _exposure(host, "--offline=true", f"{work}/hardened-{name}")
    baseline = _exposure(host, "--offline=true", f"{work}/plain-{name}")
    print(f"\n{unit}: exposure {live} (offline: {hardened} hardened, {baseline} without the hardening block)")
    assert hardened < baseline - 3, (hardened, baseline)
    assert live < baseline and live <= EXPOSURE_MAX[unit], (live, baseline)


def test_triton_binds_loopback_by_default(converged: Converged):
    """Inference (HTTP, gRPC) on the default 127.0.0.1; metrics on the converge's
    llmhost_metrics_bind_address, METRICS_ADDRESS, and only there."""
    defaults = yaml.safe_load((ROOT / "roles" / "llmhost" / "defaults" / "main.yml").read_text())
    assert defaults["llmhost_bind_address"] == "127.0.0.1"
    assert defaults["llmhost_metrics_bind_address"] == "127.0.0.1"
    demo = yaml.safe_load((ROOT / "inventory" / "demo.yml").read_text())
    assert "llmhost_bind_address" not in demo and "llmhost_bind_address" not in converged.extra_vars.read_text()
    r = converged.host.exec(["ss", "-Hltnp"], check=True)
    triton = [line.split()[3] for line in r.stdout.splitlines() if '"tritonserver"' in line]
    listening = {a.rsplit(":", 1)[1]: a.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")  # gRPC: IPv4-mapped
                 for a in triton}
    p = converged.ports
    assert listening == {str(p["http"]): "127.0.0.1", str(p["grpc"]): "127.0.0.1",
                         str(p["metrics"]): METRICS_ADDRESS}, r.stdout


def _triton_answers(url: str, marker: str = "") -> bool:
    """Whether Triton answers URL. The hosts share this machine's network with other
    tests' servers: one of them may hold that port on that address, and answer
    otherwise or not at all; what matters is that it is not Triton."""
    try:
        r = requests.get(url, timeout=5)
    except requests.RequestException:
        return False
    return r.status_code == 200 and marker in r.text


def _grpc_live(target: str) -> bool:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        return bool(grpcclient.InferenceServerClient(target).is_server_live(client_timeout=5))
    except InferenceServerException:
        return False


def test_metrics_answer_on_their_own_address_and_inference_does_not(converged: Converged):
    p = converged.ports
    r = requests.get(f"{converged.triton_metrics}/metrics", timeout=10)
    assert r.status_code == 200 and 'nv_inference_request_success{model="tiny"' in r.text, r.text[:500]
    assert _triton_answers(f"http://127.0.0.1:{p['http']}/v2/health/live")
    assert _grpc_live(f"127.0.0.1:{p['grpc']}")
    # Nothing else answers on the metrics address, and metrics nowhere else.
    assert not _triton_answers(f"http://{METRICS_ADDRESS}:{p['http']}/v2/health/live")
    assert not _triton_answers(f"http://127.0.0.1:{p['metrics']}/metrics", "nv_inference_request_success")
    assert not _grpc_live(f"{METRICS_ADDRESS}:{p['grpc']}")


def test_smoke_timer_probe_passes_with_metrics_apart(converged: Converged):
    """The probe the smoke timer runs (from the host, as its unit says) reads metrics
    at the metrics address and needs no admin key."""
    host = converged.host
    unit = host.exec(["cat", "/etc/systemd/system/llmhost-smoke@.service"], check=True).stdout
    assert f"--metrics-url http://{METRICS_ADDRESS}:{converged.ports['metrics']}" in unit
    assert "admin-key" not in unit
    r = host.exec(["systemctl", "start", "llmhost-smoke@tiny.service"], timeout=600)
    assert r.returncode == 0, r.stderr
    prom = host.exec(["cat", "/var/lib/prometheus/node-exporter/llmhost_smoke_tiny.prom"], check=True).stdout
    journal = host.exec("journalctl -u llmhost-smoke@tiny.service -n 40 --no-pager -o cat").stdout
    assert 'llmhost_smoke_success{model="tiny"} 1.0' in prom, prom + journal
    assert 'llmhost_smoke_check_success{check="metrics",model="tiny"} 1.0' in prom, prom + journal


# -- Triton's admin APIs behind the host's key -------------------------------------------

ADMIN_KEY_FILE = "/etc/llmhost/tritonserver-admin-key.env"
# (method, path, JSON body) of admin calls that change nothing on this host.
ADMIN_CALLS = [
    ("POST", "/v2/logging", {"log_verbose_level": 0}),
    ("GET", "/v2/logging", None),
    ("GET", "/v2/trace/setting", None),
    ("POST", "/v2/trace/setting", {"trace_level": ["OFF"]}),
    ("POST", "/v2/repository/index", {}),
    ("GET", "/v2/systemsharedmemory/status", None),
    ("GET", "/v2/cudasharedmemory/status", None),
    ("GET", "/v2/models/tiny/stats", None),
]


@pytest.fixture(scope="module")
def admin_key(converged: Converged) -> str:
    return parse_key(converged.host.exec(["cat", ADMIN_KEY_FILE], check=True).stdout)


def _call(base: str, method: str, path: str, body: Any, headers: dict[str, str] | None = None) -> requests.Response:
    return requests.request(method, f"{base}{path}", json=body, headers=headers, timeout=30)


def test_admin_key_file_is_roots_alone_and_out_of_logs(converged: Converged, admin_key: str):
    host = converged.host
    assert host.exec(["stat", "-c", "%a %U %G", ADMIN_KEY_FILE]).stdout.strip() == "600 root root"
    r = host.exec(["runuser", "-u", "llmhost", "--", "cat", ADMIN_KEY_FILE])
    assert r.returncode != 0 and admin_key not in r.stdout
    unit = host.exec(["cat", "/etc/systemd/system/tritonserver.service"], check=True).stdout
    shown = host.exec(["systemctl", "show", "tritonserver", "-p", "ExecStart", "-p", "Environment"]).stdout
    env = host.exec(["cat", "/etc/llmhost/tritonserver.env"], check=True).stdout
    journal = host.exec("journalctl --no-pager -o cat", timeout=120).stdout
    for where, text in (("unit", unit), ("systemctl show", shown), ("env file", env), ("journal", journal),
                        ("converge output", converged.first_converge.stdout + converged.first_converge.stderr)):
        assert admin_key not in text, where
    assert "${LLMHOST_TRITON_ADMIN_KEY}" in unit
    # Triton takes the key only on its command line: root sees it there, no other
    # user does (/proc is mounted with hidepid=invisible, and so it stays at boot).
    pid = host.exec(["systemctl", "show", "-p", "MainPID", "--value", "tritonserver"]).stdout.strip()
    assert admin_key in host.exec(["cat", f"/proc/{pid}/cmdline"]).stdout.replace("\0", " ")
    r = host.exec(["runuser", "-u", "nobody", "--", "cat", f"/proc/{pid}/cmdline"])
    assert r.returncode != 0 and admin_key not in r.stdout.replace("\0", " "), r.stdout[-500:]
    assert "No such file" in r.stderr, r.stderr
    assert "hidepid=invisible" in host.exec(["cat", "/etc/fstab"], check=True).stdout


@pytest.mark.parametrize("method,path,body", ADMIN_CALLS, ids=[f"{m} {p}" for m, p, _ in ADMIN_CALLS])
def test_http_admin_api_needs_the_key(converged: Converged, admin_key: str, method: str, path: str, body: Any):
    base = converged.triton_http
    for headers in (None, {HEADER: "0" * 64}, {GRPC_HEADER: admin_key}):
        r = _call(base, method, path, body, headers)
        assert r.status_code == 403 and "restricted" in r.text, (headers and list(headers), r.status_code, r.text)
    r = _call(base, method, path, body, {HEADER: admin_key})
    assert r.status_code == 200, (r.status_code, r.text)


def test_http_shared_memory_register_needs_the_key(converged: Converged, admin_key: str):
    """A real region of the service user's: refused without the key, registered and
    unregistered with it."""
    host, base = converged.host, converged.triton_http
    name, size = "llmhost-security-test", 4096
    host.exec(["runuser", "-u", "llmhost", "--", "python3", "-c",
               f"import os; fd = os.open('/dev/shm/{name}', os.O_CREAT | os.O_RDWR, 0o600); "
               f"os.ftruncate(fd, {size})"], check=True)
    register = {"key": f"/{name}", "offset": 0, "byte_size": size}
    path = f"/v2/systemsharedmemory/region/{name}"
    try:
        r = _call(base, "POST", f"{path}/register", register)
        assert r.status_code == 403 and "restricted" in r.text, r.text
        r = _call(base, "GET", "/v2/systemsharedmemory/status", None, {HEADER: admin_key})
        assert name not in r.text
        r = _call(base, "POST", f"{path}/register", register, {HEADER: admin_key})
        assert r.status_code == 200, r.text
        r = _call(base, "GET", "/v2/systemsharedmemory/status", None, {HEADER: admin_key})
        assert r.status_code == 200 and name in r.text, r.text
        r = _call(base, "POST", f"{path}/unregister", None)
        assert r.status_code == 403, r.text
        r = _call(base, "POST", f"{path}/unregister", None, {HEADER: admin_key})
        assert r.status_code == 200, r.text
    finally:
        host.exec(["rm", "-f", f"/dev/shm/{name}"])


def test_grpc_admin_protocols_need_the_key(converged: Converged, admin_key: str):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{converged.ports['grpc']}")
    calls = {
        "logging": lambda h: client.get_log_settings(headers=h),
        "trace": lambda h: client.get_trace_settings(headers=h),
        "model-repository": lambda h: client.get_model_repository_index(headers=h),
        "shared-memory": lambda h: client.get_system_shared_memory_status(headers=h),
        "statistics": lambda h: client.get_inference_statistics("tiny", headers=h),
    }
    try:
        for name, call in calls.items():
            for headers in (None, {GRPC_HEADER: "0" * 64}, {HEADER: admin_key}):
                with pytest.raises(InferenceServerException, match="restricted"):
                    call(headers)
            assert call({GRPC_HEADER: admin_key}) is not None, name
        # Health, metadata and inference need no key.
        assert client.is_server_ready() and client.is_model_ready("tiny")
        assert client.get_server_metadata().version and client.get_model_metadata("tiny").name == "tiny"
        # The model's configuration too: the gateway reads the LoRA adapters it publishes there.
        assert client.get_model_config("tiny").config.name == "tiny"
    finally:
        client.close()


def test_health_metadata_and_inference_stay_open(converged: Converged):
    base = converged.triton_http
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/tiny/ready", "/v2", "/v2/models/tiny",
                 "/v2/models/tiny/config"):
        r = requests.get(f"{base}{path}", timeout=10)
        assert r.status_code == 200, (path, r.status_code, r.text)
    r = requests.post(f"{base}/v2/models/tiny/generate", json={"text_input": "def f():", "max_tokens": 4},
                      timeout=120)
    assert r.status_code == 200 and "text_output" in r.json(), r.text


# -- no secret in the logs ---------------------------------------------------------------


def _tasks(node: Any) -> Iterator[dict[str, Any]]:
    """Every task of a task file, blocks opened (a block's own keys count for its tasks)."""
    for task in node or []:
        if not isinstance(task, dict):
            continue
        parts = [task.get(k) for k in ("block", "rescue", "always") if k in task]
        if parts:
            for part in parts:
                for sub in _tasks(part):
                    yield {**{k: v for k, v in task.items() if k not in ("block", "rescue", "always")}, **sub}
        else:
            yield task


def _derived(names: set[str], safe: frozenset[str] = frozenset()) -> set[str]:
    """NAMES plus every role variable whose value mentions one of them (to a fixed point),
    except the SAFE ones."""
    defs: dict[str, str] = {}
    for f in [*ROOT.glob("roles/*/vars/main.yml"), *ROOT.glob("roles/*/defaults/main.yml")]:
        for k, v in (yaml.safe_load(f.read_text()) or {}).items():
            defs[k] = yaml.safe_dump(v)
    out = set(names)
    while True:
        more = {k for k, v in defs.items()
                if k not in out and k not in safe and any(re.search(rf"\b{n}\b", v) for n in out)}
        if not more:
            return out
        out |= more


def test_no_task_can_log_a_secret():
    """A task that passes a secret (or a variable made from one) to a module has
    no_log; only conditions (`when`, an assert's `that`) may read a secret bare."""
    secrets = _derived(set(SECRETS), frozenset(NOT_SECRET))
    assert "_gateway_keys_file_entries" in secrets  # the hashes reach the keys file this way
    assert "_model_repository_tokens" in secrets  # the hub tokens reach their token files this way
    assert "_triton_service_admin_key" in secrets  # Triton's admin key reaches the readiness wait this way
    assert "_model_repository_hub_env" not in secrets  # the downloads' environment holds no token
    offenders, seen = [], 0
    for f in sorted(ROOT.glob("roles/*/tasks/*.yml")) + sorted(ROOT.glob("roles/*/handlers/*.yml")):
        for task in _tasks(yaml.safe_load(f.read_text())):
            exposed = {k: v for k, v in task.items() if k not in ("when", "no_log", "name", "that")}
            if "ansible.builtin.assert" in task:
                exposed["ansible.builtin.assert"] = {k: v for k, v in task["ansible.builtin.assert"].items()
                                                     if k != "that"}
            # Only Jinja expressions can put a value in the output; a message naming the variable cannot.
            text = " ".join(re.findall(r"{{.*?}}|{%.*?%}", yaml.safe_dump(exposed, width=10**6), re.S))
            used = sorted(n for n in secrets if re.search(rf"\b{n}\b", text))
            if used:
                seen += 1
                if not task.get("no_log"):
                    offenders.append(f"{f.relative_to(ROOT)}: {task.get('name')} ({', '.join(used)})")
    assert seen > 0
    assert not offenders, "tasks that can log a secret:\n" + "\n".join(offenders)


def test_secrets_have_no_default_and_are_marked_no_log():
    for role, name in (("grafana", "grafana_admin_password"), ("model_repository", "model_repository_hf_token"),
                       ("model_repository", "model_repository_modelscope_token"), ("grafana", "grafana_secret_key"),
                       ("grafana", "grafana_datasource_basic_auth_password"),
                       ("prometheus", "prometheus_scrape_basic_auth_password"), ("gateway", "gateway_api_keys")):
        spec = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
        option = spec["argument_specs"]["main"]["options"][name]
        assert option.get("no_log") is True, (role, name)
        defaults = yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text()) or {}
        assert not defaults.get(name), f"{name} has a default value"
