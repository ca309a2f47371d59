"""One converge of site.yml into the booted host, shared by the system tests.

The host shares this machine's network: Triton, Prometheus and node_exporter are
reached on 127.0.0.1 at the free ports chosen here, Triton's and the gateway's
metrics on their own bind address, METRICS_ADDRESS (another loopback address).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.harness.booted import BootedHost
from tests.harness.net import free_port
from tests.harness.paths import ROOT

ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
CONVERGE_TIMEOUT_S = 2400
# llmhost_metrics_bind_address of the converge: not 127.0.0.1, so the tests see
# metrics and inference on addresses of their own (Linux routes all of 127/8 to lo).
METRICS_ADDRESS = "127.0.0.2"
# The booted hosts serve inventory/demo.yml's models but its embedding model (vLLM's
# pooling runner): the fault tests bound the recovery of one engine on 2 shared cores.
# `make demo` serves both; the embeddings path is tested in tests/e2e/test_embeddings.py.
# The chat model's engines publish their KV-cache events (its setting kv_events), which
# the session's host routes it by (conftest.py): the gateway follows them under its unit's
# hardening.
HOST_MODELS = [{**m, "settings": {**(m.get("settings") or {}), "kv_events": True}}
               for m in yaml.safe_load((ROOT / "inventory" / "demo.yml").read_text())["llmhost_models"]
               if (m.get("engine_args") or {}).get("runner") != "pooling"]


@dataclass(frozen=True)
class Converged:
    host: BootedHost
    inventory: Path
    extra_vars: Path
    prometheus: str
    triton_http: str
    ports: dict[str, int]
    first_converge: subprocess.CompletedProcess[str]
    triton_metrics: str = ""  # http://METRICS_ADDRESS:PORT
    gateway_key_file: Path | None = None  # the gateway's plain API key (0600), as `make demo` makes it
    gateway_limited_key: str = ""  # a second key, limited to 1 request per minute (rpm: 1)


def run_playbook(inventory: Path, extra_vars: Path, pip_vars: Path, playbook: str,
                 *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_FORCE_COLOR": "0", **(env or {})}
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), "-e", f"@{ROOT / 'inventory' / 'demo.yml'}",
         "-e", f"@{pip_vars}", "-e", f"@{extra_vars}", *args, playbook],
        cwd=ROOT, env=env, text=True, capture_output=True, timeout=CONVERGE_TIMEOUT_S, check=False,
    )


def recap(out: str) -> dict[str, int]:
    m = re.search(r"^\S+\s*:\s*(ok=\d+.*)$", out.split("PLAY RECAP", 1)[-1], re.M)
    assert m, out[-3000:]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}


def changed_tasks(out: str) -> list[str]:
    """Names of the tasks (and handlers) that reported a change in ansible-playbook's output."""
    names, task = [], ""
    for line in out.splitlines():
        if line.startswith(("TASK [", "RUNNING HANDLER [")):
            task = line.split("[", 1)[1].rsplit("]", 1)[0]
        elif line.startswith("changed: [") and task not in names:
            names.append(task)
    return names


def converge(host: BootedHost, work: Path, groups: tuple[str, ...] = ("inference", "monitoring"),
             overrides: dict[str, object] | None = None, ports: dict[str, int] | None = None) -> Converged:
    """site.yml into HOST with free ports (PORTS chosen by the caller win), the demo
    key and fast scrapes; OVERRIDES (extra vars, e.g. gateway_upstreams) win over those."""
    ports = {k: free_port() for k in ("http", "grpc", "metrics", "node", "prometheus", "gateway", "gateway_metrics",
                                      "gateway_grpc")} | (ports or {})
    # The gateway's key, passed as `make demo` passes it (inventory/demo.yml reads the file).
    key_file = work / "gateway-api-key"
    key_file.touch(mode=0o600)
    key_file.write_text(secrets.token_urlsafe(32) + "\n")
    limited_key = secrets.token_urlsafe(32)
    extra = {
        "triton_http_port": ports["http"],
        "triton_grpc_port": ports["grpc"],
        "triton_metrics_port": ports["metrics"],
        "llmhost_metrics_bind_address": METRICS_ADDRESS,
        "node_exporter_web_listen_address": f"127.0.0.1:{ports['node']}",
        "prometheus_web_listen_address": f"127.0.0.1:{ports['prometheus']}",
        "gateway_port": ports["gateway"],
        "gateway_metrics_port": ports["gateway_metrics"],
        # The demo's gRPC door (18082) on a free port too: the booted hosts share the
        # machine's network.
        "gateway_grpc_port": ports["gateway_grpc"],
        "gateway_demo_key_file": str(key_file),
        # The demo key as inventory/demo.yml passes it, and one with a limit, so that the
        # rate-limit metrics and their dashboard panel can be seen.
        "gateway_api_keys": "{{ [{'name': 'demo', 'key': lookup('ansible.builtin.file', gateway_demo_key_file)},"
                            f" {{'name': 'limited', 'key': '{limited_key}', 'rpm': 1}}] }}}}",
        # Fast scrapes so that rates have samples a few seconds after traffic.
        "prometheus_scrape_interval": "5s",
        "prometheus_scrape_timeout": "5s",
        "prometheus_evaluation_interval": "5s",
        # Grafana cannot be installed here: the role renders its files into a staging dir.
        "grafana_enabled": False,
        "llmhost_models": HOST_MODELS,
        **(overrides or {}),
    }
    extra_vars = work / "vars.json"
    extra_vars.write_text(json.dumps(extra))
    inventory = host.write_inventory(work / "inventory.yml", groups=groups)
    first = run_playbook(inventory, extra_vars, host.pip_vars_file, "site.yml")
    assert first.returncode == 0, f"site.yml failed:\n{first.stdout[-8000:]}\n{first.stderr[-3000:]}"
    return Converged(host, inventory, extra_vars, f"http://127.0.0.1:{ports['prometheus']}",
                     f"http://127.0.0.1:{ports['http']}", ports, first,
                     f"http://{METRICS_ADDRESS}:{ports['metrics']}", key_file, limited_key)
