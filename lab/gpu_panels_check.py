#!/usr/bin/env python3
"""Run every GPU panel query of the dashboards against a real Prometheus that scrapes
a real tritonserver with GPU metrics (used on a GPU host; stdlib and llmhost only).

Usage: gpu_panels_check.py PROMETHEUS_BINARY TRITON_METRICS_HOST:PORT OUT.json
Starts Prometheus on 127.0.0.1:19990 with a throwaway TSDB, scrapes the target every
2 s as instance "gpu-host", waits for samples, queries each GPU panel (variables
substituted) and writes per-query status and series counts. Exit 1 if any GPU panel
query fails to parse, or one over Triton's nv_gpu_* metrics returns no data.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmhost.bench.promql import panel_queries, query, substitute

PORT = 19990
# The repository's dashboards, beside this script (src/ must be importable too).
DASHBOARDS = Path(__file__).resolve().parents[1] / "monitoring" / "grafana" / "dashboards"


def main() -> int:
    binary, target, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    work = Path(tempfile.mkdtemp(prefix="gpu-panels-"))
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 2s, evaluation_interval: 2s}\n"
        "scrape_configs:\n"
        "  - job_name: triton\n"
        f"    static_configs: [{{targets: ['{target}'], labels: {{instance: gpu-host}}}}]\n"
    )
    prom = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{PORT}"],
                            stdout=(work / "prometheus.log").open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{PORT}"
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            status, body = query(url, "count(nv_gpu_utilization)")
            if status == 200 and body["data"]["result"]:
                break
            time.sleep(2)
        time.sleep(70)  # enough samples for rate()/increase() over Grafana's 1m $__rate_interval
        results, failed = [], []
        for q in panel_queries(DASHBOARDS):
            if not q.gpu:
                continue
            expr = substitute(q.expr, {"instance": "gpu-host", "model": ".*"})
            status, body = query(url, expr)
            series = len(body["data"]["result"]) if status == 200 else 0
            row = {"dashboard": q.dashboard, "panel": q.title, "ref": q.ref_id, "expr": expr,
                   "status": status, "series": series}
            if status == 200 and series:
                row["sample"] = body["data"]["result"][0]
            results.append(row)
            print(f"{status} {series:>2} series  {q.dashboard} {q.title!r} {q.ref_id}")
            if status != 200 or (series == 0 and "nv_" in expr):
                failed.append(row)
        out.write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "results": results, "failed": failed}, indent=2) + "\n")
        print(f"{len(results)} GPU panel queries, {len(failed)} failed")
        return 1 if failed else 0
    finally:
        prom.terminate()
        prom.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
