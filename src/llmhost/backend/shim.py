# Installed by llmhost as <backend-directory>/vllm/model.py: Triton loads this file
# for every model whose config.pbtxt says backend: "vllm". The code lives in the
# llmhost package of the serving venv (llmhost.backend.model). The stub's embedded
# interpreter is isolated (it ignores PYTHONPATH): it imports the llmhost installed
# in the venv whose python3 comes first on tritonserver's PATH. Its path starts with
# tritonserver's working directory: a folder there named like a package (a `triton`
# folder beside `llmhost serve`'s, say) would shadow the real one for vLLM, so the
# working directory is taken off the path first.
import os
import sys

sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]

from llmhost.backend.model import TritonPythonModel  # noqa: E402, F401 (after the path is cleaned)
