"""Fixtures for the system tests: a booted systemd host (systemd-nspawn).

Every test under tests/system gets the ``system`` marker. ``booted_host`` never
skips: when the host cannot be booted the tests error with the host tool's output.
"""

from __future__ import annotations

import atexit
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from tests.harness.booted import BootedHost, HostError
from tests.system._converge import Converged, converge

SYSTEM_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SYSTEM_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.system)


def _sigterm_to_interrupt(signum: int, frame: FrameType | None) -> None:
    # pytest tears fixtures down on KeyboardInterrupt; plain SIGTERM would skip that.
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="package")
def booted_host() -> Iterator[BootedHost]:
    """A fresh Debian 12 host booted with systemd, reachable over SSH on 127.0.0.1.

    Attributes: ``name``, ``ssh_port``, ``inventory`` (YAML inventory path),
    ``ssh_key``, ``state_dir``, ``pip_vars_file`` (``-e @file`` with the
    python_env role's pip variables), ``pip_config``; methods ``exec(cmd)``,
    ``ssh(cmd)``, ``ansible_args()``, ``write_inventory(path, groups, group_vars)``.
    Torn down after the last system test (the package's scope), also on failures and
    interrupts: the worker goes on with other tests, which get its CPU and memory.
    """
    previous = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    host: BootedHost | None = None
    try:
        error: str | None = None
        try:
            host = BootedHost.start()
        except HostError as exc:
            error = str(exc)
        if host is None:
            pytest.fail(f"could not boot the systemd test host:\n{error}", pytrace=False)
        atexit.register(host.stop)  # last resort if the finalizer below never runs
        yield host
    finally:
        try:
            if host is not None:
                host.stop()
                atexit.unregister(host.stop)
        finally:
            signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="package")
def converged(booted_host: BootedHost, tmp_path_factory: pytest.TempPathFactory) -> Converged:
    """site.yml converged once into ``booted_host`` (profile cpu, the tiny model, monitoring),
    its gateway routing the tiny model by the engine's KV-cache events."""
    return converge(booted_host, tmp_path_factory.mktemp("converge"),
                    overrides={"gateway_model_routing": {"tiny": "kv_events"}})
