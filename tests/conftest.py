"""Shared fixtures: the tiny model (made once per session). Helpers are in tests/harness."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmhost.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)
