"""Prometheus for the tests: promtool, a throwaway Prometheus, recorded expositions
replayed as a TSDB, and the names a PromQL expression or an exposition holds.

Debian's `prometheus` package provides /usr/bin/prometheus and /usr/bin/promtool
(the test setup installs it; see mk/monitoring.mk). Nothing here installs anything.
The dashboards' queries and the HTTP query API are llmhost.bench.promql's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.harness.net import free_port
from tests.harness.paths import ROOT

MONITORING = ROOT / "monitoring"
RULES_DIR = MONITORING / "prometheus" / "rules"
RULE_TESTS_DIR = MONITORING / "prometheus" / "tests"
DASHBOARDS_DIR = MONITORING / "grafana" / "dashboards"
FIXTURES = ROOT / "tests" / "monitoring" / "fixtures"


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


# --- names in PromQL and in expositions ----------------------------------------------------

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
