"""NVIDIA driver detection and the CUDA build of PyTorch/vLLM that matches it.

Reads the driver version and the highest CUDA version the driver supports from
``nvidia-smi`` (its header, ``-q`` or ``--query-gpu`` CSV) and, when the
``pynvml`` module (nvidia-ml-py) is importable, from NVML; lists the GPUs; and
picks, from ``data/cuda_matrix.json``, the newest CUDA variant of the pinned vLLM
release that the driver can run (``choose``).

Standard library only, so it also runs as a plain script on a host that has no
venv yet (the Ansible roles copy it there)::

    python3 cuda.py --matrix-json "$(cat cuda_matrix.json)"

``main_gpu_info`` prints one JSON object and exits 0 (a match), 3 (no NVIDIA GPU
or no working driver) or 4 (the driver is too old for every variant).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

EXIT_MATCH = 0
EXIT_USAGE = 2
EXIT_NO_DRIVER = 3
EXIT_DRIVER_TOO_OLD = 4

DEFAULT_MATRIX = Path(__file__).resolve().parent / "data" / "cuda_matrix.json"
QUERY_FIELDS = ("index", "name", "uuid", "pci.bus_id", "memory.total", "compute_cap", "driver_version")
SMI_TIMEOUT_S = 60.0

_HEADER = re.compile(
    r"NVIDIA-SMI\s+(?P<smi>[0-9][0-9.]*)\s+Driver Version:\s*(?P<driver>[0-9][0-9.]*)"
    r"\s+CUDA Version:\s*(?P<cuda>[0-9]+\.[0-9]+|N/A)"
)
_Q_FIELD = re.compile(r"^(?P<indent>\s*)(?P<key>[^:]+?)\s*:\s*(?P<value>.*?)\s*$")
# A GPU row of the plain `nvidia-smi` table (driver >= 450 layout):
# |   0  NVIDIA H100 80GB HBM3          On  |   00000000:00:06.0 Off |                    0 |
_TABLE_GPU = re.compile(
    r"^\|\s+(?P<index>\d+)\s+(?P<name>.+?)\s+(?:On|Off)\s+\|\s+(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d)\s"
)
_TABLE_MEM = re.compile(r"(?P<used>\d+)MiB\s*/\s*(?P<total>\d+)MiB")
_NO_DRIVER_HINTS = (
    "couldn't communicate with the nvidia driver",
    "no devices were found",
    "driver/library version mismatch",
    "failed to initialize nvml",
    "nvml library not found",
    "unable to determine the device handle",
)


class CudaError(Exception):
    """Base of the errors this module raises."""


class NoDriverError(CudaError):
    """No NVIDIA GPU, or no working NVIDIA driver (nvidia-smi missing or failing)."""


class DriverTooOldError(CudaError):
    """No CUDA variant of the pinned vLLM runs on this driver; the message names the minimum driver."""

    def __init__(self, message: str, min_driver: str) -> None:
        super().__init__(message)
        self.min_driver = min_driver


class MatrixError(CudaError):
    """The matrix file is missing, malformed, or lacks the requested vLLM release."""


# -- versions --------------------------------------------------------------------------


def version_tuple(text: str) -> tuple[int, ...]:
    """``"580.159.04"`` -> ``(580, 159, 4)``; raises ValueError on anything else."""
    parts = text.strip().split(".")
    if not text.strip() or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a dotted numeric version: {text!r}")
    return tuple(int(p) for p in parts)


def _ge(a: str, b: str) -> bool:
    ta, tb = version_tuple(a), version_tuple(b)
    width = max(len(ta), len(tb))
    return ta + (0,) * (width - len(ta)) >= tb + (0,) * (width - len(tb))


def cuda_version_from_int(value: int) -> str:
    """NVML/cudaDriverGetVersion encoding: 13000 -> ``"13.0"``, 12020 -> ``"12.2"``."""
    if value <= 0:
        raise ValueError(f"not a CUDA driver version: {value}")
    return f"{value // 1000}.{(value % 1000) // 10}"


# -- what we detect --------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    index: int | None
    name: str
    uuid: str | None = None
    pci_bus_id: str | None = None
    memory_total_mib: int | None = None
    compute_capability: str | None = None


@dataclass(frozen=True)
class DriverInfo:
    driver_version: str
    cuda_version: str | None
    gpus: tuple[Gpu, ...] = ()
    source: str = "nvidia-smi"
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpus"] = [asdict(g) for g in self.gpus]
        d["notes"] = list(self.notes)
        return d


def failure_reason(text: str) -> str | None:
    """The reason nvidia-smi output says the driver does not work, or None."""
    low = text.lower()
    for hint in _NO_DRIVER_HINTS:
        if hint in low:
            line = next((ln.strip() for ln in text.splitlines() if hint in ln.lower()), hint)
            return line
    return None


def parse_smi_header(text: str) -> tuple[str, str | None]:
    """Driver version and CUDA version from the header of plain ``nvidia-smi`` output."""
    m = _HEADER.search(text)
    if m is None:
        reason = failure_reason(text)
        raise NoDriverError(reason or "nvidia-smi printed no 'Driver Version ... CUDA Version' header")
    cuda = m.group("cuda")
    return m.group("driver"), None if cuda == "N/A" else cuda


def parse_smi_table_gpus(text: str) -> list[Gpu]:
    """GPUs (index, name, bus id, total memory) from the table of plain ``nvidia-smi``.

    Long names are cut by nvidia-smi to the column width; ``--query-gpu`` has the full ones.
    """
    gpus: list[Gpu] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _TABLE_GPU.match(line)
        if not m:
            continue
        mem = _TABLE_MEM.search(lines[i + 1]) if i + 1 < len(lines) else None
        gpus.append(Gpu(
            index=int(m.group("index")),
            name=m.group("name").strip(),
            pci_bus_id=m.group("bus"),
            memory_total_mib=int(mem.group("total")) if mem else None,
        ))
    return gpus


def parse_smi_q(text: str) -> DriverInfo:
    """``nvidia-smi -q``: driver, CUDA version and per-GPU name, UUID, bus id, memory."""
    driver = cuda = None
    gpus: list[dict[str, Any]] = []
    section: list[tuple[int, str]] = []  # (indent, title) of the nested blocks we are in
    for raw in text.splitlines():
        if not raw.strip() or raw.startswith("="):
            continue
        indent = len(raw) - len(raw.lstrip())
        if raw.startswith("GPU "):
            gpus.append({"pci_bus_id": raw.split(None, 1)[1].strip()})
            section = []
            continue
        m = _Q_FIELD.match(raw)
        if m is None or not m.group("value"):
            title = raw.strip().rstrip(":").strip()
            section = [(i, t) for i, t in section if i < indent] + [(indent, title)]
            continue
        section = [(i, t) for i, t in section if i < indent]
        key, value = m.group("key").strip(), m.group("value").strip()
        where = section[-1][1] if section else ""
        if key == "Driver Version" and driver is None:
            driver = value
        elif key == "CUDA Version" and cuda is None:
            cuda = None if value == "N/A" else value
        elif gpus and not section and key == "Product Name":
            gpus[-1]["name"] = value
        elif gpus and not section and key == "GPU UUID":
            gpus[-1]["uuid"] = value
        elif gpus and not section and key == "Minor Number" and value.isdigit():
            gpus[-1]["minor"] = int(value)
        elif gpus and where == "FB Memory Usage" and key == "Total":
            gpus[-1]["memory_total_mib"] = _mib(value)
    if driver is None:
        raise NoDriverError(failure_reason(text) or "nvidia-smi -q printed no 'Driver Version'")
    result = [
        Gpu(index=i, name=g.get("name", ""), uuid=g.get("uuid"), pci_bus_id=g.get("pci_bus_id"),
            memory_total_mib=g.get("memory_total_mib"))
        for i, g in enumerate(gpus)
    ]
    return DriverInfo(driver_version=driver, cuda_version=cuda, gpus=tuple(result), source="nvidia-smi -q")


def _mib(value: str) -> int | None:
    m = re.match(r"\s*(\d+)(?:\s*MiB)?\s*$", value)
    return int(m.group(1)) if m else None


def _clean(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    return None if value in ("", "N/A", "[N/A]", "[Not Supported]") else value


def parse_query_csv(text: str, fields: Sequence[str] | None = None) -> list[dict[str, str | None]]:
    """Rows of ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]`` as dicts.

    With a header line the field names come from it (units such as ``[MiB]`` dropped);
    with ``noheader`` pass ``fields``.
    """
    reason = failure_reason(text)
    if reason:
        raise NoDriverError(reason)
    rows = [r for r in csv.reader(io.StringIO(text), skipinitialspace=True) if r and any(c.strip() for c in r)]
    if not rows:
        return []
    first = [c.strip() for c in rows[0]]
    if fields is None or first[0].split(" [")[0] == fields[0]:
        names = [c.split(" [")[0].strip() for c in first]
        rows = rows[1:]
    else:
        names = list(fields)
    out = []
    for r in rows:
        if len(r) != len(names):
            raise ValueError(f"nvidia-smi CSV row has {len(r)} columns, expected {len(names)}: {r}")
        out.append({n: _clean(v) for n, v in zip(names, r, strict=True)})
    return out


def gpus_from_query(rows: Sequence[Mapping[str, str | None]]) -> list[Gpu]:
    gpus = []
    for pos, row in enumerate(rows):
        index = row.get("index")
        mem = row.get("memory.total")
        gpus.append(Gpu(
            index=int(index) if index and index.isdigit() else pos,
            name=row.get("name") or "",
            uuid=row.get("uuid"),
            pci_bus_id=row.get("pci.bus_id"),
            memory_total_mib=_mib(mem) if mem else None,
            compute_capability=row.get("compute_cap"),
        ))
    return gpus


# -- running the tools -------------------------------------------------------------------

Runner = Callable[[list[str]], "tuple[int, str]"]


def run_command(argv: list[str]) -> tuple[int, str]:
    """Run ARGV; return (exit status, stdout + stderr). A missing program is status 127."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False)
    except FileNotFoundError:
        return 127, f"{argv[0]}: command not found"
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]} did not answer within {SMI_TIMEOUT_S:.0f}s"
    return proc.returncode, proc.stdout + proc.stderr


def detect_smi(nvidia_smi: str = "nvidia-smi", runner: Runner = run_command) -> DriverInfo:
    """Driver, CUDA version and GPUs from nvidia-smi; raises NoDriverError naming why not."""
    base = shlex.split(nvidia_smi)
    rc, out = runner(base)
    if rc != 0:
        last = out.strip().splitlines()[-1] if out.strip() else f"{base[0]} exited {rc}"
        raise NoDriverError(failure_reason(out) or last)
    driver, cuda = parse_smi_header(out)
    notes: list[str] = []
    fields = list(QUERY_FIELDS)
    rc, csv_out = runner([*base, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    if rc != 0 and "compute_cap" in csv_out:
        # Drivers before 510 do not know the compute_cap field.
        fields.remove("compute_cap")
        notes.append("this nvidia-smi has no compute_cap query field (driver < 510)")
        rc, csv_out = runner([*base, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    if rc == 0:
        gpus = gpus_from_query(parse_query_csv(csv_out, fields))
    else:
        notes.append(f"nvidia-smi --query-gpu failed ({csv_out.strip()[:200]}); GPUs from the table instead")
        gpus = parse_smi_table_gpus(out)
    if not gpus:
        raise NoDriverError("nvidia-smi works but lists no GPU")
    return DriverInfo(driver_version=driver, cuda_version=cuda, gpus=tuple(gpus), source="nvidia-smi",
                      notes=tuple(notes))


def detect_nvml(nvml: Any = None) -> DriverInfo:
    """The same from NVML through the ``pynvml`` module (nvidia-ml-py); NoDriverError when unusable."""
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[import-not-found,no-redef]
        except ImportError as exc:
            raise NoDriverError(f"pynvml is not importable ({exc})") from None
    try:
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError has no stable import path across versions
        raise NoDriverError(f"NVML: {exc}") from None
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        cuda = cuda_version_from_int(int(nvml.nvmlSystemGetCudaDriverVersion_v2()))
        gpus = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
            pci = nvml.nvmlDeviceGetPciInfo(h)
            bus = getattr(pci, "busIdLegacy", None) or getattr(pci, "busId", None)
            gpus.append(Gpu(
                index=i,
                name=_text(nvml.nvmlDeviceGetName(h)),
                uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                pci_bus_id=_text(bus) if bus else None,
                memory_total_mib=int(nvml.nvmlDeviceGetMemoryInfo(h).total) // (1024 * 1024),
                compute_capability=f"{major}.{minor}",
            ))
    finally:
        nvml.nvmlShutdown()
    if not gpus:
        raise NoDriverError("NVML works but lists no GPU")
    return DriverInfo(driver_version=driver, cuda_version=cuda, gpus=tuple(gpus), source="nvml")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def detect(nvidia_smi: str = "nvidia-smi", use_nvml: bool = True, runner: Runner = run_command,
           nvml: Any = None) -> DriverInfo:
    """nvidia-smi first; NVML (when importable) fills compute capabilities or stands in for it."""
    try:
        info = detect_smi(nvidia_smi, runner)
    except NoDriverError as smi_error:
        if not use_nvml:
            raise
        try:
            return detect_nvml(nvml)
        except NoDriverError as nvml_error:
            raise NoDriverError(f"{smi_error}; {nvml_error}") from None
    if not use_nvml or all(g.compute_capability for g in info.gpus):
        return info
    try:
        by_nvml = detect_nvml(nvml)
    except NoDriverError:
        return info
    caps = {g.uuid: g.compute_capability for g in by_nvml.gpus}
    gpus = tuple(
        Gpu(g.index, g.name, g.uuid, g.pci_bus_id, g.memory_total_mib, g.compute_capability or caps.get(g.uuid))
        for g in info.gpus
    )
    return DriverInfo(info.driver_version, info.cuda_version, gpus, "nvidia-smi+nvml", info.notes)


def detect_from_dir(path: Path) -> DriverInfo:
    """Detection from recorded tool output: ``nvidia-smi.txt`` and optionally ``query.csv``
    (``--format=csv`` with header) and ``nvidia-smi-q.txt``. For tests and offline review."""
    smi = path / "nvidia-smi.txt"
    if not smi.is_file():
        raise NoDriverError(f"{smi}: nvidia-smi: command not found")
    text = smi.read_text()
    driver, cuda = parse_smi_header(text)
    gpus: list[Gpu] = []
    query = path / "query.csv"
    if query.is_file():
        gpus = gpus_from_query(parse_query_csv(query.read_text()))
    q = path / "nvidia-smi-q.txt"
    if q.is_file():
        by_q = {g.pci_bus_id: g for g in parse_smi_q(q.read_text()).gpus}
        if gpus:
            gpus = [Gpu(g.index, g.name, g.uuid or by_q.get(g.pci_bus_id, g).uuid, g.pci_bus_id,
                        g.memory_total_mib, g.compute_capability) for g in gpus]
        else:
            gpus = list(by_q.values())
    if not gpus:
        gpus = parse_smi_table_gpus(text)
    if not gpus:
        raise NoDriverError(f"{smi}: no GPU listed")
    return DriverInfo(driver_version=driver, cuda_version=cuda, gpus=tuple(gpus), source=f"recorded:{path.name}")


# -- the matrix and the choice ---------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    tag: str
    cuda: str
    min_driver: str
    minor_compat_min_driver: str
    torch_index_url: str | None
    vllm_index_url: str | None
    packages: tuple[str, ...]


@dataclass(frozen=True)
class Release:
    vllm: str
    torch: str
    variants: tuple[Variant, ...]  # newest CUDA first


@dataclass(frozen=True)
class Matrix:
    default_vllm: str
    releases: Mapping[str, Release]

    def release(self, vllm: str | None = None) -> Release:
        key = vllm or self.default_vllm
        try:
            return self.releases[key]
        except KeyError:
            have = ", ".join(sorted(self.releases))
            raise MatrixError(f"the CUDA matrix has no vLLM {key} (it has: {have})") from None


def parse_matrix(data: Mapping[str, Any]) -> Matrix:
    try:
        releases = {}
        for vllm, rel in data["releases"].items():
            variants = tuple(
                Variant(tag=v["tag"], cuda=v["cuda"], min_driver=v["min_driver"],
                        minor_compat_min_driver=v["minor_compat_min_driver"],
                        torch_index_url=v.get("torch_index_url"), vllm_index_url=v.get("vllm_index_url"),
                        packages=tuple(v["packages"]))
                for v in rel["variants"]
            )
            for v in variants:
                version_tuple(v.cuda), version_tuple(v.min_driver), version_tuple(v.minor_compat_min_driver)
                if not re.fullmatch(r"cu\d{3,4}", v.tag):
                    raise ValueError(f"variant tag {v.tag!r} is not cuXYZ")
            variants = tuple(sorted(variants, key=lambda v: version_tuple(v.cuda), reverse=True))
            releases[vllm] = Release(vllm=vllm, torch=rel["torch"], variants=variants)
        matrix = Matrix(default_vllm=data["default_vllm"], releases=releases)
        matrix.release()
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise MatrixError(f"malformed CUDA matrix: {exc!r}") from None
    return matrix


def load_matrix(path: Path | None = None) -> Matrix:
    path = path or DEFAULT_MATRIX
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MatrixError(f"cannot read the CUDA matrix {path}: {exc}") from None
    return parse_matrix(data)


@dataclass(frozen=True)
class Match:
    vllm: str
    torch: str
    tag: str
    cuda: str
    min_driver: str
    via: str  # "native" or "minor_version_compat"
    driver_version: str | None
    driver_cuda: str
    packages: tuple[str, ...]
    torch_index_url: str | None
    vllm_index_url: str | None
    extra_index_urls: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["packages"] = list(self.packages)
        d["extra_index_urls"] = list(self.extra_index_urls)
        return d


def _cuda_le(variant_cuda: str, driver_cuda: str) -> bool:
    return version_tuple(variant_cuda)[:2] <= version_tuple(driver_cuda)[:2]


def choose(driver_cuda: str, driver_version: str | None, matrix: Matrix, vllm: str | None = None,
           minor_compat: bool = False) -> Match:
    """The newest CUDA variant of vLLM (default: the matrix's pinned release) this driver runs.

    ``driver_cuda`` is the CUDA version the driver supports ("13.0"); ``driver_version``
    ("580.159.04") may be None when only the CUDA version is known. With ``minor_compat``
    a variant of the same CUDA major is accepted through CUDA minor-version
    compatibility when nothing matches natively. Raises DriverTooOldError naming the
    minimum driver.
    """
    if not re.fullmatch(r"\d+\.\d+", driver_cuda or ""):
        raise ValueError(f"driver CUDA version must look like 13.0, got {driver_cuda!r}")
    if driver_version is not None:
        version_tuple(driver_version)
    release = matrix.release(vllm)

    def make(v: Variant, via: str) -> Match:
        extra = tuple(u for u in (v.vllm_index_url, v.torch_index_url) if u)
        return Match(vllm=release.vllm, torch=release.torch, tag=v.tag, cuda=v.cuda, min_driver=v.min_driver,
                     via=via, driver_version=driver_version, driver_cuda=driver_cuda, packages=v.packages,
                     torch_index_url=v.torch_index_url, vllm_index_url=v.vllm_index_url, extra_index_urls=extra)

    for v in release.variants:
        if _cuda_le(v.cuda, driver_cuda) and (driver_version is None or _ge(driver_version, v.min_driver)):
            return make(v, "native")
    if minor_compat:
        major = version_tuple(driver_cuda)[0]
        for v in release.variants:
            if (version_tuple(v.cuda)[0] <= major
                    and (driver_version is None or _ge(driver_version, v.minor_compat_min_driver))):
                return make(v, "minor_version_compat")
    oldest = release.variants[-1]
    built = ", ".join(f"CUDA {v.cuda} ({v.tag}, driver >= {v.min_driver})" for v in release.variants)
    have = f"NVIDIA driver {driver_version}" if driver_version else "the NVIDIA driver"
    if minor_compat:
        need = oldest.minor_compat_min_driver
        hint = f"install NVIDIA driver >= {need} (CUDA {version_tuple(oldest.cuda)[0]}.x minor-version compatibility)"
    else:
        need = oldest.min_driver
        hint = (f"install NVIDIA driver >= {need} (the nvidia_driver role's default branch 580 runs every variant), "
                f"or allow CUDA minor-version compatibility (driver >= {oldest.minor_compat_min_driver} "
                f"for {oldest.tag})")
    raise DriverTooOldError(
        f"{have} supports CUDA {driver_cuda}, but vLLM {release.vllm} (torch {release.torch}) is built for {built}: "
        f"{hint}",
        min_driver=need,
    )


_LOCK_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(?P<version>[^\s;\\]+)", re.M)


def lock_cuda(lock_text: str) -> str | None:
    """The CUDA version (``"13.0"``) a hash-locked requirements file's torch is built for, or None.

    From torch's local version (``torch==2.13.0+cu130``), else from the CUDA runtime the lock
    pins for torch (``cuda-toolkit==13.0.3.0``, ``nvidia-cuda-runtime-cu12==12.8.90``). None:
    no torch, or a CPU build (``+cpu``, or no CUDA runtime at all).
    """
    pins = {re.sub(r"[-_.]+", "-", m["name"]).lower(): m["version"] for m in _LOCK_PIN.finditer(lock_text)}
    torch = pins.get("torch")
    if torch is None:
        return None
    local = torch.partition("+")[2]
    if local:
        m = re.fullmatch(r"cu(\d+)(\d)", local)
        return f"{int(m[1])}.{m[2]}" if m else None
    for name in ("cuda-toolkit", "nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12",
                 "nvidia-cuda-runtime-cu11"):
        m = re.match(r"(\d+)\.(\d+)", pins.get(name, ""))
        if m:
            return f"{int(m[1])}.{int(m[2])}"
    return None


def for_build(matrix: Matrix, cuda: str, vllm: str | None = None) -> Matrix:
    """The matrix with only the variant of vLLM ``vllm`` built for CUDA ``cuda`` ("13.0"):
    what ``choose`` then answers is whether the driver runs that one build (a lock's).

    A CUDA version the matrix does not list becomes a variant of its own that needs only a
    driver reporting that CUDA version (its minimum driver is not known here).
    """
    release = matrix.release(vllm)
    want = version_tuple(cuda)[:2]
    variants = tuple(v for v in release.variants if version_tuple(v.cuda)[:2] == want)
    if not variants:
        variants = (Variant(tag="cu" + "".join(str(n) for n in want), cuda=cuda, min_driver="0",
                            minor_compat_min_driver="0", torch_index_url=None, vllm_index_url=None, packages=()),)
    return Matrix(default_vllm=release.vllm, releases={release.vllm: Release(release.vllm, release.torch, variants)})


def given_info(cuda_version: str, driver_version: str | None = None) -> DriverInfo:
    """What is known without asking the driver: its CUDA version and maybe its version."""
    return DriverInfo(driver_version=driver_version or "", cuda_version=cuda_version, source="given")


def smi_text_info(text: str) -> DriverInfo:
    """Driver and CUDA version from the header of plain ``nvidia-smi`` output already read."""
    driver, cuda = parse_smi_header(text)
    return DriverInfo(driver_version=driver, cuda_version=cuda, gpus=tuple(parse_smi_table_gpus(text)))


def match_report(get_info: Callable[[], DriverInfo], matrix: Matrix, vllm: str | None = None,
                 minor_compat: bool = False) -> tuple[int, dict[str, Any]]:
    """Detection (``get_info``) and choice as ``llmhost gpu-info`` reports them: (exit code, report).

    ``report["status"]`` is ``match`` (``report["match"]`` is ``Match.to_dict()``), ``no_driver``,
    ``driver_too_old`` (with ``min_driver``) or ``error`` (a malformed version); ``report["error"]``
    says why. The python_env role's filter ``llmhost_cuda_match`` returns this report.
    """
    vllm = matrix.release(vllm).vllm
    report: dict[str, Any] = {"vllm": vllm, "detected": None, "match": None, "status": None, "error": None}
    try:
        info = get_info()
        report["detected"] = info.to_dict()
        if not info.cuda_version:
            raise NoDriverError(f"driver {info.driver_version} reports no CUDA version")
        match = choose(info.cuda_version, info.driver_version or None, matrix, vllm, minor_compat=minor_compat)
        report.update(match=match.to_dict(), status="match")
        code = EXIT_MATCH
    except NoDriverError as exc:
        report.update(status="no_driver", error=str(exc))
        code = EXIT_NO_DRIVER
    except DriverTooOldError as exc:
        report.update(status="driver_too_old", error=str(exc), min_driver=exc.min_driver)
        code = EXIT_DRIVER_TOO_OLD
    except ValueError as exc:
        report.update(status="error", error=str(exc))
        code = EXIT_USAGE
    return code, report


# -- command line ------------------------------------------------------------------------


def build_parser(prog: str = "llmhost gpu-info") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Detect the NVIDIA driver and GPUs and choose the CUDA build of PyTorch and vLLM for them. "
                    "Prints JSON; exit 0 match, 3 no GPU or no working driver, 4 driver too old.",
    )
    p.add_argument("--nvidia-smi", default="nvidia-smi", help="nvidia-smi command (default: nvidia-smi)")
    p.add_argument("--no-nvml", action="store_true", help="do not use NVML (pynvml) even when importable")
    p.add_argument("--from-dir", type=Path, metavar="DIR",
                   help="read recorded output (DIR/nvidia-smi.txt, query.csv, nvidia-smi-q.txt) instead of running")
    p.add_argument("--cuda-version", metavar="X.Y", help="skip detection: the driver's CUDA version, e.g. 13.0")
    p.add_argument("--driver-version", metavar="V", help="with --cuda-version: the driver version, e.g. 580.95.05")
    m = p.add_mutually_exclusive_group()
    m.add_argument("--matrix", type=Path, help=f"CUDA matrix JSON (default: {DEFAULT_MATRIX.name} in the package)")
    m.add_argument("--matrix-json", metavar="JSON", help="the CUDA matrix itself, as a JSON string")
    p.add_argument("--vllm", metavar="VERSION", help="vLLM release to match (default: the matrix's pinned one)")
    p.add_argument("--allow-minor-version-compat", action="store_true",
                   help="accept a variant of the same CUDA major on an older driver (CUDA minor-version "
                        "compatibility; PTX JIT of newer PTX unavailable)")
    p.add_argument("--compact", action="store_true", help="one-line JSON")
    return p


def main_gpu_info(argv: Sequence[str] | None = None) -> int:
    """``llmhost gpu-info``: detection + match as JSON on stdout; exit 0/3/4 (2: usage or matrix error)."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if args.driver_version and not args.cuda_version:
        print("llmhost gpu-info: --driver-version needs --cuda-version", file=sys.stderr)
        return EXIT_USAGE
    try:
        matrix = parse_matrix(json.loads(args.matrix_json)) if args.matrix_json else load_matrix(args.matrix)
        vllm = matrix.release(args.vllm).vllm
    except (MatrixError, json.JSONDecodeError) as exc:
        print(f"llmhost gpu-info: {exc}", file=sys.stderr)
        return EXIT_USAGE

    def get_info() -> DriverInfo:
        if args.cuda_version:
            return given_info(args.cuda_version, args.driver_version)
        if args.from_dir:
            return detect_from_dir(args.from_dir)
        return detect(args.nvidia_smi, use_nvml=not args.no_nvml)

    code, report = match_report(get_info, matrix, vllm, minor_compat=args.allow_minor_version_compat)
    print(json.dumps(report, indent=None if args.compact else 2))
    return code


if __name__ == "__main__":
    sys.exit(main_gpu_info(sys.argv[1:]))
