"""Provisioning as a user sees it: site.yml over SSH into a booted Debian 12 host
(profile cpu, the tiny model), then the host's own systemd, the smoke test from
this machine, idempotence (second run and --check --diff report changed=0),
a restart, the journal, and a preflight that refuses a bad variable by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.system._converge import Converged, changed_tasks, recap, run_playbook
from tests.system._unit import props, wait_ready

LLMHOST = Path(sys.executable).parent / "llmhost"


def test_converge_reports_changes(converged: Converged):
    counts = recap(converged.first_converge.stdout)
    assert counts["failed"] == 0 and counts["unreachable"] == 0
    assert counts["changed"] > 0  # a fresh host: it really installed things


def test_unit_active_enabled_and_not_root(converged: Converged):
    host = converged.host
    assert host.exec(["systemctl", "is-active", "tritonserver"]).stdout.strip() == "active"
    assert host.exec(["systemctl", "is-enabled", "tritonserver"]).stdout.strip() == "enabled"
    pid = host.exec(["systemctl", "show", "-p", "MainPID", "--value", "tritonserver"]).stdout.strip()
    assert pid.isdigit() and int(pid) > 0
    user = host.exec(["ps", "-o", "user=", "-p", pid]).stdout.strip()
    assert user == "llmhost", user
    shell = host.exec(["getent", "passwd", "llmhost"]).stdout.strip().rsplit(":", 1)[-1]
    assert shell.endswith("nologin"), shell
    # Every process of the service (stub, EngineCore, Worker) runs as that user too.
    users = set(host.exec("ps -o user= --ppid " + pid).stdout.split())
    assert users <= {"llmhost"}, users


def test_env_file_and_model_permissions(converged: Converged):
    host = converged.host
    r = host.exec("stat -c '%a %U %G' /etc/llmhost/tritonserver.env")
    assert r.returncode == 0, r.stderr
    mode, owner, group = r.stdout.split()
    assert owner == "root" and group == "llmhost" and int(mode, 8) & 0o007 == 0, r.stdout
    # The service user can read the model repository but not change it.
    r = host.exec("runuser -u llmhost -- sh -c 'touch /opt/llmhost/models/x' ; echo $?")
    assert r.stdout.strip().splitlines()[-1] != "0"
    # Directories: the configuration readable by the service's group only, the state
    # directory the service's alone, the unit root's.
    for path, want in (("/etc/llmhost", "750 root llmhost"), ("/var/lib/llmhost", "750 llmhost llmhost"),
                       ("/var/lib/tritonserver", "750 llmhost llmhost"),
                       ("/etc/systemd/system/tritonserver.service", "644 root root")):
        assert host.exec(f"stat -c '%a %U %G' {path}").stdout.strip() == want, path
    # The running server keeps its counts (engine hangs) there, across its restarts.
    pid = host.exec(["systemctl", "show", "-p", "MainPID", "--value", "tritonserver"]).stdout.strip()
    environ = host.exec(["cat", f"/proc/{pid}/environ"], check=True).stdout.split("\0")
    assert "LLMHOST_STATE_DIR=/var/lib/tritonserver" in environ, environ
    # Models and weights: root's, nothing writable by group or others, nothing owned
    # by the service user, and the service user can read every file.
    for tree in ("/opt/llmhost/models", "/opt/llmhost/weights"):
        r = host.exec(f"find {tree} \\( -perm /022 -o ! -user root \\) -printf '%p %u %m\\n'")
        assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
        r = host.exec(f"runuser -u llmhost -- find {tree} -type f ! -readable")
        assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
    assert host.exec("ls /opt/llmhost/models/tiny").stdout.split() == ["1", "config.pbtxt", "model.json"]


def test_the_host_gets_the_package_and_no_lab_code(converged: Converged):
    """The role copies src/llmhost alone: the GPU checks and comparisons (lab/) stay in the
    repository, and the package installed in the venv has none of them either."""
    host = converged.host
    sources = host.exec("cd /opt/llmhost/src && find . -type f | sort").stdout.split()
    assert "./llmhost/pyproject.toml" in sources and "./llmhost/src/llmhost/cli.py" in sources, sources[:20]
    assert not [f for f in sources if "/lab/" in f or "gpucheck" in f or f.endswith("README.md")], sources
    r = host.exec("find /opt/llmhost/venv -path '*site-packages*' \\( -name gpucheck -o -name lab \\) -print")
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
    r = host.exec("/opt/llmhost/venv/bin/llmhost --version")
    assert r.returncode == 0 and r.stdout.startswith("llmhost "), r.stdout + r.stderr


def test_smoke_from_this_machine(converged: Converged):
    p = converged.ports
    done = subprocess.run(
        [str(LLMHOST), "smoke", "--url", converged.triton_http, "--grpc-url", f"127.0.0.1:{p['grpc']}",
         "--metrics-url", converged.triton_metrics, "--model", "tiny", "--json"],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["ok"] is True


def test_second_converge_changes_nothing(converged: Converged):
    r = run_playbook(converged.inventory, converged.extra_vars, converged.host.pip_vars_file, "site.yml")
    assert r.returncode == 0, r.stdout[-6000:]
    counts = recap(r.stdout)
    assert counts["changed"] == 0 and counts["failed"] == 0, f"changed: {changed_tasks(r.stdout)}\n{r.stdout[-6000:]}"


def test_check_diff_after_converge_changes_nothing(converged: Converged):
    r = run_playbook(converged.inventory, converged.extra_vars, converged.host.pip_vars_file, "site.yml",
                     "--check", "--diff")
    assert r.returncode == 0, r.stdout[-6000:]
    counts = recap(r.stdout)
    assert counts["changed"] == 0 and counts["failed"] == 0, r.stdout[-6000:]


def test_restart_comes_back_ready_and_journal_has_the_server_log(converged: Converged):
    host = converged.host
    # The restart job ends once the server answers (the unit's start check): up to
    # triton_service_ready_timeout_s, and a start that hangs fails the job.
    r = host.exec(["systemctl", "restart", "tritonserver"], timeout=300 + 60)
    assert r.returncode == 0, r.stderr + host.exec("journalctl -u tritonserver -n 40 --no-pager").stdout
    assert wait_ready(converged.triton_http), host.exec("journalctl -u tritonserver -n 40 --no-pager").stdout
    log = host.exec(["journalctl", "-u", "tritonserver", "--no-pager", "-o", "cat"]).stdout
    assert "Started HTTPService" in log and "successfully loaded 'tiny'" in log


def test_preflight_names_a_bad_variable(converged: Converged, tmp_path: Path):
    host = converged.host
    assert wait_ready(converged.triton_http), host.exec("journalctl -u tritonserver -n 40 --no-pager").stdout
    before = props(host, "MainPID", "NRestarts", "ActiveEnterTimestampMonotonic")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(converged.extra_vars.read_text()), "llmhost_profile": "tpu"}))
    r = run_playbook(converged.inventory, bad, converged.host.pip_vars_file, "playbooks/serving.yml",
                     "--tags", "preflight")
    assert r.returncode != 0
    assert "llmhost_profile" in r.stdout
    # Nothing was changed: the same server process (not restarted) still serves.
    after = props(host, "MainPID", "NRestarts", "ActiveEnterTimestampMonotonic")
    journal = host.exec("journalctl -u tritonserver -n 60 --no-pager").stdout
    assert after == before, f"{before} -> {after}\n{journal}"
    assert wait_ready(converged.triton_http, timeout_s=120), journal
