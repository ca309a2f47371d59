"""Filters that run this checkout's llmhost code, so the roles and the commands cannot disagree.

The modules are standard library only and are loaded by file from src/llmhost/ (this
directory sits next to src/); Ansible's controller need not have llmhost installed.

llmhost_cuda_match: the CUDA build of vLLM/PyTorch for a host, chosen by llmhost.cuda
(the code of ``llmhost gpu-info``); the python_env role uses it.

    {{ matrix | llmhost_cuda_match(vllm='0.32.0', smi=nvidia_smi_stdout) }}
    {{ matrix | llmhost_cuda_match(vllm='0.32.0', cuda_version='13.0') }}

``matrix`` is src/llmhost/data/cuda_matrix.json as data (``lookup('file', ...) | from_json``).
The result is ``llmhost.cuda.match_report``'s report: ``status`` is ``match`` (with
``match``: tag, cuda, min_driver, packages, torch_index_url, vllm_index_url, ...),
``no_driver``, ``driver_too_old`` or ``error``, and ``error`` says why.
With ``lock`` (a hash-locked requirements file's text or pin lines) the choice is the lock's one build:
its CUDA version (``lock_cuda`` in the report, from its torch pins) is the only variant, so
``match`` means the driver runs the lock; a lock without a CUDA torch is an ``error``.

    {{ matrix | llmhost_cuda_match(vllm='0.32.0', smi=nvidia_smi_stdout, lock=lock_pins) }}

llmhost_placement: the models' Triton instance kind and GPUs, by llmhost.server.placement (the
rule of ``llmhost placement`` and ``llmhost serve``); the model_repository role uses it.

    {{ models | llmhost_placement(gpu_count=2, profile='gpu', engine_args={...}) }}

``models`` are llmhost_models entries; ``gpu_count`` the host's GPUs (None or "": not
known, the checks against the host are left out); ``engine_args`` the profile's, counted
under each model's own. It never raises: ``ok``, ``problems`` (each naming the model and
the GPU) and ``models``, name -> kind, gpus (those the engine uses), pinned (gpus came
from the inventory: written into config.pbtxt/model.json), instance_count,
tensor_parallel_size, gpu_memory_utilization.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "llmhost"


def _load(name):
    """src/llmhost/NAME.py (NAME may hold a subpackage: "server/placement") as a module of
    its own (once per controller process)."""
    key = f"_llmhost_{name.replace('/', '_')}_for_ansible"
    module = sys.modules.get(key)
    if module is None:
        spec = importlib.util.spec_from_file_location(key, PACKAGE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # dataclasses look their module up while it loads
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return module


def llmhost_cuda_match(matrix, vllm=None, smi=None, cuda_version=None, minor_compat=False, lock=None):
    """``smi``: plain nvidia-smi output; ``cuda_version`` instead: the driver's CUDA version, as given;
    ``lock``: the hash-locked requirements file that will be installed, as its text or its pin lines."""
    cuda = _load("cuda")
    if lock and not isinstance(lock, str):
        lock = "\n".join(lock)

    def get_info():
        return cuda.given_info(str(cuda_version)) if cuda_version else cuda.smi_text_info(smi or "")

    lock_cuda = cuda.lock_cuda(lock) if lock else None
    try:
        parsed = cuda.parse_matrix(matrix)
        if lock and not lock_cuda:
            return {"vllm": vllm, "detected": None, "match": None, "status": "error", "lock_cuda": None,
                    "error": "the lock pins no CUDA build of torch (torch==VERSION+cuXYZ, or torch with "
                             "cuda-toolkit / nvidia-cuda-runtime pins)"}
        if lock_cuda:
            parsed = cuda.for_build(parsed, lock_cuda, vllm or None)
        _, report = cuda.match_report(get_info, parsed, vllm or None, minor_compat=bool(minor_compat))
    except cuda.MatrixError as exc:
        return {"vllm": vllm, "detected": None, "match": None, "status": "error", "error": str(exc),
                "lock_cuda": lock_cuda}
    report["lock_cuda"] = lock_cuda
    return report


def llmhost_placement(models, gpu_count=None, profile="gpu", engine_args=None):
    placement = _load("server/placement")
    count = None if gpu_count in (None, "") else int(gpu_count)
    try:
        placed = placement.plan(list(models or []), count, str(profile), dict(engine_args or {}))
    except placement.PlacementError as exc:
        return {"ok": False, "problems": exc.problems, "models": {}}
    except ValueError as exc:
        return {"ok": False, "problems": [str(exc)], "models": {}}
    return {"ok": True, "problems": [], "models": {p.name: p.to_dict() for p in placed}}


class FilterModule:
    def filters(self):
        return {"llmhost_cuda_match": llmhost_cuda_match, "llmhost_placement": llmhost_placement}
