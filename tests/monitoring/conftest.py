"""Fixtures for the monitoring tests: a real Prometheus over the recorded expositions."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.harness.prom import FIXTURES, Prometheus, Recording, tsdb_from

CPU_HOST = "cpu-host"
GPU_HOST = "gpu-host"
# A follower host of a model across hosts: node_exporter with `llmhost follow --textfile`'s file, no Triton.
FOLLOWER_HOST = "follower-host"
RECORDINGS = [
    Recording(FIXTURES / "triton-cpu-metrics.txt", "triton", CPU_HOST),
    Recording(FIXTURES / "node-exporter-metrics.txt", "node", CPU_HOST),
    Recording(FIXTURES / "triton-gpu-metrics.txt", "triton", GPU_HOST),
    # Constructed (no DCGM could run on the device machine): see the file's header.
    Recording(FIXTURES / "dcgm-exporter-metrics.txt", "dcgm", GPU_HOST),
    # Constructed (the gateway's metrics endpoint was being written): see the file's header.
    Recording(FIXTURES / "gateway-metrics.txt", "gateway", CPU_HOST),
    # Recorded: scraped by node_exporter's textfile collector, so job node (see the file's header).
    Recording(FIXTURES / "follower-textfile.prom", "node", FOLLOWER_HOST),
]


@dataclass(frozen=True)
class Replay:
    """A Prometheus serving the recordings; query it at ``at``."""

    url: str
    at: float


@pytest.fixture(scope="package")  # stopped once the monitoring tests are done
def replay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replay]:
    work = tmp_path_factory.mktemp("prometheus-replay")
    # Whole hours in the past: the samples land in completed blocks.
    end = float((int(time.time()) // 3600 - 2) * 3600)
    tsdb_from(RECORDINGS, work / "data", end)
    with Prometheus(work, "global:\n  scrape_interval: 15s\n", work / "data") as prom:
        yield Replay(prom.url, end)
