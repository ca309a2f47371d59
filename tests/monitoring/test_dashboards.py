"""Grafana dashboards: generated from code, valid Grafana dashboard models, and every
query parses and returns data in a real Prometheus over the recorded expositions."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmhost.bench.promql import (
    GRAFANA_BUILTINS,
    PanelQuery,
    api,
    dashboards,
    has_data,
    panel_queries,
    panels,
    query,
    substitute,
    variables_in,
)
from tests.harness.prom import DASHBOARDS_DIR, FIXTURES, MONITORING, RULES_DIR, exposition_names, metric_names
from tests.monitoring.conftest import CPU_HOST, FOLLOWER_HOST, GPU_HOST, Replay

# Every panel is fed by a fixture (dcgm-exporter's is constructed, see its header).
NOT_RECORDED: set[str] = set()
QUERIES = panel_queries(DASHBOARDS_DIR)
ALL = {"instance": ".*", "model": ".*"}


def test_three_dashboards_with_distinct_uids():
    ds = dashboards(DASHBOARDS_DIR)
    assert set(ds) == {"llmhost-serving.json", "llmhost-triton.json", "llmhost-host.json"}
    uids = [d["uid"] for d in ds.values()]
    assert len(set(uids)) == len(uids)


def test_committed_json_is_what_the_builder_writes(tmp_path: Path):
    # The builder is a script (monitoring/ is no package): run it, writing into tmp_path.
    subprocess.run([sys.executable, str(MONITORING / "grafana" / "build_dashboards.py"), "--out", str(tmp_path)],
                   check=True, timeout=300)
    rendered = {p.name: p.read_text() for p in tmp_path.glob("*.json")}
    assert set(rendered) == set(dashboards(DASHBOARDS_DIR))
    for name, text in rendered.items():
        assert (DASHBOARDS_DIR / name).read_text() == text, (
            f"{name} is out of date: run .venv/bin/python monitoring/grafana/build_dashboards.py")


@pytest.mark.parametrize("name", sorted(dashboards(DASHBOARDS_DIR)))
def test_dashboard_is_a_lossless_grafana_dashboard_model(name: str):
    """grafana-foundation-sdk parses the JSON into its typed model (enums checked, unknown
    keys dropped); writing the model back must give the same JSON."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    data = json.loads((DASHBOARDS_DIR / name).read_text())
    again = json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder))
    assert again == data


def test_the_model_check_catches_a_misspelt_field():
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    data = json.loads((DASHBOARDS_DIR / "llmhost-serving.json").read_text())
    data["panels"][1]["gridpos"] = data["panels"][1].pop("gridPos")
    assert json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder)) != data


@pytest.mark.parametrize("name", sorted(dashboards(DASHBOARDS_DIR)))
def test_panels_are_complete(name: str):
    d = dashboards(DASHBOARDS_DIR)[name]
    ids = [p["id"] for p in d["panels"]] + [c["id"] for p in d["panels"] for c in p.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
    body = list(panels(d))
    assert body
    for p in body:
        where = f"{name}: {p['title']}"
        assert p["title"] and p.get("description"), where
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert p["targets"], where
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(refs), where
        for t in p["targets"]:
            assert t["expr"].strip(), where
            assert t["datasource"] == p["datasource"], where
        defaults = p["fieldConfig"]["defaults"]
        assert defaults.get("unit"), f"{where}: no unit"
        steps = defaults.get("thresholds", {}).get("steps", [])
        assert steps and steps[0]["value"] is None, f"{where}: thresholds must start at -Infinity"
        values = [s["value"] for s in steps[1:]]
        assert values == sorted(values), f"{where}: thresholds out of order"


@pytest.mark.parametrize("name", sorted(dashboards(DASHBOARDS_DIR)))
def test_variables(name: str):
    d = dashboards(DASHBOARDS_DIR)[name]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["type"] == "query" and variables["instance"]["includeAll"]
    if name != "llmhost-host.json":
        assert variables["model"]["type"] == "query"
        assert "$instance" in variables["model"]["query"]
    for q in (q for q in QUERIES if q.dashboard == name):
        unknown = variables_in(q.expr) - set(variables) - set(GRAFANA_BUILTINS)
        assert not unknown, f"{q}: undefined variables {unknown}"
        assert "$instance" in q.expr, f"{q}: does not follow the host variable"


def test_queries_select_metrics_our_exporters_export():
    known: set[str] = set()
    for f in FIXTURES.iterdir():
        known |= exposition_names(f.read_text())
    for q in QUERIES:
        unknown = metric_names(q.expr) - known - NOT_RECORDED
        assert not unknown, f"{q}: selects {unknown}, which no recording in {FIXTURES} has"


def test_serving_dashboard_covers_the_issue():
    titles = {p["title"] for p in panels(dashboards(DASHBOARDS_DIR)["llmhost-serving.json"])}
    for want in ("Requests/s by finish reason", "Failed requests/s by reason", "End-to-end latency",
                 "Time to first token", "Inter-token latency", "Tokens/s", "Prompt length", "Generation length",
                 "Running and waiting requests", "KV-cache use", "Finish reasons", "Cancelled requests/s"):
        assert want in titles
    exprs = " ".join(q.expr for q in QUERIES if q.dashboard == "llmhost-serving.json")
    for quantile in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (model, le) (rate(vllm:e2e_request_latency" in exprs


@pytest.mark.parametrize("q", QUERIES, ids=str)
def test_query_returns_data_from_recorded_series(replay: Replay, q: PanelQuery):
    status, body = query(replay.url, substitute(q.expr, ALL), at=replay.at)
    assert status == 200, f"{q}\n{body}"
    if not metric_names(q.expr) & NOT_RECORDED:
        assert has_data(body), f"{q}: no data\n{body}"


@pytest.mark.parametrize("q", [q for q in QUERIES if q.gpu], ids=str)
def test_gpu_panels_are_empty_but_valid_on_a_cpu_host(replay: Replay, q: PanelQuery):
    status, body = query(replay.url, substitute(q.expr, {"instance": CPU_HOST, "model": ".*"}), at=replay.at)
    assert status == 200 and not has_data(body), f"{q}\n{body}"


def test_gpu_panels_show_the_gpu_host(replay: Replay):
    for q in (q for q in QUERIES if q.gpu and not metric_names(q.expr) & NOT_RECORDED):
        status, body = query(replay.url, substitute(q.expr, {"instance": GPU_HOST, "model": ".*"}), at=replay.at)
        assert status == 200 and has_data(body), f"{q}\n{body}"


def test_a_parse_error_and_an_empty_query_are_caught(replay: Replay):
    status, body = query(replay.url, "sum(rate(vllm:generation_tokens_total[5m])", at=replay.at)
    assert status == 400 and body["errorType"] == "bad_data"
    status, body = query(replay.url, 'vllm:generation_tokens_total{model="no-such-model"}', at=replay.at)
    assert status == 200 and not has_data(body)


def _label_values(replay: Replay, definition: str, values: dict[str, str]) -> set[str]:
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", definition)
    assert m, definition
    status, body = api(replay.url, f"label/{m.group(2)}/values",
                       {"match[]": substitute(m.group(1), values), "start": str(replay.at - 3600),
                        "end": str(replay.at)})
    assert status == 200, body
    return set(body["data"])


def test_variable_queries_list_hosts_and_models(replay: Replay):
    for name, d in dashboards(DASHBOARDS_DIR).items():
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert _label_values(replay, variables["instance"]["query"], ALL) == {CPU_HOST, GPU_HOST, FOLLOWER_HOST}, name
        if "model" in variables:
            models = _label_values(replay, variables["model"]["query"], {"instance": CPU_HOST})
            assert models == {"tiny"}, name


def _row(d: dict, title: str) -> list[dict]:
    """The panels under the (expanded) row TITLE."""
    out: list[dict] | None = None
    for p in d["panels"]:
        if p["type"] == "row":
            if out is not None:
                break
            if p["title"] == title:
                out = list(p.get("panels", []))
        elif out is not None:
            out.append(p)
    assert out, f"no row {title!r} with panels"
    return out


def test_serving_dashboard_shows_models_across_hosts(replay: Replay):
    """The "Models across hosts" row: per model and follower host, joined and the age of its last check,
    over the metrics `llmhost follow --textfile` writes and the llmhost-multinode alerts use."""
    row = {p["title"]: p for p in _row(dashboards(DASHBOARDS_DIR)["llmhost-serving.json"], "Models across hosts")}
    assert set(row) == {"Followers joined", "Since each follower's last check"}
    # These panels, and only these, are empty on a host that follows no model (PanelQuery.follower).
    assert {q.title for q in QUERIES if q.follower} == set(row)
    for p in row.values():
        assert "head host serves the model in Triton" in p["description"], p["title"]
    joined = row["Followers joined"]
    assert joined["type"] == "state-timeline"
    assert {m["options"]["1"]["text"] for m in joined["fieldConfig"]["defaults"]["mappings"]} == {"joined"}
    assert row["Since each follower's last check"]["fieldConfig"]["defaults"]["unit"] == "s"

    follower = exposition_names((FIXTURES / "follower-textfile.prom").read_text())
    multinode = next(g for g in yaml.safe_load((RULES_DIR / "llmhost.yml").read_text())["groups"]
                     if g["name"] == "llmhost-multinode")
    alerted = set().union(*(metric_names(r["expr"]) for r in multinode["rules"]))
    exprs = {title: p["targets"][0]["expr"] for title, p in row.items()}
    assert set().union(*map(metric_names, exprs.values())) == follower == alerted

    at_follower = {"instance": FOLLOWER_HOST, "model": ".*"}
    status, body = query(replay.url, substitute(exprs["Followers joined"], at_follower), at=replay.at)
    assert status == 200, body
    assert [(s["metric"], s["value"][1]) for s in body["data"]["result"]] == [
        ({"instance": FOLLOWER_HOST, "model": "big"}, "1")]
    status, body = query(replay.url, substitute(exprs["Since each follower's last check"], at_follower),
                         at=replay.at)
    assert status == 200, body
    [series] = body["data"]["result"]
    checked = float(re.search(r"^llmhost_follower_last_check_timestamp_seconds\{.*\} (\S+)$",
                              (FIXTURES / "follower-textfile.prom").read_text(), re.M).group(1))
    assert series["metric"] == {"instance": FOLLOWER_HOST, "model": "big"}
    assert float(series["value"][1]) == pytest.approx(replay.at - checked, abs=1)
    for expr in exprs.values():  # the head and other hosts have no follower rows
        status, body = query(replay.url, substitute(expr, {"instance": CPU_HOST, "model": ".*"}), at=replay.at)
        assert status == 200 and not has_data(body), f"{expr}\n{body}"
