"""GPU placement of the models in the model repository: the one KIND rule, checked before anything starts.

The model_repository role (filter ``llmhost_placement``) and ``llmhost serve`` both
take a model's Triton instance kind and GPUs from ``plan``: KIND_CPU on profile cpu;
on profile gpu KIND_MODEL unless the model asks for KIND_GPU (vLLM places the engine
on the GPUs itself; KIND_GPU makes Triton pin each instance to one GPU).

Per model (the entries of ``llmhost_models``): ``gpus`` (GPU ids), ``instance_count``
(Triton model instances, one vLLM engine each), ``tensor_parallel_size`` and
``gpu_memory_utilization`` (top level, or inside ``engine_args``; not both with
different values). ``plan`` turns them into what ``config.pbtxt`` and ``model.json``
need (``kind``, ``gpus``, ``instance_count``, ``engine_args``) and refuses, naming
the model and the GPU:

* a placement that needs more GPUs than the host has, or names a GPU it lacks;
* tensor_parallel_size > 1 with a kind other than KIND_MODEL (one engine spans
  its GPUs; Triton must not pin the instance to one), or with a ``gpus`` list that
  is not exactly tensor_parallel_size long;
* on profile cpu, a GPU kind or ``gpus``;
* for a model across hosts (``nodes``: two or more), each host holds its share of the
  ranks, tensor_parallel_size x pipeline_parallel_size / len(nodes), in place of
  tensor_parallel_size in the checks above;
* memory shares adding up to more than 1.0 on a GPU: every instance places one
  engine taking ``gpu_memory_utilization`` of each GPU it uses (KIND_GPU: Triton
  makes ``instance_count`` instances on every listed GPU; KIND_MODEL: each of the
  ``instance_count`` engines spans all listed GPUs), summed over all models.

``gpus`` given in the inventory are written into the model (config.pbtxt's ``gpus``
under KIND_GPU, model.json's ``visible_gpus`` under KIND_MODEL); without them the
engine sees the server's GPUs, and the shares are counted on the GPUs it will use
(KIND_MODEL: the first tensor_parallel_size; KIND_GPU: every GPU, as Triton places
an instance group without ``gpus`` on each). ``gpu_count`` None (not known, e.g. no
NVIDIA GPU visible yet) leaves out the checks against the host's GPUs.

Standard library only; runs as a script too (``python3 placement.py --gpu-count 2 models.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KIND_CPU = "KIND_CPU"
KIND_GPU = "KIND_GPU"
KIND_MODEL = "KIND_MODEL"
KINDS = (KIND_CPU, KIND_GPU, KIND_MODEL)
# vLLM's own default for gpu_memory_utilization (EngineArgs).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
_EPS = 1e-9


class PlacementError(ValueError):
    """One or more placements are impossible; ``problems`` lists each, naming model and GPU."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("GPU placement refused:\n  - " + "\n  - ".join(self.problems))


@dataclass(frozen=True)
class Placement:
    name: str
    kind: str
    gpus: tuple[int, ...]
    instance_count: int
    tensor_parallel_size: int
    gpu_memory_utilization: float | None
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    # gpus came from the model's own ``gpus`` (the inventory), not from the defaults.
    pinned: bool = False

    @property
    def cuda_visible_devices(self) -> str | None:
        """For KIND_MODEL: the GPUs the engine must see (CUDA_VISIBLE_DEVICES). KIND_GPU
        instances get their device from Triton (model_instance_device_id)."""
        return ",".join(str(g) for g in self.gpus) if self.kind == KIND_MODEL and self.pinned else None

    def memory_shares(self) -> dict[int, float]:
        """Share of each GPU's memory this model's engines take, over all its instances."""
        if self.kind == KIND_CPU or self.gpu_memory_utilization is None:
            return {}
        return {g: self.instance_count * self.gpu_memory_utilization for g in self.gpus}

    def template_vars(self) -> dict[str, Any]:
        """The keys config.pbtxt.j2 / model.json.j2 read from ``model`` (``gpus`` only when pinned)."""
        out: dict[str, Any] = {"kind": self.kind, "instance_count": self.instance_count,
                               "engine_args": dict(self.engine_args)}
        if self.pinned:
            out["gpus"] = list(self.gpus)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.template_vars(), "gpus": list(self.gpus), "pinned": self.pinned,
                "tensor_parallel_size": self.tensor_parallel_size,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "cuda_visible_devices": self.cuda_visible_devices}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _setting(model: Mapping[str, Any], engine_args: Mapping[str, Any], key: str, problems: list[str],
             name: str) -> Any:
    top, inner = model.get(key), engine_args.get(key)
    if top is not None and inner is not None and top != inner:
        problems.append(f"model {name}: {key} is {top!r} but engine_args.{key} is {inner!r}; set one")
    return top if top is not None else inner


def plan(models: Sequence[Mapping[str, Any]], gpu_count: int | None, profile: str = "gpu",
         engine_args: Mapping[str, Any] | None = None) -> list[Placement]:
    """Placements of the present models on a host with ``gpu_count`` GPUs (None: not known);
    ``engine_args``: the profile's, under each model's own. Raises PlacementError."""
    if profile not in ("gpu", "cpu"):
        raise ValueError(f"profile must be gpu or cpu, got {profile!r}")
    if gpu_count is not None and (not _is_int(gpu_count) or gpu_count < 0):
        raise ValueError(f"gpu_count must be an integer >= 0 or None, got {gpu_count!r}")
    problems: list[str] = []
    out: list[Placement] = []
    for pos, model in enumerate(models):
        if model.get("state", "present") == "absent":
            continue
        name = str(model.get("name") or f"llmhost_models[{pos}]")
        if engine_args and isinstance(model.get("engine_args") or {}, Mapping):
            model = {**model, "engine_args": {**engine_args, **(model.get("engine_args") or {})}}
        p = _place(model, name, gpu_count, profile, problems)
        if p is not None:
            out.append(p)
    if profile == "gpu":
        problems += _overcommit(out)
    if problems:
        raise PlacementError(problems)
    return out


def _place(model: Mapping[str, Any], name: str, gpu_count: int | None, profile: str,
           problems: list[str]) -> Placement | None:
    before = len(problems)
    given_args = model.get("engine_args") or {}
    if not isinstance(given_args, Mapping):
        problems.append(f"model {name}: engine_args must be a dict, got {given_args!r}")
        given_args = {}
    engine_args = dict(given_args)
    count = model.get("instance_count", 1)
    if not _is_int(count) or count < 1:
        problems.append(f"model {name}: instance_count must be an integer >= 1, got {count!r}")
        count = 1
    tp = _setting(model, engine_args, "tensor_parallel_size", problems, name)
    tp = 1 if tp is None else tp
    if not _is_int(tp) or tp < 1:
        problems.append(f"model {name}: tensor_parallel_size must be an integer >= 1, got {tp!r}")
        tp = 1
    # A model across hosts (its ``nodes``): each host runs its share of the
    # tensor_parallel_size x pipeline_parallel_size ranks, and holds that many GPUs.
    local, across = tp, ""
    nodes, pp = model.get("nodes") or (), engine_args.get("pipeline_parallel_size", 1)
    if isinstance(nodes, list | tuple) and len(nodes) > 1 and _is_int(pp) and pp >= 1:
        local, across = max(1, tp * pp // len(nodes)), f" on each of its {len(nodes)} hosts"
    util = _setting(model, engine_args, "gpu_memory_utilization", problems, name)
    if util is not None and (isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1):
        problems.append(f"model {name}: gpu_memory_utilization must be a number in (0, 1], got {util!r}")
        util = None
    kind = model.get("kind")
    if kind is not None and kind not in KINDS:
        problems.append(f"model {name}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        kind = None
    gpus_given = model.get("gpus")
    gpus: list[int] = []
    if gpus_given is not None:
        if (not isinstance(gpus_given, list | tuple) or not all(_is_int(g) and g >= 0 for g in gpus_given)
                or len(set(gpus_given)) != len(gpus_given)):
            problems.append(f"model {name}: gpus must be a list of distinct GPU ids >= 0, got {gpus_given!r}")
            gpus_given = None
        else:
            gpus = list(gpus_given)

    if profile == "cpu":
        if kind not in (None, KIND_CPU):
            problems.append(f"model {name}: kind {kind} needs llmhost_profile gpu (this host's profile is cpu)")
        if gpus:
            problems.append(f"model {name}: gpus {gpus} given, but llmhost_profile is cpu")
        if len(problems) > before:
            return None
        return Placement(name, KIND_CPU, (), count, tp, None, engine_args)

    if gpu_count == 0:
        problems.append(f"model {name}: llmhost_profile is gpu but the host has no GPU")
        return None
    known = gpu_count is not None
    if kind == KIND_CPU:
        problems.append(f"model {name}: kind KIND_CPU on a GPU host (llmhost_profile gpu installs vLLM for CUDA); "
                        "use KIND_GPU or KIND_MODEL, or profile cpu")
    if known and local > gpu_count:
        problems.append(f"model {name}: tensor_parallel_size {tp} needs {local} GPUs{across}, the host has "
                        f"{gpu_count}")
    missing = [g for g in gpus if known and g >= gpu_count]
    if missing:
        problems.append(f"model {name}: gpus {gpus} names GPU {', '.join(map(str, missing))}, but the host has "
                        f"{gpu_count} GPU{'s' if gpu_count != 1 else ''} (ids 0-{gpu_count - 1})")
    if kind is None:
        kind = KIND_MODEL
    if local > 1 and kind != KIND_MODEL:
        problems.append(f"model {name}: tensor_parallel_size {tp} needs kind KIND_MODEL (one vLLM engine spans "
                        f"{local} GPUs{across}; Triton must not pin the instance to one GPU), got {kind}")
    pinned = bool(gpus)
    if not pinned:
        # What the engine will use: its first tensor_parallel_size GPUs (KIND_MODEL), or an
        # instance on every GPU (KIND_GPU without gpus; unknown count: not counted).
        gpus = list(range(local)) if kind == KIND_MODEL else list(range(gpu_count or 0))
    elif kind == KIND_MODEL and len(gpus) != local:
        problems.append(f"model {name}: tensor_parallel_size {tp} needs exactly {local} GPU{'s' if local != 1 else ''}"
                        f"{across} in gpus, got {gpus}")
    if len(problems) > before:
        return None
    util = DEFAULT_GPU_MEMORY_UTILIZATION if util is None else float(util)
    engine_args.update(tensor_parallel_size=tp, gpu_memory_utilization=util)
    return Placement(name, kind, tuple(gpus), count, tp, util, engine_args, pinned)


def shares_by_gpu(placements: Sequence[Placement]) -> dict[int, list[tuple[str, float]]]:
    """GPU id -> [(model, share)] over all placements, GPUs in order."""
    by_gpu: dict[int, list[tuple[str, float]]] = {}
    for p in placements:
        for g, share in p.memory_shares().items():
            by_gpu.setdefault(g, []).append((p.name, share))
    return dict(sorted(by_gpu.items()))


def _overcommit(placements: Sequence[Placement]) -> list[str]:
    problems = []
    by_name = {p.name: p for p in placements}
    for g, parts in shares_by_gpu(placements).items():
        total = sum(s for _, s in parts)
        if total > 1.0 + _EPS:
            detail = ", ".join(
                f"{n}: {by_name[n].instance_count} x {by_name[n].gpu_memory_utilization:g}"
                if by_name[n].instance_count > 1 else f"{n}: {s:g}"
                for n, s in parts
            )
            problems.append(f"GPU {g}: gpu_memory_utilization adds up to {total:.2f} > 1.0 ({detail}); "
                            f"lower gpu_memory_utilization or instance_count, or move a model to another GPU")
    return problems


# -- command line ------------------------------------------------------------------------


def build_parser(prog: str = "llmhost placement") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Check the models' GPU placement and print what "
                                "config.pbtxt and model.json get, as JSON. Exit 0 valid, 1 refused.")
    p.add_argument("models", nargs="?", type=Path, help="JSON list of models (llmhost_models); default: stdin")
    p.add_argument("--models-json", metavar="JSON", help="the list itself, as a JSON string")
    p.add_argument("--gpu-count", type=int, help="GPUs on the host (default: not known, checks against it left out)")
    p.add_argument("--profile", choices=("gpu", "cpu"), default="gpu")
    return p


def main_placement(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    try:
        if args.models_json is not None:
            text = args.models_json
        elif args.models is not None:
            text = args.models.read_text()
        else:
            text = sys.stdin.read()
        models = json.loads(text)
        if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
            raise ValueError("expected a JSON list of model objects")
        placements = plan(models, args.gpu_count, args.profile)
    except PlacementError as exc:
        print(json.dumps({"ok": False, "problems": exc.problems}, indent=2))
        return 1
    except (OSError, ValueError) as exc:
        print(f"llmhost placement: {exc}", file=sys.stderr)
        return 2
    report = {
        "ok": True,
        "models": {p.name: p.to_dict() for p in placements},
        "gpus": {str(g): round(sum(s for _, s in parts), 6) for g, parts in shares_by_gpu(placements).items()},
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main_placement(sys.argv[1:]))
