"""The exporter toolkit's web configuration (TLS, basic auth) of node_exporter and
Prometheus, and Grafana's secret key and HTTPS.

The roles' own preflight and configure tasks run for a test inventory on this
machine (render_roles.yml), every file redirected under a work directory. Then
Debian's real prometheus-node-exporter and prometheus run, as the prometheus
user, with exactly those files: an unauthenticated scrape is refused, an
authenticated one accepted, and Prometheus' rendered scrape configuration gets
its targets up. Grafana cannot run here: its rendered grafana.ini is checked
against the keys of Grafana's conf/defaults.ini.
"""

from __future__ import annotations

import base64
import configparser
import grp
import json
import os
import pwd
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ansible._helpers import parse_recap
from tests.harness.net import free_port
from tests.harness.paths import ROOT
from tests.harness.prom import promtool, tool

PLAYBOOK = Path(__file__).resolve().parent / "render_roles.yml"
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
SERVICE_USER = "prometheus"  # the user both Debian units run as
SCRAPE_USER = "scraper"
SCRAPE_PASSWORD = "scrape-secret-1"
# bcrypt (cost 10) of SCRAPE_PASSWORD, made with python3 -c "import crypt; print(crypt.crypt(
# 'scrape-secret-1', crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << 10)))".
SCRAPE_HASH = "$2b$10$Ka1mh4h3w/pKRtdfe1OqFOGPkFU1vE.08QZnDVkTU7OkW3zW.qeyS"
GRAFANA_PUBLIC_KEY = "SW2YcwTIb9zpOOhoPsMm"
# Keys of the grafana.ini sections the role writes, from Grafana's conf/defaults.ini
# (grafana/grafana, main branch): a misspelt key would be ignored by Grafana silently.
GRAFANA_KEYS = {
    "paths": {"data", "temp_data_lifetime", "logs", "plugins", "provisioning"},
    "server": {"protocol", "http_addr", "http_port", "domain", "enforce_domain", "root_url", "serve_from_sub_path",
               "router_logging", "static_root_path", "enable_gzip", "cert_file", "cert_key", "socket", "cdn_url",
               "read_timeout"},
    "security": {"disable_initial_admin_creation", "admin_user", "admin_password", "admin_email", "secret_key",
                 "encryption_provider", "available_encryption_providers", "disable_gravatar",
                 "data_source_proxy_whitelist", "disable_brute_force_login_protection", "cookie_secure",
                 "cookie_samesite", "allow_embedding", "strict_transport_security"},
    "users": {"allow_sign_up", "allow_org_create", "auto_assign_org", "auto_assign_org_role"},
    "auth.anonymous": {"enabled", "org_name", "org_role", "hide_version"},
    "analytics": {"reporting_enabled", "check_for_updates", "check_for_plugin_updates"},
}


# --- running the roles ---------------------------------------------------------------------------

@dataclass
class Rendered:
    rc: int
    output: str
    out: Path

    def ok(self) -> Rendered:
        assert self.rc == 0, self.output[-5000:]
        return self

    def failed(self, *needles: str) -> str:
        assert self.rc != 0, self.output[-3000:]
        text = " ".join(self.output.split()).replace("''", "'")
        for n in needles:
            assert n in text, f"{n!r} not in:\n{self.output[-3000:]}"
        return text

    def changed(self) -> int:
        return sum(h.get("changed", 0) for h in parse_recap(self.output).values())

    def file(self, name: str) -> Path:
        return self.out / name


def paths(out: Path) -> dict[str, Any]:
    """The roles' private path variables, redirected under OUT."""
    return {
        "_node_exporter_present": False,
        "_node_exporter_defaults_file": f"{out}/node-exporter.default",
        "_node_exporter_web_config_file": f"{out}/node-exporter-web.yml",
        "node_exporter_textfile_dir": f"{out}/textfile",
        "_prometheus_present": False,
        "_prometheus_defaults_file": f"{out}/prometheus.default",
        "_prometheus_config_file": f"{out}/prometheus.yml",
        "_prometheus_rules_dest": f"{out}/rules",
        "_prometheus_web_config_file": f"{out}/prometheus-web.yml",
        "_prometheus_scrape_password_file": f"{out}/scrape-password",
        "_prometheus_gateway_token_file": f"{out}/gateway-metrics-token",
        "prometheus_storage_dir": f"{out}/tsdb",
        "_grafana_group": "root",
        "_grafana_secret_key_file": f"{out}/grafana-secret-key",
    }


def inventory(work: Path, monitoring: dict[str, Any], others: dict[str, dict[str, Any]] | None = None) -> Path:
    """mon-01 (this machine, in groups monitoring and inference) and OTHERS (inference)."""
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **monitoring}
    inv = {"all": {"children": {
        "inference": {"hosts": dict(others or {})},
        "monitoring": {"hosts": {"mon-01": local}},
    }}}
    path = work / "inventory.yml"
    path.write_text(json.dumps(inv))
    return path


def render(work: Path, monitoring: dict[str, Any] | None = None, others: dict[str, dict[str, Any]] | None = None,
           **extra: Any) -> Rendered:
    out = work / "out"
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o755)
    inv = inventory(work, {"node_exporter_web_listen_address": "127.0.0.1:9100", **(monitoring or {})}, others)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_HOME": str(ROOT / ".cache" / "ansible")}
    variables = {"out_dir": str(out), "prometheus_node_exporter_groups": ["monitoring"], **paths(out), **extra}
    r = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inv), str(PLAYBOOK), "-e", json.dumps(variables)],
        text=True, capture_output=True, cwd=ROOT, env=env, timeout=300, check=False,
    )
    return Rendered(r.returncode, r.stdout + r.stderr, out)


def args_of(defaults_file: Path) -> list[str]:
    """ARGS of a Debian /etc/default file, split as systemd splits them."""
    for line in defaults_file.read_text().splitlines():
        if line.startswith("ARGS="):
            return shlex.split(shlex.split(line[len("ARGS="):])[0])
    raise AssertionError(f"no ARGS in {defaults_file.name}")


def owner(path: Path) -> tuple[str, str, str]:
    st = path.stat()
    return pwd.getpwuid(st.st_uid).pw_name, grp.getgrgid(st.st_gid).gr_name, oct(st.st_mode & 0o777)


@pytest.fixture
def work() -> Iterator[Path]:
    """A work directory the prometheus user can traverse (pytest's tmp_path is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="llmhost-webcfg-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def tls() -> Iterator[dict[str, Path]]:
    """A CA and a server certificate for 127.0.0.1 (openssl), key readable by the prometheus group."""
    d = Path(tempfile.mkdtemp(prefix="llmhost-tls-"))
    d.chmod(0o755)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=llmhost test CA",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-extfile", "ext.cnf", "-out", "server.crt")
    gid = pwd.getpwnam(SERVICE_USER).pw_gid
    for name in ("server.key", "server.crt", "ca.crt"):
        os.chown(d / name, 0, gid)
        (d / name).chmod(0o640)
    try:
        yield {"ca": d / "ca.crt", "cert": d / "server.crt", "key": d / "server.key"}
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --- real services -------------------------------------------------------------------------------

class Service:
    """A binary run as the prometheus user, stopped (and waited for) on exit."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        with log.open("wb") as f:
            self.proc = subprocess.Popen(["runuser", "-u", SERVICE_USER, "--", *argv], stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        # runuser and the service share a process group of their own.
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)


def get(url: str, user: str | None = None, password: str | None = None,
        ca: Path | None = None) -> tuple[int, str]:
    """(HTTP status, body); 0 and the error when no HTTP answer came."""
    req = urllib.request.Request(url)
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    ctx = ssl.create_default_context(cafile=str(ca)) if ca else None
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


def wait_for(url: str, service: Service, timeout_s: float = 60, **kw: Any) -> tuple[int, str]:
    """Poll URL until it answers over HTTP (any status); fail when the service exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise AssertionError(f"exited {service.proc.returncode}:\n{service.tail()}")
        status, body = get(url, **kw)
        if status:
            return status, body
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer in {timeout_s}s:\n{service.tail()}")


def targets_up(url: str, ca: Path, timeout_s: float = 60) -> dict[str, str]:
    """job -> health of Prometheus' active targets, once every one has been scraped (or time runs out)."""
    deadline = time.monotonic() + timeout_s
    health: dict[str, str] = {}
    while time.monotonic() < deadline:
        status, body = get(f"{url}/api/v1/targets", SCRAPE_USER, SCRAPE_PASSWORD, ca=ca)
        assert status == 200, (status, body)
        active = json.loads(body)["data"]["activeTargets"]
        health = {t["labels"]["job"]: t["health"] for t in active}
        if health and all(h == "up" for h in health.values()):
            return health
        time.sleep(0.5)
    return health


# --- with the options off ---------------------------------------------------------------------------

def test_off_by_default_nothing_changes(work: Path):
    r = render(work).ok()
    assert not r.file("node-exporter-web.yml").exists()
    assert not r.file("prometheus-web.yml").exists()
    assert not r.file("scrape-password").exists()
    assert not any(a.startswith("--web.config.file") for a in args_of(r.file("node-exporter.default")))
    assert not any(a.startswith("--web.config.file") for a in args_of(r.file("prometheus.default")))
    config = yaml.safe_load(r.file("prometheus.yml").read_text())
    for job in config["scrape_configs"]:
        assert not {"scheme", "basic_auth", "tls_config"} & set(job), job
    assert render(work).ok().changed() == 0


# --- with TLS and basic auth: the files, then the real binaries ----------------------------------------

def secured(tls: dict[str, Path], node_port: int = 9100,
            prom_port: int = 9090) -> tuple[dict[str, Any], dict[str, Any]]:
    host = {
        "node_exporter_web_listen_address": f"127.0.0.1:{node_port}",
        "node_exporter_web_tls_cert_file": str(tls["cert"]),
        "node_exporter_web_tls_key_file": str(tls["key"]),
        "node_exporter_web_basic_auth_users": {SCRAPE_USER: SCRAPE_HASH},
    }
    extra = {
        "prometheus_web_listen_address": f"127.0.0.1:{prom_port}",
        "prometheus_web_tls_cert_file": str(tls["cert"]),
        "prometheus_web_tls_key_file": str(tls["key"]),
        "prometheus_web_basic_auth_users": {SCRAPE_USER: SCRAPE_HASH},
        "prometheus_scrape_basic_auth_username": SCRAPE_USER,
        "prometheus_scrape_basic_auth_password": SCRAPE_PASSWORD,
        "prometheus_scrape_tls_ca_file": str(tls["ca"]),
        "prometheus_scrape_interval": "1s",
        "prometheus_scrape_timeout": "1s",
    }
    return host, extra


def test_rendered_files_with_tls_and_basic_auth(work: Path, tls: dict[str, Path]):
    host, extra = secured(tls)
    r = render(work, host, **extra).ok()
    assert SCRAPE_PASSWORD not in r.output and SCRAPE_HASH not in r.output
    for name in ("node-exporter-web.yml", "prometheus-web.yml"):
        path = r.file(name)
        assert owner(path) == ("root", SERVICE_USER, "0o640"), name
        web = yaml.safe_load(path.read_text())
        assert web == {"tls_server_config": {"cert_file": str(tls["cert"]), "key_file": str(tls["key"])},
                       "basic_auth_users": {SCRAPE_USER: SCRAPE_HASH}}, name
        check = promtool("check", "web-config", path)
        assert check.returncode == 0, check.stdout + check.stderr
    password = r.file("scrape-password")
    assert owner(password) == ("root", SERVICE_USER, "0o640")
    assert password.read_text() == SCRAPE_PASSWORD
    assert f"--web.config.file={r.file('node-exporter-web.yml')}" in args_of(r.file("node-exporter.default"))
    assert f"--web.config.file={r.file('prometheus-web.yml')}" in args_of(r.file("prometheus.default"))
    text = r.file("prometheus.yml").read_text()
    assert SCRAPE_PASSWORD not in text
    jobs = {j["job_name"]: j for j in yaml.safe_load(text)["scrape_configs"]}
    client = {"scheme": "https", "tls_config": {"ca_file": str(tls["ca"])},
              "basic_auth": {"username": SCRAPE_USER, "password_file": str(password)}}
    for job in ("prometheus", "node"):
        assert {k: jobs[job][k] for k in client} == client, job
    check = promtool("check", "config", r.file("prometheus.yml"))
    assert check.returncode == 0, check.stdout + check.stderr
    # Idempotent; turning the options off removes the files again.
    assert render(work, host, **extra).ok().changed() == 0
    off = render(work).ok()
    assert not off.file("node-exporter-web.yml").exists() and not off.file("scrape-password").exists()
    assert not off.file("prometheus-web.yml").exists()


def on_free_ports(check: Any, *args: Any) -> None:
    """CHECK(node_port, prom_port, *ARGS) on two free ports, again on two others where a
    service found its port taken in the meantime (another test's process took it between
    free_port() and the service's start, which the render in between makes seconds)."""
    for attempt in range(3):
        try:
            check(free_port(), free_port(), *args)
            return
        except AssertionError as exc:
            if "address already in use" not in str(exc) or attempt == 2:
                raise


def test_real_node_exporter_and_prometheus_with_the_rendered_web_config(work: Path, tls: dict[str, Path]):
    on_free_ports(_real_services_with_the_web_config, work, tls)


def _real_services_with_the_web_config(node_port: int, prom_port: int, work: Path, tls: dict[str, Path]) -> None:
    host, extra = secured(tls, node_port, prom_port)
    r = render(work, host, **extra).ok()
    node_url = f"https://127.0.0.1:{node_port}/metrics"
    prom_url = f"https://127.0.0.1:{prom_port}"
    exporter = tool("prometheus-node-exporter")
    with Service([exporter, *args_of(r.file("node-exporter.default"))], work / "node.log") as node:
        status, _ = wait_for(node_url, node, ca=tls["ca"])
        assert status == 401
        assert get(node_url, SCRAPE_USER, "wrong-password", ca=tls["ca"])[0] == 401
        status, body = get(node_url, SCRAPE_USER, SCRAPE_PASSWORD, ca=tls["ca"])
        assert status == 200 and "node_textfile_scrape_error" in body, (status, body[:500])
        plain = get(node_url.replace("https://", "http://"), SCRAPE_USER, SCRAPE_PASSWORD)
        assert plain[0] != 200, plain  # no plain HTTP beside TLS

        with Service([tool("prometheus"), *args_of(r.file("prometheus.default"))], work / "prometheus.log") as prom:
            status, _ = wait_for(f"{prom_url}/-/ready", prom, ca=tls["ca"])
            assert status == 401
            assert get(f"{prom_url}/api/v1/targets", SCRAPE_USER, "wrong-password", ca=tls["ca"])[0] == 401
            health = targets_up(prom_url, tls["ca"])
            assert health == {"prometheus": "up", "node": "up"}, f"{health}\n{prom.tail()}"


def test_prometheus_marks_a_node_exporter_down_with_a_wrong_password(work: Path, tls: dict[str, Path]):
    """The real check can fail: the same setup with a scrape password the hash does not match."""
    on_free_ports(_node_down_with_a_wrong_password, work, tls)


def _node_down_with_a_wrong_password(node_port: int, prom_port: int, work: Path, tls: dict[str, Path]) -> None:
    host, extra = secured(tls, node_port, prom_port)
    host["node_exporter_web_basic_auth_users"] = {
        SCRAPE_USER: "$2b$10$Ka1mh4h3w/pKRtdfe1OqFOGPkFU1vE.08QZnDVkTU7OkW3zW.qeyT"}
    r = render(work, host, **extra).ok()
    with Service([tool("prometheus-node-exporter"), *args_of(r.file("node-exporter.default"))], work / "n.log") as n, \
            Service([tool("prometheus"), *args_of(r.file("prometheus.default"))], work / "p.log") as p:
        wait_for(f"https://127.0.0.1:{node_port}/metrics", n, ca=tls["ca"])
        wait_for(f"https://127.0.0.1:{prom_port}/-/ready", p, ca=tls["ca"])
        deadline = time.monotonic() + 60
        node: dict[str, Any] = {}
        while time.monotonic() < deadline:
            _, body = get(f"https://127.0.0.1:{prom_port}/api/v1/targets", SCRAPE_USER, SCRAPE_PASSWORD, ca=tls["ca"])
            node = next((t for t in json.loads(body)["data"]["activeTargets"] if t["labels"]["job"] == "node"), {})
            if node.get("health") == "down":
                break
            time.sleep(0.5)
        assert node.get("health") == "down" and "401" in node.get("lastError", ""), node


# --- bad settings ---------------------------------------------------------------------------------------

def test_a_password_instead_of_a_hash_is_refused_without_showing_it(work: Path):
    r = render(work, {"node_exporter_web_basic_auth_users": {"scraper": "hunter2-plaintext"}})
    text = r.failed("node_exporter_web_basic_auth_users must map user names", 'wrong entries: ["scraper"]')
    assert "hunter2-plaintext" not in text
    r = render(work, render_node_exporter=False, prometheus_web_basic_auth_users={"a:b": SCRAPE_HASH})
    r.failed("prometheus_web_basic_auth_users must map user names", 'wrong entries: ["a:b"]')


def test_tls_needs_a_certificate_and_a_key(work: Path, tls: dict[str, Path]):
    render(work, {"node_exporter_web_tls_cert_file": str(tls["cert"])}).failed(
        "node_exporter_web_tls_cert_file and node_exporter_web_tls_key_file must both be absolute paths")
    render(work, render_node_exporter=False, prometheus_web_tls_cert_file="cert.pem",
           prometheus_web_tls_key_file="key.pem").failed("prometheus_web_tls_cert_file and prometheus_web_tls_key_file")
    missing = str(work / "missing.pem")
    r = render(work, {"node_exporter_web_tls_cert_file": missing, "node_exporter_web_tls_key_file": str(tls["key"])})
    r.failed("node_exporter_web_tls_cert_file and node_exporter_web_tls_key_file must be files on mon-01", missing)


def test_basic_auth_on_an_exporter_needs_the_scrape_credentials(work: Path):
    host = {"node_exporter_web_basic_auth_users": {SCRAPE_USER: SCRAPE_HASH}}
    render(work, host).failed("prometheus_scrape_basic_auth_username and prometheus_scrape_basic_auth_password")
    r = render(work, host, prometheus_scrape_basic_auth_username="someone-else",
               prometheus_scrape_basic_auth_password=SCRAPE_PASSWORD)
    text = r.failed('exporters without that user: ["mon-01 (node_exporter_web_basic_auth_users)"]')
    assert SCRAPE_PASSWORD not in text
    r = render(work, render_node_exporter=False, prometheus_web_basic_auth_users={"admin": SCRAPE_HASH},
               prometheus_scrape_basic_auth_username=SCRAPE_USER, prometheus_scrape_basic_auth_password="x")
    r.failed('"mon-01 (prometheus_web_basic_auth_users)"')


def test_the_node_exporters_of_one_job_must_agree(work: Path, tls: dict[str, Path]):
    other = {"gpu-node-01": {"ansible_host": "10.0.0.11", "node_exporter_web_listen_address": "0.0.0.0:9100",
                             "llmhost_metrics_bind_address": "0.0.0.0",
                             "node_exporter_web_tls_cert_file": str(tls["cert"]),
                             "node_exporter_web_tls_key_file": str(tls["key"])}}
    r = render(work, {}, other, prometheus_node_exporter_groups=["inference", "monitoring"],
               prometheus_dcgm_exporter_enabled=False)
    r.failed("must all use TLS or none", 'with TLS ["gpu-node-01"]')


def test_metrics_follow_their_own_bind_address(work: Path):
    """A host whose inference API is public but whose metrics stay on loopback cannot be scraped remotely."""
    other = {"gpu-node-01": {"ansible_host": "10.0.0.11", "llmhost_bind_address": "0.0.0.0"}}
    r = render(work, {}, other, render_node_exporter=False, prometheus_dcgm_exporter_enabled=False)
    r.failed("gpu-node-01 (triton, llmhost_metrics_bind_address)")
    other["gpu-node-01"] = {"ansible_host": "10.0.0.11", "llmhost_metrics_bind_address": "10.0.0.11"}
    r = render(work, {}, other, render_node_exporter=False, prometheus_dcgm_exporter_enabled=False).ok()
    jobs = {j["job_name"]: j for j in yaml.safe_load(r.file("prometheus.yml").read_text())["scrape_configs"]}
    assert jobs["triton"]["static_configs"][0]["targets"] == ["10.0.0.11:8002"]


# --- Grafana ----------------------------------------------------------------------------------------------

def grafana_ini(path: Path) -> configparser.ConfigParser:
    """grafana.ini as Grafana's ini reader sees it (values in triple quotes unquoted)."""
    ini = configparser.ConfigParser(interpolation=None, comment_prefixes=(";", "#"), strict=True)
    ini.read_string(path.read_text())
    for section in ini.sections():
        for key, value in ini[section].items():
            if value.startswith('"""') and value.endswith('"""'):
                ini[section][key] = value[3:-3]
    return ini


def check_grafana_keys(ini: configparser.ConfigParser) -> None:
    for section in ini.sections():
        unknown = set(ini[section]) - GRAFANA_KEYS.get(section, set())
        assert not unknown, f"[{section}] {unknown} are not grafana.ini settings"


GRAFANA = {"render_node_exporter": False, "render_prometheus": False, "render_grafana": True,
           "grafana_admin_password": "correct-horse-battery"}


def test_grafana_generates_a_secret_key_once_and_keeps_it(work: Path):
    r = render(work, **GRAFANA).ok()
    key_file = r.file("grafana-secret-key")
    assert owner(key_file) == ("root", "root", "0o600")
    key = key_file.read_text().strip()
    assert len(key) >= 32 and key != GRAFANA_PUBLIC_KEY
    ini = grafana_ini(r.file("grafana.ini"))
    check_grafana_keys(ini)
    assert ini["security"]["secret_key"] == key
    assert ini["server"]["protocol"] == "http" and "cert_file" not in ini["server"]
    assert key not in r.output
    again = render(work, **GRAFANA).ok()
    assert again.changed() == 0, again.output[-3000:]
    assert key_file.read_text().strip() == key
    assert grafana_ini(again.file("grafana.ini"))["security"]["secret_key"] == key
    # A given key wins and the generated file is left alone.
    given = render(work, **GRAFANA, grafana_secret_key="site-key-from-the-vault-0123").ok()
    assert grafana_ini(given.file("grafana.ini"))["security"]["secret_key"] == "site-key-from-the-vault-0123"
    assert key_file.read_text().strip() == key
    assert "site-key-from-the-vault-0123" not in given.output


def test_grafana_https(work: Path, tls: dict[str, Path]):
    r = render(work, **GRAFANA, grafana_protocol="https", grafana_cert_file=str(tls["cert"]),
               grafana_cert_key=str(tls["key"])).ok()
    ini = grafana_ini(r.file("grafana.ini"))
    check_grafana_keys(ini)
    server = ini["server"]
    assert (server["protocol"], server["cert_file"], server["cert_key"]) == ("https", str(tls["cert"]), str(tls["key"]))
    assert ini["security"]["cookie_secure"] == "true"


def test_grafana_datasource_with_prometheus_basic_auth_and_tls(work: Path, tls: dict[str, Path]):
    r = render(work, **GRAFANA, grafana_datasource_url="https://127.0.0.1:9090",
               grafana_datasource_basic_auth_user=SCRAPE_USER, grafana_datasource_basic_auth_password=SCRAPE_PASSWORD,
               grafana_datasource_tls_ca_file=str(tls["ca"])).ok()
    ds = yaml.safe_load(r.file("datasource.yml").read_text())["datasources"][0]
    assert ds["basicAuth"] is True and ds["basicAuthUser"] == SCRAPE_USER
    assert ds["jsonData"]["tlsAuthWithCACert"] is True
    assert ds["secureJsonData"] == {"basicAuthPassword": SCRAPE_PASSWORD, "tlsCACert": tls["ca"].read_text()}
    assert SCRAPE_PASSWORD not in r.output
    plain = yaml.safe_load(render(work, **GRAFANA).ok().file("datasource.yml").read_text())["datasources"][0]
    assert not {"basicAuth", "secureJsonData"} & set(plain) and "tlsAuthWithCACert" not in plain["jsonData"]


@pytest.mark.parametrize("settings,message", [
    ({"grafana_secret_key": GRAFANA_PUBLIC_KEY}, "Grafana's public default key is refused"),
    ({"grafana_secret_key": "short"}, "grafana_secret_key must be empty"),
    ({"grafana_protocol": "https"}, "grafana_protocol must be http, or https with grafana_cert_file"),
    ({"grafana_protocol": "ftp"}, "grafana_protocol must be one of: http, https, got: ftp"),
    ({"grafana_cert_file": "/etc/ssl/grafana.pem"}, "with http both stay empty"),
    ({"grafana_datasource_basic_auth_user": "scraper"},
     "grafana_datasource_basic_auth_user and grafana_datasource_basic_auth_password must be set together"),
])
def test_grafana_bad_settings_are_refused(work: Path, settings: dict[str, str], message: str):
    r = render(work, **GRAFANA, **settings)
    text = r.failed(message)
    if "grafana_secret_key" in settings:
        assert settings["grafana_secret_key"] not in text


def test_grafana_secret_key_option_says_it_must_be_kept():
    spec = yaml.safe_load((ROOT / "roles/grafana/meta/argument_specs.yml").read_text())
    option = spec["argument_specs"]["main"]["options"]["grafana_secret_key"]
    assert option["no_log"] is True and option["default"] == ""
    assert "unreadable" in " ".join(option["description"])
