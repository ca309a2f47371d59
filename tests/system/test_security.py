"""Security of the converged host: `systemd-analyze security` exposure of our units
against the same units without their hardening block, where Triton listens, and
that no task can log a secret.

Env-file and model-directory permissions are in test_provision.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from _converge import REPO, Converged
from _host import BootedHost

# Documented in docs/reliability.md. Measured on the booted host (profile cpu):
# tritonserver 1.5 (9.2 without its hardening block), llmhost-smoke@ 1.6 (9.6).
EXPOSURE_MAX = {"tritonserver.service": 2.0, "llmhost-smoke@tiny.service": 2.0}
SECRETS = ("grafana_admin_password", "model_repository_hf_token", "model_repository_modelscope_token")


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
    defaults = yaml.safe_load((REPO / "roles" / "llmhost" / "defaults" / "main.yml").read_text())
    assert defaults["llmhost_bind_address"] == "127.0.0.1"
    demo = yaml.safe_load((REPO / "inventory" / "demo.yml").read_text())
    assert "llmhost_bind_address" not in demo and "llmhost_bind_address" not in converged.extra_vars.read_text()
    r = converged.host.exec(["ss", "-Hltnp"], check=True)
    triton = [line.split()[3] for line in r.stdout.splitlines() if '"tritonserver"' in line]
    ports = {str(converged.ports[k]) for k in ("http", "grpc", "metrics")}
    assert {a.rsplit(":", 1)[1] for a in triton} == ports, r.stdout
    hosts = {a.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") for a in triton}  # gRPC: IPv4-mapped
    assert hosts == {"127.0.0.1"}, triton


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


def _derived(names: set[str]) -> set[str]:
    """NAMES plus every role variable whose value mentions one of them (to a fixed point)."""
    defs: dict[str, str] = {}
    for f in [*REPO.glob("roles/*/vars/main.yml"), *REPO.glob("roles/*/defaults/main.yml")]:
        for k, v in (yaml.safe_load(f.read_text()) or {}).items():
            defs[k] = yaml.safe_dump(v)
    out = set(names)
    while True:
        more = {k for k, v in defs.items() if k not in out and any(re.search(rf"\b{n}\b", v) for n in out)}
        if not more:
            return out
        out |= more


def test_no_task_can_log_a_secret():
    """A task that passes a secret (or a variable made from one) to a module has
    no_log; only conditions (`when`, an assert's `that`) may read a secret bare."""
    secrets = _derived(set(SECRETS))
    assert {"_model_repository_hub_env"} <= secrets  # the hub token reaches the download tasks this way
    offenders, seen = [], 0
    for f in sorted(REPO.glob("roles/*/tasks/*.yml")) + sorted(REPO.glob("roles/*/handlers/*.yml")):
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
                    offenders.append(f"{f.relative_to(REPO)}: {task.get('name')} ({', '.join(used)})")
    assert seen > 0
    assert not offenders, "tasks that can log a secret:\n" + "\n".join(offenders)


def test_secrets_have_no_default_and_are_marked_no_log():
    for role, name in (("grafana", "grafana_admin_password"), ("model_repository", "model_repository_hf_token"),
                       ("model_repository", "model_repository_modelscope_token")):
        spec = yaml.safe_load((REPO / "roles" / role / "meta" / "argument_specs.yml").read_text())
        option = spec["argument_specs"]["main"]["options"][name]
        assert option.get("no_log") is True, (role, name)
        defaults = yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text()) or {}
        assert not defaults.get(name), f"{name} has a default value"
