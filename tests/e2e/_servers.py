"""The e2e servers that several modules share (tests/e2e/conftest.py starts them):
their flags, kept here so that a module's own starts and its assertions use the same
values, and the explicit-model-control server that a test may stop."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import repository as repo
from tests.harness.server import Server, start_server, wait_gone

# vLLM's LoRA engine arguments: two adapters of rank 8 at a time.
LORA_ARGS = ["--engine-arg", "enable_lora=true", "--engine-arg", "max_lora_rank=8", "--engine-arg", "max_loras=2"]
# A prompt byte limit far above the default one (derived from max_model_len 512).
BIG_PROMPT_LIMIT = 24_000_000
# The model's stream window of the tuned server, in milliseconds (the most allowed).
MODEL_STREAM_INTERVAL_MS = 1000


def stop_leaving_nothing(srv: Server) -> None:
    """SIGTERM the server; no process of it may be left."""
    kids = srv.descendants()
    srv.stop()
    left = wait_gone(kids)
    assert not left, f"processes left after SIGTERM: {[p.pid for p in left]}"


@dataclass
class ExplicitServer:
    """A server under explicit model control, and the /dev/shm segments there were before it started."""

    server: Server
    shm_before: set[str]


class ExplicitServers:
    """The explicit-model-control server that tests/e2e/test_metrics_contract.py and
    test_model_control.py share: started on the first ``get``, and started again on a
    ``get`` after a test stopped it (test_model_control.py's last test does)."""

    def __init__(self, model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.model = model
        self.tmp_path_factory = tmp_path_factory
        self.current: ExplicitServer | None = None

    def get(self) -> ExplicitServer:
        if self.current is None or self.current.server.proc.poll() is not None:
            shm_before = repo.shm_segments()
            # fresh_metrics: vllm_backend's read-after-response freshness is opt-in (off by
            # default: the per-request pushes cost the H100 path 1.13-1.38x, docs/performance-history.md).
            srv = start_server(self.model, self.tmp_path_factory.mktemp("explicit-serve"),
                               extra=[*repo.explicit_args(), "--setting", "fresh_metrics=true"])
            self.current = ExplicitServer(srv, shm_before)
        return self.current

    def stop(self) -> None:
        """Stop the server unless a test already did."""
        if self.current is not None and self.current.server.proc.poll() is None:
            stop_leaving_nothing(self.current.server)
