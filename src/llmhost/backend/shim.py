# Installed by llmhost as <backend-directory>/vllm/model.py: Triton loads this file
# for every model whose config.pbtxt says backend: "vllm". The code lives in the
# llmhost package of the serving venv (llmhost.backend.model).
# The stub's embedded interpreter is isolated: it ignores PYTHONPATH. Where the
# server's environment sets one (a checkout under test, say), its entries go first
# here too, so the stub runs the same llmhost as `llmhost serve`.
import os
import sys

for _entry in reversed([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
    if _entry not in sys.path:
        sys.path.insert(0, _entry)

from llmhost.backend.model import TritonPythonModel  # noqa: E402, F401
