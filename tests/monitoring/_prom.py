"""Helpers for the monitoring tests: promtool, a throwaway Prometheus, dashboard queries.

Debian's `prometheus` package provides /usr/bin/prometheus and /usr/bin/promtool
(the test setup installs it; see mk/monitoring.mk). Nothing here installs anything.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "monitoring"
RULES_DIR = MONITORING / "prometheus" / "rules"
RULE_TESTS_DIR = MONITORING / "prometheus" / "tests"
DASHBOARDS_DIR = MONITORING / "grafana" / "dashboards"
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# Grafana's built-in variables, as a query over the last hour would see them.
GRAFANA_BUILTINS = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
}
# Metric name prefixes that only GPU hosts (Triton's GPU metrics, NVIDIA DCGM) export.
GPU_METRIC = re.compile(r"\b(nv_gpu_\w+|nv_energy_\w+|DCGM_\w+)")


def tool(name: str) -> str:
    """Path of a Prometheus tool; a clear failure when the package is missing."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        raise AssertionError(
            f"{name} not found: install Debian's prometheus package (apt-get install --no-install-recommends "
            "prometheus; `make monitoring-deps` does it)"
        )
    return path


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *map(str, args)], text=True, capture_output=True, cwd=cwd,
                          timeout=120, check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- dashboards --------------------------------------------------------------------------------

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

    def __str__(self) -> str:
        return f"{self.dashboard} #{self.panel_id} {self.title!r} {self.ref_id}: {self.expr}"


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS_DIR.glob("*.json"))}


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' collapsed children included, rows themselves left out."""
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            yield from p.get("panels", [])
        else:
            yield p


def panel_queries() -> list[PanelQuery]:
    out = []
    for name, d in dashboards().items():
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


_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "inf", "nan", "le",
}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (strings, label matchers and grouping removed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()", e):
        word = m.group(1)
        if word.lower() not in _KEYWORDS:
            names.add(word)
    return names


def exposition_names(text: str) -> set[str]:
    """Series names in a Prometheus text exposition."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)", line)
            if m:
                names.add(m.group(1))
    return names


# --- a real Prometheus ---------------------------------------------------------------------------

class Prometheus:
    """/usr/bin/prometheus on 127.0.0.1:<free port> with its own TSDB directory."""

    def __init__(self, workdir: Path, config: str, data_dir: Path | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "prometheus.yml"
        self.config.write_text(config)
        self.data_dir = data_dir or workdir / "data"
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60) -> Prometheus:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [tool("prometheus"), f"--config.file={self.config}", f"--storage.tsdb.path={self.data_dir}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=100y"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"prometheus not ready after {timeout_s}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


# --- recorded expositions as a TSDB ------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")


@dataclass(frozen=True)
class Recording:
    """A recorded /metrics exposition and the target labels it was scraped with."""

    path: Path
    job: str
    instance: str


def openmetrics_from(recordings: list[Recording], end: float, minutes: int = 30, step_s: int = 15) -> str:
    """The recordings replayed as OpenMetrics text for `promtool tsdb create-blocks-from openmetrics`.

    Each series gets a sample every ``step_s`` seconds for ``minutes`` up to ``end``:
    counters (TYPE counter) grow linearly to their recorded value, gauges keep it.
    Every target also gets ``up == 1``.
    """
    series: dict[str, dict[str, float | str]] = {}
    kinds: dict[str, str] = {}
    for rec in recordings:
        for line in rec.path.read_text().splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(maxsplit=3)
                kinds[name] = kind
                continue
            if not line or line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            if m is None:
                raise ValueError(f"{rec.path}: cannot parse {line!r}")
            name, labels, value = m.group(1), m.group(2) or "", m.group(3)
            target = f'job="{rec.job}",instance="{rec.instance}"'
            series.setdefault(name, {})[f"{{{labels + ',' if labels else ''}{target}}}"] = float(value)
            kinds.setdefault(name, "gauge")
        series.setdefault("up", {})[f'{{job="{rec.job}",instance="{rec.instance}"}}'] = 1.0
    n = minutes * 60 // step_s
    start = end - (n - 1) * step_s
    out = []
    for name in sorted(series):
        counter = kinds.get(name) == "counter"
        for labels, value in sorted(series[name].items()):
            v = float(value)
            for i in range(n):
                sample = v * (i + 1) / n if counter else v
                out.append(f"{name}{labels} {sample!r} {start + i * step_s:.0f}")
    out.append("# EOF")
    return "\n".join(out) + "\n"


def tsdb_from(recordings: list[Recording], data_dir: Path, end: float) -> None:
    """Write a Prometheus data directory holding the recordings (see openmetrics_from)."""
    om = data_dir.parent / "recordings.om.txt"
    om.write_text(openmetrics_from(recordings, end))
    data_dir.mkdir(parents=True, exist_ok=True)
    r = promtool("tsdb", "create-blocks-from", "openmetrics", om, data_dir)
    if r.returncode != 0:
        raise AssertionError(f"promtool tsdb create-blocks-from failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
