from __future__ import annotations

import json
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.e2e._servers import (
    BIG_PROMPT_LIMIT,
    LORA_ARGS,
    MODEL_STREAM_INTERVAL_MS,
    ExplicitServers,
    stop_leaving_nothing,
)
from tests.harness.server import Server, start_server, wait_gone
from tests.harness.vllm_server import ENGINE_ARGS, VllmServer, vllm_server


# Package scope: the server stops once the e2e tests are done, so it does not hold
# memory and CPU through the system tests that follow (several hosts, each with
# its own tritonserver and vLLM, on two cores).
@pytest.fixture(scope="package")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Two response threads, so every e2e test also covers streams spread over
    # several I/O threads (the default is one); fresh_metrics, so tests that read
    # /metrics right after a response (vllm_backend's contract) find it counted.
    # The default (periodic pushes only) is what the system tests deploy.
    # pin_frontend_cpus (opt-in), so tests/e2e/test_cpus.py sees the threads moved.
    # tool_parser hermes (the tiny model's template's format) for tests/e2e/test_tools.py.
    srv = start_server(tiny_model, tmp_path_factory.mktemp("serve"),
                       extra=["--setting", "response_threads=2", "--setting", "fresh_metrics=true",
                              "--setting", "pin_frontend_cpus=true", "--setting", "tool_parser=hermes"])
    yield srv
    kids = srv.descendants()
    srv.stop()
    left = wait_gone(kids)
    assert not left, f"processes left after SIGTERM: {[p.pid for p in left]}"


# vLLM's own server on the tiny model as the e2e server serves it (the same name, engine
# arguments and tool parser): what tests/e2e/test_openai_parity.py and test_tools.py
# compare the gateway with. One start for both: each takes a minute or more here.
@pytest.fixture(scope="package")
def vllm_tiny(tiny_model: Path, server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    with vllm_server(tiny_model, tmp_path_factory.mktemp("vllm-serve"), server.name,
                     [*ENGINE_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) as vllm:
        yield vllm


@pytest.fixture(scope="package")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from llmhost.tiny.lora import write_tiny_lora

    root = tmp_path_factory.mktemp("adapters")
    return {"alpha": write_tiny_lora(root / "alpha", seed=1), "beta": write_tiny_lora(root / "beta", seed=2)}


# One server for three modules whose flags do not touch what the others check (each
# start costs minutes here): LoRA with the adapters of multi_lora.json (test_lora.py),
# a model stream window (test_vllm_backend_outputs.py: only streams are grouped, and
# test_lora.py joins a stream's texts whatever their grouping), and a raised prompt
# byte limit with two tokenizer threads (test_prompt_isolation.py: plain requests,
# refused or answered before the engine).
@pytest.fixture(scope="package")
def tuned_server(tiny_model: Path, lora_adapters: dict[str, Path],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("serve-tuned")
    multi = workdir / "multi_lora.json"
    multi.write_text(json.dumps({name: str(path) for name, path in lora_adapters.items()}))
    srv = start_server(tiny_model, workdir,
                       extra=[*LORA_ARGS, "--multi-lora", str(multi),
                              "--setting", f"stream_interval_ms={MODEL_STREAM_INTERVAL_MS}",
                              "--setting", f"max_prompt_bytes={BIG_PROMPT_LIMIT}", "--setting", "tokenizer_threads=2"])
    yield srv
    stop_leaving_nothing(srv)


@pytest.fixture(scope="package")
def explicit_servers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExplicitServers]:
    servers = ExplicitServers(tiny_model, tmp_path_factory)
    yield servers
    servers.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/e2e/" in str(item.path):
            item.add_marker(pytest.mark.e2e)


SERVER_LOG_LINES = 40


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that used a server gets the end of that server's log in its report:
    a server that died or restarted under it says so there (CI keeps no other trace)."""
    report = yield
    if report.failed and call.when == "call":
        for name, value in getattr(item, "funcargs", {}).items():
            if isinstance(value, Server):
                alive = "running" if value.proc.poll() is None else f"exited with {value.proc.returncode}"
                report.sections.append((f"{name} ({alive}): the last {SERVER_LOG_LINES} lines of {value.log}",
                                        value.log_tail(SERVER_LOG_LINES)))
    return report
