"""The Grafana dashboards' PromQL queries, and Prometheus's HTTP query API (stdlib only).

Used by lab/gpu_panels_check.py on a GPU host and by the monitoring tests.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Grafana's built-in variables, as a query over the last hour would see them.
GRAFANA_BUILTINS = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
}
# Metric name prefixes that only GPU hosts (Triton's GPU metrics, NVIDIA DCGM) export.
GPU_METRIC = re.compile(r"\b(nv_gpu_\w+|nv_energy_\w+|DCGM_\w+)")
# Metrics that only the followers of a model across hosts export (llmhost follow).
FOLLOWER_METRIC = re.compile(r"\bllmhost_follower_\w+")


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel_id: int
    title: str
    ref_id: str
    expr: str
    instant: bool

    @property
    def gpu(self) -> bool:
        return bool(GPU_METRIC.search(self.expr))

    @property
    def follower(self) -> bool:
        """Whether only a follower host of a model across hosts has data for it."""
        return bool(FOLLOWER_METRIC.search(self.expr))

    def __str__(self) -> str:
        return f"{self.dashboard} #{self.panel_id} {self.title!r} {self.ref_id}: {self.expr}"


def dashboards(directory: Path) -> dict[str, dict[str, Any]]:
    """The dashboards (file name: model) in DIRECTORY."""
    return {p.name: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' collapsed children included, rows themselves left out."""
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            yield from p.get("panels", [])
        else:
            yield p


def panel_queries(directory: Path) -> list[PanelQuery]:
    """Every target of every panel of the dashboards in DIRECTORY."""
    out = []
    for name, d in dashboards(directory).items():
        for p in panels(d):
            for t in p.get("targets", []):
                out.append(PanelQuery(name, int(p["id"]), str(p.get("title", "")), str(t.get("refId", "")),
                                      str(t.get("expr", "")), bool(t.get("instant", False))))
    return out


_VAR = re.compile(r"\$(\w+)|\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]")


def variables_in(expr: str) -> set[str]:
    return {a or b or c for a, b, c in _VAR.findall(expr)}


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Grafana's variable substitution (plain $var, ${var}, ${var:fmt}, [[var]])."""
    allv = {**GRAFANA_BUILTINS, **values}

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in allv:
            raise KeyError(f"no value for ${name}")
        return allv[name]

    return _VAR.sub(repl, expr)


def api(url: str, path: str, params: Mapping[str, str] | None = None, timeout: float = 30) -> tuple[int, Any]:
    """GET <url>/api/v1/<path>: (HTTP status, decoded JSON body)."""
    query = "?" + urllib.parse.urlencode(params) if params else ""
    try:
        with urllib.request.urlopen(f"{url}/api/v1/{path}{query}", timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, {"error": body.decode(errors="replace")}


def query(url: str, expr: str, at: float | None = None) -> tuple[int, Any]:
    params = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    return api(url, "query", params)


def query_range(url: str, expr: str, start: float, end: float, step: str = "15s") -> tuple[int, Any]:
    return api(url, "query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step})


def has_data(body: Any) -> bool:
    """A query result with at least one series (or a scalar)."""
    data = body.get("data", {}) if isinstance(body, dict) else {}
    result = data.get("result")
    if data.get("resultType") == "scalar":
        return result is not None
    return bool(result)
