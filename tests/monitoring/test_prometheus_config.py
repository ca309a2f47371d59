"""prometheus.yml as roles/prometheus renders it for an inventory, checked by promtool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.harness.paths import ROOT
from tests.harness.prom import promtool

PLAYBOOK = Path(__file__).resolve().parent / "render_prometheus.yml"
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"


def inventory(tmp_path: Path, hosts: dict[str, dict[str, Any]], monitoring: str) -> Path:
    gateway = {h: v for h, v in hosts.items() if v.pop("_gateway", False)}  # a gateway on a host of its own
    inv = {"all": {"children": {
        "gateway": {"hosts": gateway},
        "inference": {"hosts": {h: v for h, v in hosts.items() if h not in gateway and v.pop("_inference", True)}},
        "monitoring": {"hosts": {monitoring: {"ansible_connection": "local",
                                              "ansible_python_interpreter": sys.executable}}},
    }}}
    path = tmp_path / "inventory.yml"
    path.write_text(json.dumps(inv))
    return path


def render(tmp_path: Path, inv: Path, **extra: Any) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "out"
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inv), str(PLAYBOOK), "-e", json.dumps({"out_dir": str(out), **extra})],
        text=True, capture_output=True, cwd=ROOT, env=env, timeout=300, check=False,
    )


def scrape_jobs(config: dict[str, Any]) -> dict[str, dict[str, str]]:
    """job -> {instance: address}"""
    return {
        job["job_name"]: {sc["labels"]["instance"]: sc["targets"][0] for sc in job.get("static_configs", [])
                          if "labels" in sc}
        for job in config["scrape_configs"]
    }


def test_cluster_config_is_valid_and_scrapes_every_host(tmp_path: Path):
    inv = inventory(tmp_path, {
        "gpu-node-01": {"ansible_host": "10.0.0.11", "llmhost_metrics_bind_address": "0.0.0.0"},
        "gpu-node-02": {"ansible_host": "fd00::12", "llmhost_metrics_bind_address": "::", "triton_metrics_port": 9002,
                        "node_exporter_web_listen_address": "0.0.0.0:9101"},
        "mon-01": {"llmhost_metrics_bind_address": "127.0.0.1", "triton_metrics_port": 18002},
    }, monitoring="mon-01")
    r = render(tmp_path, inv, prometheus_dcgm_exporter_enabled=True, prometheus_alertmanagers=["10.0.0.5:9093"],
               prometheus_external_labels={"site": "lab"}, prometheus_web_listen_address="0.0.0.0:9090",
               prometheus_scrape_configs_extra=[{"job_name": "haproxy",
                                                 "static_configs": [{"targets": ["10.0.0.9:8405"]}]}])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    path = tmp_path / "out" / "prometheus.yml"
    check = promtool("check", "config", path)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "2 rule files found" in check.stdout and "SUCCESS" in check.stdout
    text = path.read_text()
    assert text.startswith("#\n# Ansible managed")
    config = yaml.safe_load(text)
    assert scrape_jobs(config) == {
        "prometheus": {"mon-01": "127.0.0.1:9090"},
        "triton": {"gpu-node-01": "10.0.0.11:8002", "gpu-node-02": "[fd00::12]:9002", "mon-01": "127.0.0.1:18002"},
        "node": {"gpu-node-01": "10.0.0.11:9100", "gpu-node-02": "[fd00::12]:9101", "mon-01": "127.0.0.1:9100"},
        "dcgm": {"gpu-node-01": "10.0.0.11:9400", "gpu-node-02": "[fd00::12]:9400", "mon-01": "127.0.0.1:9400"},
        "haproxy": {},
    }
    assert config["global"]["external_labels"] == {"site": "lab"}
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["10.0.0.5:9093"]
    assert config["rule_files"] == [str(tmp_path / "out" / "rules" / "*.yml")]


def test_gateway_targets_follow_the_hosts_that_run_it(tmp_path: Path):
    """Job gateway: inference hosts with gateway_api_keys (or gateway_enabled true) and
    the hosts of the group gateway, at their gateway_metrics_listen_address (default
    llmhost_metrics_bind_address) and port; node_exporter on the gateway's own host too."""
    key = [{"name": "a", "sha256": "0" * 64}]
    public = {"llmhost_metrics_bind_address": "0.0.0.0"}
    inv = inventory(tmp_path, {
        "gw-keys": {"ansible_host": "10.0.0.11", **public, "gateway_api_keys": key},
        "gw-port": {"ansible_host": "10.0.0.12", **public, "gateway_enabled": True,
                    "gateway_metrics_listen_address": "10.0.0.12", "gateway_metrics_port": 9081},
        "gw-off": {"ansible_host": "10.0.0.13", **public, "gateway_api_keys": key, "gateway_enabled": False},
        "no-keys": {"ansible_host": "10.0.0.14", **public},
        "gw-own": {"ansible_host": "10.0.0.20", **public, "_gateway": True},
    }, monitoring="mon-01")
    r = render(tmp_path, inv)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    check = promtool("check", "config", tmp_path / "out" / "prometheus.yml")
    assert check.returncode == 0, check.stdout + check.stderr
    jobs = scrape_jobs(yaml.safe_load((tmp_path / "out" / "prometheus.yml").read_text()))
    assert jobs["gateway"] == {"gw-keys": "10.0.0.11:18081", "gw-port": "10.0.0.12:9081", "gw-own": "10.0.0.20:18081"}
    assert jobs["node"]["gw-own"] == "10.0.0.20:9100" and "gw-own" not in jobs["triton"], jobs


def test_a_gateway_metrics_on_loopback_of_another_host_is_refused(tmp_path: Path):
    inv = inventory(tmp_path, {
        "gw-01": {"ansible_host": "10.0.0.11", "llmhost_metrics_bind_address": "0.0.0.0",
                  "gateway_metrics_listen_address": "127.0.0.1",
                  "gateway_api_keys": [{"name": "a", "sha256": "0" * 64}]},
    }, monitoring="mon-01")
    r = render(tmp_path, inv)
    assert r.returncode != 0
    assert "gw-01 (gateway, gateway_metrics_listen_address)" in r.stdout, r.stdout[-3000:]


METRICS_TOKEN = "gateway-metrics-token-0123456789"


def test_gateways_with_a_token_are_scraped_with_it_from_a_file(tmp_path: Path):
    """A gateway whose /metrics asks for a token (gateway_metrics_token) is scraped with
    Authorization: Bearer from a credentials_file; the token is never in prometheus.yml."""
    inv = inventory(tmp_path, {
        "gw-01": {"ansible_host": "10.0.0.11", "llmhost_metrics_bind_address": "0.0.0.0",
                  "gateway_api_keys": [{"name": "a", "sha256": "0" * 64}], "gateway_metrics_token": METRICS_TOKEN},
    }, monitoring="mon-01")
    token_file = tmp_path / "gateway-metrics-token"
    token_file.write_text(METRICS_TOKEN)
    r = render(tmp_path, inv, prometheus_gateway_metrics_token=METRICS_TOKEN,
               _prometheus_gateway_token_file=str(token_file))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    path = tmp_path / "out" / "prometheus.yml"
    check = promtool("check", "config", path)
    assert check.returncode == 0, check.stdout + check.stderr
    text = path.read_text()
    assert METRICS_TOKEN not in text and METRICS_TOKEN not in r.stdout
    jobs = {job["job_name"]: job for job in yaml.safe_load(text)["scrape_configs"]}
    assert jobs["gateway"]["authorization"] == {"type": "Bearer", "credentials_file": str(token_file)}
    assert "authorization" not in jobs["triton"] and "authorization" not in jobs["node"]

    # Without the token on this side, the gateway could not be scraped: refused, naming the host.
    r = render(tmp_path, inv)
    assert r.returncode != 0
    assert "gateways on gw-01 ask for a token" in " ".join(r.stdout.split()), r.stdout[-3000:]
    assert METRICS_TOKEN not in r.stdout


def test_dcgm_targets_follow_the_hosts_that_install_the_exporter(tmp_path: Path):
    """auto (the default) scrapes dcgm-exporter where roles/dcgm_exporter installs it: GPU-profile
    hosts that do not turn it off, on each host's own dcgm_exporter_listen_address."""
    inv = inventory(tmp_path, {
        "gpu-node-01": {"ansible_host": "10.0.0.11", "llmhost_metrics_bind_address": "0.0.0.0"},
        "gpu-node-02": {"ansible_host": "10.0.0.12", "llmhost_metrics_bind_address": "0.0.0.0",
                        "dcgm_exporter_listen_address": "10.0.0.12:9500"},
        "cpu-node": {"ansible_host": "10.0.0.13", "llmhost_metrics_bind_address": "0.0.0.0", "llmhost_profile": "cpu"},
        "gpu-no-dcgm": {"ansible_host": "10.0.0.14", "llmhost_metrics_bind_address": "0.0.0.0",
                        "dcgm_exporter_enabled": False},
    }, monitoring="mon-01")
    r = render(tmp_path, inv)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    path = tmp_path / "out" / "prometheus.yml"
    assert promtool("check", "config", path).returncode == 0
    jobs = scrape_jobs(yaml.safe_load(path.read_text()))
    assert jobs["dcgm"] == {"gpu-node-01": "10.0.0.11:9400", "gpu-node-02": "10.0.0.12:9500"}
    assert set(jobs["triton"]) == {"gpu-node-01", "gpu-node-02", "cpu-node", "gpu-no-dcgm"}

    off = render(tmp_path, inv, prometheus_dcgm_exporter_enabled=False)
    assert off.returncode == 0, off.stdout[-4000:]
    assert "dcgm" not in scrape_jobs(yaml.safe_load(path.read_text()))


def test_a_dcgm_exporter_on_loopback_of_another_host_is_refused(tmp_path: Path):
    inv = inventory(tmp_path, {
        "gpu-node-01": {"ansible_host": "10.0.0.11", "llmhost_metrics_bind_address": "0.0.0.0",
                        "dcgm_exporter_listen_address": "127.0.0.1:9400"},
    }, monitoring="mon-01")
    r = render(tmp_path, inv)
    assert r.returncode != 0
    assert "gpu-node-01 (dcgm, dcgm_exporter_listen_address)" in r.stdout


def test_prometheus_dcgm_exporter_enabled_must_be_auto_true_or_false(tmp_path: Path):
    inv = inventory(tmp_path, {}, monitoring="mon-01")
    r = render(tmp_path, inv, prometheus_dcgm_exporter_enabled="sometimes")
    assert r.returncode != 0
    assert "prometheus_dcgm_exporter_enabled must be auto, true or false" in r.stdout


def test_a_monitoring_host_without_inference_hosts_is_valid(tmp_path: Path):
    inv = inventory(tmp_path, {}, monitoring="mon-01")
    r = render(tmp_path, inv)
    assert r.returncode == 0, r.stdout[-4000:]
    path = tmp_path / "out" / "prometheus.yml"
    assert promtool("check", "config", path).returncode == 0
    assert set(scrape_jobs(yaml.safe_load(path.read_text()))) == {"prometheus", "node"}


def test_preflight_names_the_loopback_binding_another_host_has(tmp_path: Path):
    inv = inventory(tmp_path, {
        "gpu-node-01": {"ansible_host": "10.0.0.11"},  # llmhost_metrics_bind_address defaults to 127.0.0.1
        "gpu-node-02": {"ansible_host": "10.0.0.12", "llmhost_metrics_bind_address": "127.0.0.1",
                        "prometheus_scrape_address": "10.1.0.12"},
    }, monitoring="mon-01")
    r = render(tmp_path, inv, prometheus_node_exporter_groups=["monitoring"])
    assert r.returncode != 0
    assert "gpu-node-01 (triton, llmhost_metrics_bind_address)" in r.stdout
    assert "gpu-node-02" not in r.stdout.split("cannot scrape", 1)[1].split("PLAY RECAP")[0]
    assert not (tmp_path / "out" / "prometheus.yml").exists()


def test_preflight_rejects_a_bad_retention(tmp_path: Path):
    inv = inventory(tmp_path, {}, monitoring="mon-01")
    r = render(tmp_path, inv, prometheus_retention_time="two weeks")
    assert r.returncode != 0
    assert "prometheus_retention_time must be a Prometheus duration" in r.stdout


def test_gateways_with_metrics_over_tls_are_scraped_over_https_with_the_ca(tmp_path: Path):
    """A gateway with TLS serves /metrics over HTTPS (gateway_metrics_tls, by default with
    gateway_tls_cert_file): job gateway scrapes with scheme https and
    prometheus_gateway_metrics_ca_file; gateways that disagree are refused by name."""
    from tests.harness.certs import self_signed

    key = [{"name": "a", "sha256": "0" * 64}]
    tls = {"llmhost_metrics_bind_address": "0.0.0.0", "gateway_api_keys": key,
           "gateway_tls_cert_file": "/etc/ssl/gw.crt", "gateway_tls_key_file": "/etc/ssl/gw.key"}
    ca, _ = self_signed(tmp_path / "ca")
    hosts = {"gw-01": {"ansible_host": "10.0.0.11", **tls},
             "gw-02": {"ansible_host": "10.0.0.12", **tls, "gateway_metrics_tls": True}}
    r = render(tmp_path, inventory(tmp_path, json.loads(json.dumps(hosts)), monitoring="mon-01"),
               prometheus_gateway_metrics_ca_file=str(ca))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    path = tmp_path / "out" / "prometheus.yml"
    check = promtool("check", "config", path)
    assert check.returncode == 0, check.stdout + check.stderr
    jobs = {job["job_name"]: job for job in yaml.safe_load(path.read_text())["scrape_configs"]}
    assert jobs["gateway"]["scheme"] == "https" and jobs["gateway"]["tls_config"] == {"ca_file": str(ca)}
    assert "scheme" not in jobs["triton"] and "scheme" not in jobs["node"]

    # No CA file here: the system's CAs (prometheus_scrape_tls_ca_file's default, empty).
    r = render(tmp_path, inventory(tmp_path, json.loads(json.dumps(hosts)), monitoring="mon-01"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    gateway = next(j for j in yaml.safe_load(path.read_text())["scrape_configs"] if j["job_name"] == "gateway")
    assert gateway["scheme"] == "https" and "tls_config" not in gateway

    # /metrics kept in plain HTTP on every gateway: plain scrapes.
    plain = {h: {**v, "gateway_metrics_tls": False} for h, v in hosts.items()}
    r = render(tmp_path, inventory(tmp_path, plain, monitoring="mon-01"), prometheus_gateway_metrics_ca_file=str(ca))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    gateway = next(j for j in yaml.safe_load(path.read_text())["scrape_configs"] if j["job_name"] == "gateway")
    assert "scheme" not in gateway and "tls_config" not in gateway

    # One job: all over HTTPS or none.
    mixed = {**json.loads(json.dumps(hosts)), "gw-02": {"ansible_host": "10.0.0.12", **tls,
                                                        "gateway_metrics_tls": False}}
    r = render(tmp_path, inventory(tmp_path, mixed, monitoring="mon-01"))
    assert r.returncode != 0
    assert 'must all serve it over HTTPS or none' in " ".join(r.stdout.split()), r.stdout[-3000:]
    assert '["gw-01"]' in " ".join(r.stdout.split()).replace('\\"', '"'), r.stdout[-3000:]
