"""Lay out what tritonserver needs: a backend directory and a model repository.

The same layout the Ansible roles deploy (roles/triton, roles/model_repository),
made here for `llmhost serve` on a developer's machine and for the tests.
"""

from __future__ import annotations

import filecmp
import json
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
STUB = "triton_python_backend_stub"


class LayoutError(RuntimeError):
    pass


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver and its python backend live."""

    server: Path
    python_backend: Path
    stub: Path
    # Libraries the stub and libtriton_python.so load through an $ORIGIN-relative
    # RPATH, which breaks once they are copied: they go on LD_LIBRARY_PATH.
    libs: Path | None = None

    @classmethod
    def from_pytriton(cls, python_version: str | None = None) -> TritonInstall:
        """The tritonserver bundled in the nvidia-pytriton wheel of this interpreter."""
        try:
            import pytriton
        except ImportError:
            raise LayoutError("nvidia-pytriton is not installed in this environment: "
                              "pip install 'llmhost[triton]'") from None
        root = Path(pytriton.__file__).parent / "tritonserver"
        version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
        stubs = root / "python_backend_stubs"
        stub = stubs / version / STUB
        if not stub.is_file():
            have = sorted(p.name for p in stubs.iterdir()) if stubs.is_dir() else []
            raise LayoutError(f"the bundled Triton has no python backend stub for Python {version} "
                              f"(it has: {', '.join(have) or 'none'})")
        return cls(server=root / "bin" / "tritonserver", python_backend=root / "backends" / "python", stub=stub,
                   libs=root.parent.parent / "nvidia_pytriton.libs")


def _copy(src: Path, dst: Path) -> None:
    if dst.exists() and filecmp.cmp(src, dst, shallow=False):
        return
    shutil.copy2(src, dst)


def make_backend_dir(dest: Path, triton: TritonInstall) -> Path:
    """`<dest>/python/` (python backend + stub) and `<dest>/vllm/model.py` (our backend)."""
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    for name in PYTHON_BACKEND_FILES:
        src = triton.python_backend / name
        if not src.is_file():
            raise LayoutError(f"{src} is missing from the Triton install")
        _copy(src, py / name)
    _copy(triton.stub, py / STUB)
    vllm_dir = dest / "vllm"
    vllm_dir.mkdir(parents=True, exist_ok=True)
    shim = resources.files("llmhost.backend").joinpath("shim.py").read_text()
    target = vllm_dir / "model.py"
    if not target.exists() or target.read_text() != shim:
        target.write_text(shim)
    return dest


def _to_nice_json(value: Any, indent: int = 4) -> str:
    return json.dumps(value, indent=indent, sort_keys=True, separators=(",", ": "))


def render(template: str, **context: Any) -> str:
    text = resources.files("llmhost.server").joinpath("templates", template).read_text()
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    # Ansible's filter of that name, so one template renders the same both ways
    # (Jinja's own tojson returns Markup, which Ansible warns about).
    env.filters["to_nice_json"] = _to_nice_json
    return env.from_string(text).render(**context)


def make_model_dir(repo: Path, model: dict[str, Any]) -> Path:
    """`<repo>/<name>/{config.pbtxt, model.json, 1/}` from the package templates."""
    d = repo / model["name"]
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "config.pbtxt").write_text(render("config.pbtxt.j2", model=model))
    (d / "model.json").write_text(render("model.json.j2", model=model))
    return d


def python_libdir() -> str:
    """Where this interpreter's shared libpython lives (the stub links against it)."""
    return str(sysconfig.get_config_var("LIBDIR") or "")
