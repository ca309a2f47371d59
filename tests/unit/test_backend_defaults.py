"""The backend's defaults (default_max_tokens, max_n, drain_timeout_s) have one
source, llmhost.backend.config.BackendSettings; every place that still writes a
value down (the roles' defaults, model.json.j2's fallbacks) must agree with it,
and `llmhost serve` reads it."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from llmhost.backend.config import BackendSettings
from llmhost.cli import build_parser
from llmhost.server.serve import ServeOptions
from tests.harness.paths import ROOT

KEYS = ("default_max_tokens", "max_n", "drain_timeout_s")


def _defaults(role: str) -> dict:
    return yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text())


def test_roles_defaults_are_the_backends() -> None:
    backend, repo, llmhost = BackendSettings(), _defaults("model_repository"), _defaults("llmhost")
    assert repo["model_repository_default_max_tokens"] == backend.default_max_tokens
    assert repo["model_repository_max_n"] == backend.max_n
    assert llmhost["llmhost_drain_timeout_s"] == backend.drain_timeout_s


def test_model_json_template_falls_back_to_the_backends_defaults() -> None:
    text = (ROOT / "src" / "llmhost" / "server" / "templates" / "model.json.j2").read_text()
    fallbacks = {k: float(v) for k, v in re.findall(r"(\w+)=model\.\w+ \| default\(([\d.]+)\)", text)}
    assert fallbacks == {k: float(getattr(BackendSettings(), k)) for k in KEYS}


def test_serve_defaults_are_the_backends(tmp_path: Path) -> None:
    backend = BackendSettings()
    args = build_parser().parse_args(["serve", "--model", str(tmp_path)])
    assert (args.default_max_tokens, args.max_n, args.drain_timeout) == tuple(getattr(backend, k) for k in KEYS)
    opts = ServeOptions(model=tmp_path)
    assert tuple(getattr(opts, k) for k in KEYS) == tuple(getattr(backend, k) for k in KEYS)


def test_the_api_docs_settings_table_states_the_backends_defaults() -> None:
    # docs/api.md restates each default in its model.json table; the source is BackendSettings.
    text = (ROOT / "docs" / "api.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", text, re.MULTILINE))
    backend = BackendSettings()
    for name in ("default_max_tokens", "max_n", "drain_timeout_s", "stream_interval_ms", "response_threads",
                 "tokenizer_threads", "metrics_interval_s"):
        assert float(rows[name]) == float(getattr(backend, name)), name
