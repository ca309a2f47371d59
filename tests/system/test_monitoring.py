"""Monitoring on a booted host: site.yml (serving + monitoring) converges, Prometheus
scrapes every target, the smoke timer's metrics arrive, and every dashboard query
returns data from the real Prometheus in the host (GPU panels: valid and empty).

The host shares this machine's network, so Prometheus, Triton and node_exporter
are reached on 127.0.0.1 at the free ports chosen here.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
import requests

from llmhost.bench.promql import api, dashboards, has_data, panel_queries, query, substitute
from tests.harness.prom import DASHBOARDS_DIR
from tests.system._converge import Converged, recap, run_playbook

MODEL = "tiny"
GRAFANA_STAGING = "/var/lib/llmhost-monitoring/grafana"


@pytest.fixture
def monitored(converged: Converged) -> Converged:
    return converged


def wait_for(what: str, check, timeout_s: float = 90, interval_s: float = 2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        ok, last = check()
        if ok:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {last}")


def targets(m: Converged) -> list[dict]:  # type: ignore[type-arg]
    status, body = api(m.prometheus, "targets")
    assert status == 200, body
    return list(body["data"]["activeTargets"])


def test_converge_installed_monitoring(monitored: Converged):
    out = monitored.first_converge.stdout
    assert "Host metrics and the smoke probe on the inference hosts" in out, "site.yml does not run monitoring.yml"
    host = monitored.host
    for unit in ("prometheus", "prometheus-node-exporter", f"llmhost-smoke@{MODEL}.timer"):
        r = host.exec(["systemctl", "is-active", unit])
        assert r.stdout.strip() == "active", f"{unit}: {r.stdout}{r.stderr}"
        r = host.exec(["systemctl", "is-enabled", unit])
        assert r.stdout.strip() == "enabled", f"{unit}: {r.stdout}{r.stderr}"
    r = host.exec("systemctl list-timers --all --no-legend 'llmhost-smoke@*'")
    assert f"llmhost-smoke@{MODEL}.timer" in r.stdout


def test_every_target_is_up(monitored: Converged):
    def check():  # type: ignore[no-untyped-def]
        ts = targets(monitored)
        return bool(ts) and all(t["health"] == "up" for t in ts), [
            (t["labels"]["job"], t["labels"]["instance"], t["health"], t.get("lastError")) for t in ts]

    seen = wait_for("every target up", check)
    assert {job for job, *_ in seen} == {"prometheus", "triton", "gateway", "node"}
    assert {inst for _, inst, *_ in seen} == {monitored.host.name}


def test_rules_are_loaded_and_nothing_fires(monitored: Converged):
    status, body = api(monitored.prometheus, "rules")
    assert status == 200
    names = {r["name"] for g in body["data"]["groups"] for r in g["rules"]}
    assert {"LLMHostTargetDown", "LLMHostSmokeProbeFailing", "LLMHostDiskFillingUp"} <= names
    # The fault tests before this module stop the server on purpose, and the smoke probe
    # that ran then keeps its failure until the timer's next run: probe the host as it is
    # now, then nothing may fire once Prometheus has read the probe's result.
    r = monitored.host.exec(["systemctl", "start", f"llmhost-smoke@{MODEL}.service"], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    def none_firing():  # type: ignore[no-untyped-def]
        status, body = api(monitored.prometheus, "alerts")
        assert status == 200, body
        firing = [a for a in body["data"]["alerts"] if a["state"] == "firing"]
        return not firing, firing

    wait_for("no alert firing", none_firing, timeout_s=180, interval_s=5)


def _gateway_traffic(m: Converged) -> None:
    """Through the gateway: a completion, a stream (time to first token), and a request
    over the limited key's 1 request per minute (429)."""
    assert m.gateway_key_file is not None
    base = f"http://127.0.0.1:{m.ports['gateway']}/v1/completions"
    body = {"model": MODEL, "prompt": "import os", "max_tokens": 8}
    auth = {"Authorization": f"Bearer {m.gateway_key_file.read_text().strip()}"}
    assert requests.post(base, json=body, headers=auth, timeout=120).status_code == 200
    with requests.post(base, json={**body, "stream": True}, headers=auth, timeout=120, stream=True) as r:
        assert r.status_code == 200 and b"[DONE]" in r.content
    limited = {"Authorization": f"Bearer {m.gateway_limited_key}"}
    statuses = [requests.post(base, json=body, headers=limited, timeout=120).status_code for _ in range(2)]
    assert statuses == [200, 429], statuses


def _traffic(m: Converged) -> None:
    """The smoke probe (as the timer runs it), one invalid request, one cancelled stream
    and the gateway's traffic."""
    _gateway_traffic(m)
    r = m.host.exec(["systemctl", "start", f"llmhost-smoke@{MODEL}.service"], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = urllib.request.Request(f"{m.triton_http}/v2/models/{MODEL}/generate", method="POST",
                                 data=json.dumps({"text_input": "hi", "max_tokens": -1}).encode())
    try:
        urllib.request.urlopen(bad, timeout=30).read()
    except OSError:
        pass  # answered with an error status: that is the point
    stream = urllib.request.Request(
        f"{m.triton_http}/v2/models/{MODEL}/generate_stream", method="POST",
        data=json.dumps({"text_input": "def f(x):", "max_tokens": 400, "ignore_eos": True,
                         "stream": True}).encode())
    with urllib.request.urlopen(stream, timeout=30) as resp:
        resp.readline()  # first event, then hang up
    for i in range(4):
        ok = urllib.request.Request(f"{m.triton_http}/v2/models/{MODEL}/generate", method="POST",
                                    data=json.dumps({"text_input": f"import os {i}", "max_tokens": 24}).encode())
        urllib.request.urlopen(ok, timeout=60).read()


def test_smoke_metrics_reach_prometheus(monitored: Converged):
    _traffic(monitored)
    sel = f'instance="{monitored.host.name}", model="{MODEL}"'

    def check():  # type: ignore[no-untyped-def]
        status, body = query(monitored.prometheus, f"llmhost_smoke_success{{{sel}}}")
        values = [float(s["value"][1]) for s in body["data"]["result"]] if status == 200 else []
        return values == [1.0], body

    wait_for("llmhost_smoke_success == 1", check)
    _, body = query(monitored.prometheus, f"llmhost_smoke_check_success{{{sel}}}")
    checks = {s["metric"]["check"]: float(s["value"][1]) for s in body["data"]["result"]}
    assert len(checks) == 7 and set(checks.values()) == {1.0}, checks
    _, body = query(monitored.prometheus, f"time() - llmhost_smoke_last_run_timestamp_seconds{{{sel}}}")
    assert 0 <= float(body["data"]["result"][0]["value"][1]) < 600
    _, body = query(monitored.prometheus, f"llmhost_smoke_duration_seconds{{{sel}}}")
    assert float(body["data"]["result"][0]["value"][1]) > 0


def test_every_dashboard_query_returns_data(monitored: Converged):
    """After the traffic above: every panel has data but the GPU panels and the followers'
    (a model across hosts: none on this host), which parse and are empty."""
    values = {"instance": monitored.host.name, "model": MODEL}
    queries = panel_queries(DASHBOARDS_DIR)
    assert len(queries) > 40

    def check():  # type: ignore[no-untyped-def]
        missing = []
        for q in queries:
            status, body = query(monitored.prometheus, substitute(q.expr, values))
            if status != 200:
                raise AssertionError(f"{q}: HTTP {status} {body}")
            if q.gpu:
                assert not has_data(body), f"{q}: GPU data on a CPU host? {body}"
            elif q.follower:
                assert not has_data(body), f"{q}: follower data on a host that follows no model? {body}"
            elif not has_data(body):
                missing.append(str(q))
        return not missing, missing

    wait_for("data in every non-GPU panel", check, timeout_s=120, interval_s=5)


def test_dashboard_variables_list_the_host_and_model(monitored: Converged):
    for name, d in dashboards(DASHBOARDS_DIR).items():
        for v in d["templating"]["list"]:
            if v["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["query"])
            assert m, v["query"]
            status, body = api(monitored.prometheus, f"label/{m.group(2)}/values",
                               {"match[]": substitute(m.group(1), {"instance": monitored.host.name})})
            assert status == 200, body
            want = monitored.host.name if v["name"] == "instance" else MODEL
            assert body["data"] == [want], (name, v["name"], body)


def test_grafana_files_are_staged(monitored: Converged):
    host = monitored.host
    for path in sorted(DASHBOARDS_DIR.glob("*.json")):
        r = host.exec(["cat", f"{GRAFANA_STAGING}/dashboards/{path.name}"])
        assert r.returncode == 0 and json.loads(r.stdout) == json.loads(path.read_text()), path.name
    r = host.exec(["cat", f"{GRAFANA_STAGING}/provisioning/datasources/llmhost.yml"])
    assert f"url: \"{monitored.prometheus}\"" in r.stdout, r.stdout
    r = host.exec(["cat", f"{GRAFANA_STAGING}/provisioning/dashboards/llmhost.yml"])
    assert f"path: \"{GRAFANA_STAGING}/dashboards\"" in r.stdout, r.stdout


def test_second_converge_changes_nothing(monitored: Converged):
    r = run_playbook(monitored.inventory, monitored.extra_vars, monitored.host.pip_vars_file,
                     "playbooks/monitoring.yml")
    assert r.returncode == 0, r.stdout[-6000:]
    counts = recap(r.stdout)
    assert counts["changed"] == 0 and counts["failed"] == 0, r.stdout[-6000:]


def test_a_failing_probe_reaches_the_alert_rule(monitored: Converged):
    """A probe of a model the host does not serve fails: its metrics arrive and the alert goes pending."""
    host = monitored.host
    try:
        r = host.exec(["systemctl", "start", "llmhost-smoke@no-such-model.service"], timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr  # exit 1 (a check failed) is a success for the unit
        sel = f'instance="{host.name}", model="no-such-model"'

        def check():  # type: ignore[no-untyped-def]
            _, body = query(monitored.prometheus, f"llmhost_smoke_success{{{sel}}}")
            result = body["data"]["result"]
            return bool(result) and float(result[0]["value"][1]) == 0.0, body

        wait_for("llmhost_smoke_success == 0 for no-such-model", check)

        def pending():  # type: ignore[no-untyped-def]
            _, body = api(monitored.prometheus, "alerts")
            alerts = [a for a in body["data"]["alerts"] if a["labels"]["alertname"] == "LLMHostSmokeProbeFailing"]
            return any(a["labels"].get("model") == "no-such-model" for a in alerts), alerts

        alerts = wait_for("LLMHostSmokeProbeFailing pending", pending, timeout_s=60)
        assert all(a["labels"]["model"] == "no-such-model" for a in alerts)
    finally:
        host.exec("systemctl stop 'llmhost-smoke@no-such-model.service'; "
                  "rm -f /var/lib/prometheus/node-exporter/llmhost_smoke_no-such-model.prom")
