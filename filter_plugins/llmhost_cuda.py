"""Filter llmhost_cuda_match: the CUDA build of vLLM/PyTorch for a host, chosen by llmhost.cuda.

The python_env role matches a host with the very code of ``llmhost gpu-info``:
src/llmhost/cuda.py of this checkout (standard library only; this directory sits
next to src/) is loaded from here, so the role and the command cannot disagree.

    {{ matrix | llmhost_cuda_match(vllm='0.32.0', smi=nvidia_smi_stdout) }}
    {{ matrix | llmhost_cuda_match(vllm='0.32.0', cuda_version='13.0') }}

``matrix`` is src/llmhost/data/cuda_matrix.json as data (``lookup('file', ...) | from_json``).
The result is ``llmhost.cuda.match_report``'s report: ``status`` is ``match`` (with
``match``: tag, cuda, min_driver, packages, torch_index_url, vllm_index_url, ...),
``no_driver``, ``driver_too_old`` or ``error``, and ``error`` says why.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

CUDA_PY = Path(__file__).resolve().parents[1] / "src" / "llmhost" / "cuda.py"
_MODULE = "_llmhost_cuda_for_ansible"


def _cuda():
    module = sys.modules.get(_MODULE)
    if module is None:
        spec = importlib.util.spec_from_file_location(_MODULE, CUDA_PY)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_MODULE] = module  # dataclasses look their module up while it loads
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_MODULE]
            raise
    return module


def llmhost_cuda_match(matrix, vllm=None, smi=None, cuda_version=None, minor_compat=False):
    """``smi``: plain nvidia-smi output; ``cuda_version`` instead: the driver's CUDA version, as given."""
    cuda = _cuda()

    def get_info():
        return cuda.given_info(str(cuda_version)) if cuda_version else cuda.smi_text_info(smi or "")

    try:
        _, report = cuda.match_report(get_info, cuda.parse_matrix(matrix), vllm or None,
                                      minor_compat=bool(minor_compat))
    except cuda.MatrixError as exc:
        return {"vllm": vllm, "detected": None, "match": None, "status": "error", "error": str(exc)}
    return report


class FilterModule:
    def filters(self):
        return {"llmhost_cuda_match": llmhost_cuda_match}
