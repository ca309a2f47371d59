"""The packages a gateway-only host gets (python_env_gateway_packages) are the releases
the tests run the gateway with: the serving venv's, where vLLM brings them. The test
venv is resolved from the index, so patch releases may move: major.minor must match."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_gateway_only_pins_match_the_tested_versions() -> None:
    defaults = yaml.safe_load((ROOT / "roles" / "python_env" / "defaults" / "main.yml").read_text())
    pins = dict(p.split("==", 1) for p in defaults["python_env_gateway_packages"])
    # uvicorn parses HTTP with httptools when it is installed, as on inference hosts.
    assert {"starlette", "uvicorn", "httptools", "pydantic"} <= set(pins)
    for name, pinned in pins.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            raise AssertionError(f"{name} is pinned for gateway-only hosts but not in the test venv") from None
        assert installed.split(".")[:2] == pinned.split(".")[:2], (
            f"{name}: gateway-only hosts get {pinned}, the tests run {installed}")
