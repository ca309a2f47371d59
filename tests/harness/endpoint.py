"""Where a Triton endpoint serving our backend is reached: a local `llmhost serve`
(tests/e2e) or the booted host's tritonserver unit (tests/system)."""

from __future__ import annotations

from dataclasses import dataclass

import requests


@dataclass
class Endpoint:
    name: str  # the model
    http: str  # http://HOST:PORT
    grpc: str  # HOST:PORT
    metrics: str  # http://HOST:PORT

    def model_ready(self, timeout_s: float = 3) -> bool:
        """Whether the model's ready endpoint answers 200 now."""
        try:
            return requests.get(f"{self.http}/v2/models/{self.name}/ready", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def metric(self, series: str, **labels: str) -> float:
        """Sum of a series on /metrics for this model (0 when absent)."""
        want = {"model": self.name, **labels}
        total = 0.0
        for line in requests.get(f"{self.metrics}/metrics", timeout=10).text.splitlines():
            if not line.startswith(series + "{"):
                continue
            label_text, value = line[len(series) + 1:].rsplit("} ", 1)
            got = dict(part.split("=", 1) for part in label_text.split(","))
            if all(got.get(k) == f'"{v}"' for k, v in want.items()):
                total += float(value)
        return total
