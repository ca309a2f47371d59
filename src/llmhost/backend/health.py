"""ENABLE_VLLM_HEALTH_CHECK: a model whose engine died unloads itself.

NVIDIA's vllm_backend, with the parameter on, checks its engine before each batch of
requests; once the check fails it answers them UNAVAILABLE with the message below
and asks Triton to unload the model (``pb_utils.unload_model``), so that the model
reads not ready (``/v2/models/<m>/ready``, the repository index) and later requests
get Triton's "unknown model" error. That needs tritonserver's
``--model-control-mode=explicit``.

Ours does the same, and also from the watchdog (watchdog.py), which notices the death
within about a second even without traffic. It replaces the server stop of
``exit_server_on_engine_death`` for this model: the other models keep serving. Where
the unload is refused (tritonserver not in explicit mode), the model falls back to
``exit_server_on_engine_death``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

UNHEALTHY_MESSAGE = "Model is unavailable due to unhealthy vLLM engine"


class SelfUnload:
    """Asks Triton, once, to unload this model after its engine died."""

    def __init__(self, model: str, unload: Callable[[str], None], log: Callable[[str], None],
                 log_error: Callable[[str], None]) -> None:
        self.model = model
        self._unload = unload
        self._log = log
        self._log_error = log_error
        self._lock = threading.Lock()
        self._outcome: bool | None = None

    def __call__(self, cause: str) -> bool:
        """True once Triton took the unload request (now or before); False when it
        refused it (and why, in the log)."""
        with self._lock:
            if self._outcome is None:
                self._outcome = self._request(cause)
            return self._outcome

    def _request(self, cause: str) -> bool:
        try:
            self._unload(self.model)
        except Exception as exc:  # noqa: BLE001 - Triton refuses outside explicit model control
            self._log_error(f"ENABLE_VLLM_HEALTH_CHECK: the engine is unhealthy ({cause}) but unloading model "
                            f"'{self.model}' failed: {exc} (it needs tritonserver's "
                            "--model-control-mode=explicit); falling back to exit_server_on_engine_death")
            return False
        self._log_error(f"ENABLE_VLLM_HEALTH_CHECK: the engine is unhealthy ({cause}); model '{self.model}' "
                        "is being unloaded and reads not ready until it is loaded again")
        return True
