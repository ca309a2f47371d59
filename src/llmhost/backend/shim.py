# Installed by llmhost as <backend-directory>/vllm/model.py: Triton loads this file
# for every model whose config.pbtxt says backend: "vllm". The code lives in the
# llmhost package of the serving venv (llmhost.backend.model). The stub's embedded
# interpreter is isolated (it ignores PYTHONPATH): it imports the llmhost installed
# in the venv whose python3 comes first on tritonserver's PATH.
from llmhost.backend.model import TritonPythonModel  # noqa: F401
