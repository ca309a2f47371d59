"""Alert rules: promtool checks them, runs their unit tests, and replays recorded series."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.prom import (
    FIXTURES,
    RULE_TESTS_DIR,
    RULES_DIR,
    exposition_names,
    metric_names,
    promtool,
)

RULE_FILES = sorted(RULES_DIR.glob("*.yml"))
TEST_FILES = sorted(RULE_TESTS_DIR.glob("*.yml"))
# Series no fixture has: Prometheus' own `up` (dcgm-exporter's fixture is constructed).
NOT_RECORDED = {"up"}


def alerts() -> dict[str, dict[str, Any]]:
    out = {}
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    out[rule["alert"]] = rule
    return out


def recorded_names() -> set[str]:
    names: set[str] = set()
    for f in FIXTURES.iterdir():
        names |= exposition_names(f.read_text())
    return names


def test_rule_files_exist():
    assert RULE_FILES and TEST_FILES


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(path: Path):
    r = promtool("check", "rules", path)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_promtool_test_rules(path: Path):
    r = promtool("test", "rules", path.name, cwd=path.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_a_firing_and_a_quiet_case():
    fires: set[str] = set()
    quiet: set[str] = set()
    for path in TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                (fires if t.get("exp_alerts") else quiet).add(t["alertname"])
    names = set(alerts())
    assert names - fires == set(), "alerts without a test where they fire"
    assert names - quiet == set(), "alerts without a test where they stay quiet"
    assert {"LLMHostTargetDown", "LLMHostSmokeProbeFailing", "LLMHostErrorRatioHigh", "LLMHostTTFTHigh",
            "LLMHostQueueGrowing", "LLMHostKVCacheNearFull", "LLMHostGPUMemoryNearFull",
            "LLMHostDiskFillingUp"} <= names


def test_alerts_carry_severity_and_text():
    for name, rule in alerts().items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name


def test_rules_use_metrics_our_exporters_export():
    known = recorded_names() | NOT_RECORDED
    for name, rule in alerts().items():
        unknown = metric_names(rule["expr"]) - known
        assert not unknown, f"{name} selects {unknown}, which no recording in {FIXTURES} has"


def test_a_broken_rule_fails_its_unit_test(tmp_path: Path):
    """The unit tests can fail: the smoke alert that never fires is caught."""
    rules = (RULES_DIR / "llmhost.yml").read_text()
    broken = rules.replace("expr: llmhost_smoke_success == 0", "expr: llmhost_smoke_success == 42")
    assert broken != rules
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "llmhost.yml").write_text(broken)
    (tmp_path / "tests").mkdir()
    test = tmp_path / "tests" / "llmhost_test.yml"
    test.write_text((RULE_TESTS_DIR / "llmhost_test.yml").read_text())
    r = promtool("test", "rules", test.name, cwd=test.parent)
    assert r.returncode != 0
    assert "LLMHostSmokeProbeFailing" in r.stdout + r.stderr


def _replay_test(tmp_path: Path, overrides: dict[str, str], expect: dict[str, list[dict[str, str]]]) -> str:
    """A promtool rule test whose input is the recorded CPU host under steady traffic."""
    series = []
    for rec, job in (("triton-cpu-metrics.txt", "triton"), ("node-exporter-metrics.txt", "node")):
        kinds: dict[str, str] = {}
        for line in (FIXTURES / rec).read_text().splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(maxsplit=3)
                kinds[name] = kind
                continue
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)$", line)
            if not m or line.startswith("#"):
                continue
            name, labels, value = m.group(1), (m.group(2) or "{}")[1:-1], float(m.group(3))
            labels = ",".join(x for x in (labels, f'job="{job}",instance="h1"') if x)
            key = f"{name}{{{labels}}}"
            values = overrides.get(name) or (
                f"0+{value!r}x60" if kinds.get(name) == "counter" else f"{value!r}x60")
            if name == "llmhost_smoke_last_run_timestamp_seconds":
                values = "0+60x60"  # the timer keeps running
            series.append({"series": key, "values": values})
        series.append({"series": f'up{{job="{job}",instance="h1"}}', "values": "1x60"})
    test = {
        "rule_files": [str(RULES_DIR / "llmhost.yml")],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [{"eval_time": "59m", "alertname": a, "exp_alerts": exp}
                                for a, exp in expect.items()],
        }],
    }
    path = tmp_path / "replay_test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    r = promtool("test", "rules", path.name, cwd=tmp_path)
    return f"rc={r.returncode}\n{r.stdout}\n{r.stderr}"


def test_recorded_healthy_host_raises_no_alert(tmp_path: Path):
    """Real series from our server (every counter growing at its recorded rate) stay quiet."""
    out = _replay_test(tmp_path, {}, {name: [] for name in alerts()})
    assert out.startswith("rc=0"), out


def test_recorded_host_with_failing_smoke_probe_alerts(tmp_path: Path):
    out = _replay_test(tmp_path, {"llmhost_smoke_success": "0x60"}, {
        "LLMHostSmokeProbeFailing": [{
            "exp_labels": {"severity": "critical", "component": "smoke", "job": "node", "instance": "h1",
                           "model": "tiny"},
            "exp_annotations": {
                "summary": "Smoke probe fails for model tiny on h1",
                "description": "`llmhost smoke` reported a failing check for tiny on h1 for 5 minutes (failing "
                               "checks: llmhost_smoke_check_success == 0). Run it by hand: systemctl start "
                               "llmhost-smoke@tiny; journalctl -u llmhost-smoke@tiny.",
            },
        }],
        "LLMHostTargetDown": [],
    })
    assert out.startswith("rc=0"), out
