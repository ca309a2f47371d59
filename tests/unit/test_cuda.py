"""llmhost.cuda: nvidia-smi/NVML parsing and the CUDA matching table, on recorded output.

tests/fixtures/gpu/README.md says which fixtures were recorded on a real GPU (the
H100) and which were constructed from nvidia-smi's documented formats.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llmhost import cuda
from llmhost.cuda import (
    DriverTooOldError,
    MatrixError,
    NoDriverError,
    choose,
    detect,
    detect_from_dir,
    detect_nvml,
    detect_smi,
    load_matrix,
    parse_matrix,
    parse_query_csv,
    parse_smi_header,
    parse_smi_q,
    parse_smi_table_gpus,
)
from tests.harness.paths import FIXTURES, ROOT

FIX = ROOT / "tests" / "fixtures" / "gpu"
H100 = FIX / "h100-580.159.04-real"
MATRIX_FILE = ROOT / "src" / "llmhost" / "data" / "cuda_matrix.json"

# The vLLM releases of the matrix and the pins each one's wheel metadata gives
# (Requires-Dist torch==, torchvision==, torchaudio==); the default stays 0.32.0 (0.33.0,
# torch 2.14, is selectable: no GPU here runs torch 2.14 to prove it as the default),
# 0.20.2 is the release that runs on torch 2.11 (the lent GPU machine's image).
DEFAULT_VLLM = "0.32.0"
RELEASES = {
    "0.33.0": {"torch": "2.14.0", "torchvision": "0.29.0", "torchaudio": "2.11.0"},
    "0.32.0": {"torch": "2.13.0", "torchvision": "0.28.0", "torchaudio": "2.11.0"},
    "0.20.2": {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0"},
}

# folder -> (driver, CUDA, GPU count, compute capability of GPU 0)
HOSTS = {
    "h100-580.159.04-real": ("580.159.04", "13.0", 1, "9.0"),
    "h200x4-590.48.01-constructed": ("590.48.01", "13.1", 4, "9.0"),
    "rtx6000ada-575.57.08-constructed": ("575.57.08", "12.9", 1, "8.9"),
    "l40s-570.172.08-constructed": ("570.172.08", "12.8", 1, "8.9"),
    "a100x2-535.247.01-constructed": ("535.247.01", "12.2", 2, "8.0"),
    "t4-470.256.02-constructed": ("470.256.02", "11.4", 1, None),
}


@pytest.fixture(scope="module")
def matrix() -> cuda.Matrix:
    return load_matrix()


# -- parsing ----------------------------------------------------------------------------


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_header_of_every_layout(host: str):
    driver, cuda_version, _, _ = HOSTS[host]
    assert parse_smi_header((FIX / host / "nvidia-smi.txt").read_text()) == (driver, cuda_version)


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_table_gpus_agree_with_query_csv(host: str):
    table = parse_smi_table_gpus((FIX / host / "nvidia-smi.txt").read_text())
    rows = parse_query_csv((FIX / host / "query.csv").read_text())
    assert len(table) == HOSTS[host][2] == len(rows)
    for gpu, row in zip(table, rows, strict=True):
        assert gpu.name == row["name"]
        assert gpu.pci_bus_id == row["pci.bus_id"]
        assert f"{gpu.memory_total_mib} MiB" == row["memory.total"]


def test_real_h100_query_csv_with_units_header():
    rows = parse_query_csv((H100 / "query.csv").read_text())
    assert rows == [{"name": "NVIDIA H100 80GB HBM3", "driver_version": "580.159.04", "memory.total": "81559 MiB",
                     "pci.bus_id": "00000000:00:06.0", "compute_cap": "9.0"}]
    gpu = cuda.gpus_from_query(rows)[0]
    assert (gpu.index, gpu.memory_total_mib, gpu.compute_capability) == (0, 81559, "9.0")


def test_query_csv_noheader_nounits():
    text = ("0, NVIDIA H100 80GB HBM3, GPU-b82f6a65-1d36-eabe-2658-144144e7e685, 00000000:00:06.0, 81559, 9.0, "
            "580.159.04\n")
    rows = parse_query_csv(text, cuda.QUERY_FIELDS)
    gpu = cuda.gpus_from_query(rows)[0]
    assert gpu == cuda.Gpu(0, "NVIDIA H100 80GB HBM3", "GPU-b82f6a65-1d36-eabe-2658-144144e7e685",
                           "00000000:00:06.0", 81559, "9.0")
    with pytest.raises(ValueError, match="3 columns, expected 7"):
        parse_query_csv("0, a, b\n", cuda.QUERY_FIELDS)
    assert parse_query_csv("", cuda.QUERY_FIELDS) == []
    assert cuda.gpus_from_query(parse_query_csv("0, X, [N/A], 0:0:0.0, [N/A], [N/A], 1.0\n",
                                                cuda.QUERY_FIELDS))[0].uuid is None


def test_real_h100_nvidia_smi_q():
    info = parse_smi_q((H100 / "nvidia-smi-q.txt").read_text())
    assert (info.driver_version, info.cuda_version) == ("580.159.04", "13.0")
    assert info.gpus == (cuda.Gpu(0, "NVIDIA H100 80GB HBM3", "GPU-b82f6a65-1d36-eabe-2658-144144e7e685",
                                  "00000000:00:06.0", 81559, None),)


@pytest.mark.parametrize("host,reason", [
    ("no-driver-constructed", "couldn't communicate with the NVIDIA driver"),
    ("version-mismatch-constructed", "Driver/library version mismatch"),
])
def test_failures_name_the_reason(host: str, reason: str):
    text = (FIX / host / "nvidia-smi.txt").read_text()
    with pytest.raises(NoDriverError, match=re.escape(reason)):
        parse_smi_header(text)
    with pytest.raises(NoDriverError, match=re.escape(reason)):
        parse_query_csv(text, cuda.QUERY_FIELDS)
    with pytest.raises(NoDriverError, match=re.escape(reason)):
        detect_from_dir(FIX / host)


def test_from_dir_merges_uuid_from_q_and_missing_tool(tmp_path: Path):
    info = detect_from_dir(H100)
    assert info.gpus[0].uuid == "GPU-b82f6a65-1d36-eabe-2658-144144e7e685"
    assert info.gpus[0].compute_capability == "9.0"
    with pytest.raises(NoDriverError, match="command not found"):
        detect_from_dir(tmp_path)


# -- running nvidia-smi: replay the recorded output -------------------------------------------


class Replay:
    """Answers nvidia-smi command lines with a fixture folder's recorded output."""

    def __init__(self, folder: Path, missing: bool = False) -> None:
        self.folder, self.missing, self.calls = folder, missing, []

    def __call__(self, argv: list[str]) -> tuple[int, str]:
        self.calls.append(argv)
        if self.missing:
            return 127, f"{argv[0]}: command not found"
        smi = (self.folder / "nvidia-smi.txt").read_text()
        if len(argv) == 1:
            return (0 if "Driver Version" in smi else 9), smi
        if "Driver Version" not in smi:
            return 9, smi
        query = next(a for a in argv if a.startswith("--query-gpu="))
        fields = query.split("=", 1)[1].split(",")
        err = self.folder / "query-compute_cap.err"
        if "compute_cap" in fields and err.is_file():
            return 2, err.read_text()
        rows = parse_query_csv((self.folder / "query.csv").read_text())
        lines = [", ".join((r.get(f) or "[N/A]").replace(" MiB", "") for f in fields) for r in rows]
        return 0, "\n".join(lines) + "\n"


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_detect_smi_on_each_recorded_host(host: str):
    driver, cuda_version, count, cc = HOSTS[host]
    replay = Replay(FIX / host)
    info = detect_smi("nvidia-smi", runner=replay)
    assert (info.driver_version, info.cuda_version, len(info.gpus)) == (driver, cuda_version, count)
    assert info.gpus[0].compute_capability == cc
    assert [g.index for g in info.gpus] == list(range(count))
    if cc is None:  # driver < 510: asked again without compute_cap, and says so
        assert len(replay.calls) == 3 and "compute_cap" not in replay.calls[-1][1]
        assert any("compute_cap" in n for n in info.notes)


def test_detect_smi_failures():
    with pytest.raises(NoDriverError, match="command not found"):
        detect_smi("nvidia-smi", runner=Replay(H100, missing=True))
    with pytest.raises(NoDriverError, match="couldn't communicate"):
        detect_smi("nvidia-smi", runner=Replay(FIX / "no-driver-constructed"))


def fake_pynvml(driver: str = "580.159.04", cuda_int: int = 13000, cc: tuple[int, int] = (9, 0),
                init_error: str | None = None, uuid: str = "GPU-b82f6a65-1d36-eabe-2658-144144e7e685") -> Any:
    """The pynvml calls detect_nvml makes, answering the values recorded on the H100 (nvml.txt)."""
    state = {"shutdown": 0}

    def init() -> None:
        if init_error:
            raise RuntimeError(init_error)

    def shutdown() -> None:
        state["shutdown"] += 1

    return SimpleNamespace(
        state=state, nvmlInit=init, nvmlShutdown=shutdown,
        nvmlSystemGetDriverVersion=lambda: driver.encode(),
        nvmlSystemGetCudaDriverVersion_v2=lambda: cuda_int,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", i),
        nvmlDeviceGetCudaComputeCapability=lambda h: cc,
        nvmlDeviceGetPciInfo=lambda h: SimpleNamespace(busId=b"00000000:00:06.0"),
        nvmlDeviceGetName=lambda h: "NVIDIA H100 80GB HBM3",
        nvmlDeviceGetUUID=lambda h: uuid,
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=81559 * 1024 * 1024),
    )


def test_nvml_values_recorded_on_the_h100():
    recorded = dict(line.split(" ", 1) for line in (H100 / "nvml.txt").read_text().splitlines())
    major, minor = (int(x) for x in recorded["cuda"].split())
    nvml = fake_pynvml(driver=recorded["driver"], cuda_int=major * 1000 + minor * 10)
    info = detect_nvml(nvml)
    assert (info.driver_version, info.cuda_version, info.source) == ("580.159.04", "13.0", "nvml")
    assert info.gpus[0].compute_capability == "9.0" and "cc (9, 0)" in recorded["name"]
    assert info.gpus[0].memory_total_mib == 81559 and nvml.state["shutdown"] == 1
    with pytest.raises(NoDriverError, match="NVML: Driver Not Loaded"):
        detect_nvml(fake_pynvml(init_error="Driver Not Loaded"))


def test_detect_falls_back_to_nvml_and_fills_compute_capability():
    info = detect(runner=Replay(H100, missing=True), nvml=fake_pynvml())
    assert info.source == "nvml" and info.cuda_version == "13.0"
    t4 = FIX / "t4-470.256.02-constructed"
    assert detect(runner=Replay(t4), use_nvml=False).gpus[0].compute_capability is None
    nvml = fake_pynvml("470.256.02", 11040, (7, 5), uuid="GPU-00000000-0000-4000-8000-000000000000")
    filled = detect(runner=Replay(t4), nvml=nvml)
    assert filled.source == "nvidia-smi+nvml" and filled.gpus[0].compute_capability == "7.5"
    with pytest.raises(NoDriverError, match="command not found; NVML: gone"):
        detect(runner=Replay(H100, missing=True), nvml=fake_pynvml(init_error="gone"))


def test_cuda_version_from_nvml_int():
    assert cuda.cuda_version_from_int(13000) == "13.0"
    assert cuda.cuda_version_from_int(12020) == "12.2"
    assert cuda.cuda_version_from_int(12090) == "12.9"
    with pytest.raises(ValueError):
        cuda.cuda_version_from_int(0)


# -- the matching table -----------------------------------------------------------------------


@pytest.mark.parametrize("cuda_version,driver,minor_compat,expected", [
    ("13.0", "580.159.04", False, ("cu130", "native")),     # the real H100
    ("13.0", "580.65.06", False, ("cu130", "native")),      # CUDA 13.0 GA driver, exactly
    ("13.1", "590.48.01", False, ("cu130", "native")),      # newer driver: newest variant there is
    ("13.2", "595.58.03", True, ("cu130", "native")),
    ("12.9", "575.57.08", False, ("cu129", "native")),
    ("12.9", "575.51.03", False, ("cu129", "native")),
    ("12.8", "570.172.08", True, ("cu129", "minor_version_compat")),
    ("12.2", "535.247.01", True, ("cu129", "minor_version_compat")),
    ("13.0", None, False, ("cu130", "native")),             # only the CUDA version known
])
@pytest.mark.parametrize("vllm", [None, *RELEASES])
def test_choose(matrix: cuda.Matrix, cuda_version: str, driver: str | None, minor_compat: bool,
                expected: tuple[str, str], vllm: str | None):
    m = choose(cuda_version, driver, matrix, vllm=vllm, minor_compat=minor_compat)
    assert (m.tag, m.via) == expected
    pins = RELEASES[vllm or DEFAULT_VLLM]
    assert m.vllm == (vllm or DEFAULT_VLLM) and m.torch == pins["torch"]
    assert m.torch_index_url == f"https://download.pytorch.org/whl/{m.tag}"
    assert f"torch=={pins['torch']}+{m.tag}" in m.packages
    assert f"torchvision=={pins['torchvision']}+{m.tag}" in m.packages
    assert m.packages[0] in (f"vllm=={m.vllm}", f"vllm=={m.vllm}+{m.tag}")
    assert m.extra_index_urls[-1] == m.torch_index_url


@pytest.mark.parametrize("cuda_version,driver,minor_compat,min_driver", [
    ("12.8", "570.172.08", False, "575.51.03"),
    ("12.2", "535.247.01", False, "575.51.03"),
    ("11.4", "470.256.02", False, "575.51.03"),
    ("11.4", "470.256.02", True, "525.60.13"),
    ("12.9", "575.0", False, "575.51.03"),  # an inconsistent pair: the driver number wins
])
@pytest.mark.parametrize("vllm", list(RELEASES))
def test_too_old_names_the_minimum_driver(matrix: cuda.Matrix, cuda_version: str, driver: str,
                                          minor_compat: bool, min_driver: str, vllm: str):
    with pytest.raises(DriverTooOldError) as exc:
        choose(cuda_version, driver, matrix, vllm=vllm, minor_compat=minor_compat)
    assert exc.value.min_driver == min_driver
    msg = str(exc.value)
    assert f">= {min_driver}" in msg and f"NVIDIA driver {driver} supports CUDA {cuda_version}" in msg
    assert f"vLLM {vllm} (torch {RELEASES[vllm]['torch']})" in msg and "cu130" in msg and "cu129" in msg


def test_choose_rejects_bad_input(matrix: cuda.Matrix):
    with pytest.raises(ValueError, match=r"look like 13\.0"):
        choose("13", "580.1", matrix)
    with pytest.raises(ValueError, match="dotted numeric"):
        choose("13.0", "580.x", matrix)
    with pytest.raises(MatrixError, match=r"no vLLM 0\.1\.0"):
        choose("13.0", "580.159.04", matrix, vllm="0.1.0")


@pytest.mark.parametrize("vllm", ["0.1.0", "0.20", "0.20.2+cu129", "0.31.0"])
def test_unknown_release_names_the_releases_the_matrix_has(matrix: cuda.Matrix, vllm: str):
    """Only exact releases of the matrix are selectable; the error lists them."""
    with pytest.raises(MatrixError) as exc:
        matrix.release(vllm)
    assert str(exc.value) == f"the CUDA matrix has no vLLM {vllm} (it has: 0.20.2, 0.32.0, 0.33.0)"


def test_default_release_stays_and_the_other_is_selectable(matrix: cuda.Matrix):
    assert sorted(matrix.releases) == sorted(RELEASES)
    assert matrix.default_vllm == DEFAULT_VLLM and matrix.release().vllm == DEFAULT_VLLM
    assert matrix.release("0.20.2").vllm == "0.20.2" and matrix.release("0.20.2").torch == "2.11.0"
    assert matrix.release(None) is matrix.release(DEFAULT_VLLM)


def test_matrix_file_pins_agree_with_the_project(matrix: cuda.Matrix):
    release = matrix.release()
    assert release.vllm == DEFAULT_VLLM and release.torch == "2.13.0"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'gpu = ["vllm=={release.vllm}"]' in pyproject


@pytest.mark.parametrize("vllm", list(RELEASES))
def test_matrix_file_pins_of_each_release(matrix: cuda.Matrix, vllm: str):
    data = json.loads(MATRIX_FILE.read_text())
    release = matrix.release(vllm)
    raw = data["releases"][vllm]
    assert {k: raw[k] for k in ("torch", "torchvision", "torchaudio")} == RELEASES[vllm]
    assert release.torch == RELEASES[vllm]["torch"]
    assert raw["sources"] and all(v["sources"] and v["verified"] for v in raw["variants"])
    # The wheel metadata the pins come from is named in the sources.
    assert any(f"vllm {vllm} wheel metadata" in s and f"torch=={raw['torch']}" in s
               and f"torchvision=={raw['torchvision']}" in s for s in raw["sources"])
    # CUDA toolkit GA driver rows (NVIDIA CUDA Toolkit release notes, Linux x86_64):
    # these are the drivers whose nvidia-smi reports at least that CUDA version.
    ga_rows = {"13.0": "580.65.06", "12.9": "575.51.03"}
    minor_compat = {"13": "580.0", "12": "525.60.13"}
    for v in release.variants:
        assert v.tag == "cu" + v.cuda.replace(".", "")
        assert v.min_driver == ga_rows[v.cuda]
        assert v.minor_compat_min_driver == minor_compat[v.cuda.split(".")[0]]
        assert all(re.fullmatch(r"[a-z0-9_.-]+==[0-9][0-9a-z.+]*", p) for p in v.packages)
        pins = dict(p.split("==") for p in v.packages)
        suffix = "" if v.vllm_index_url is None else f"+{v.tag}"
        assert pins["vllm"] == release.vllm + suffix
        assert pins["torch"] == f"{raw['torch']}+{v.tag}"
        assert pins["torchvision"] == f"{raw['torchvision']}+{v.tag}"
        assert pins["torchaudio"] == f"{raw['torchaudio']}+{v.tag}"
        # vLLM's +cuXYZ builds come from that release's own variant index.
        assert v.vllm_index_url in (None, f"https://wheels.vllm.ai/{vllm}/{v.tag}")
    assert [v.cuda for v in release.variants] == ["13.0", "12.9"]  # newest first
    # The default (unsuffixed) wheel on the package index is the CUDA 13.0 build.
    assert release.variants[0].vllm_index_url is None and release.variants[0].packages[0] == f"vllm=={vllm}"


def test_vllm_0_20_2_pins_as_its_wheel_says(matrix: cuda.Matrix):
    """vLLM 0.20.2's wheel metadata pins torch 2.11.0, torchvision 0.26.0 and torchaudio 2.11.0;
    its default wheel links libcudart.so.13; its only other CUDA build is +cu129."""
    data = json.loads(MATRIX_FILE.read_text())["releases"]["0.20.2"]
    cu130, cu129 = matrix.release("0.20.2").variants
    assert cu130.packages == ("vllm==0.20.2", "torch==2.11.0+cu130", "torchvision==0.26.0+cu130",
                              "torchaudio==2.11.0+cu130")
    assert cu129.packages == ("vllm==0.20.2+cu129", "torch==2.11.0+cu129", "torchvision==0.26.0+cu129",
                              "torchaudio==2.11.0+cu129")
    assert (cu130.vllm_index_url, cu129.vllm_index_url) == (None, "https://wheels.vllm.ai/0.20.2/cu129")
    assert data["python"] == ">=3.10,<3.15"
    assert [v["cuda_runtime"] for v in data["variants"]] == ["13.0.2", "12.9"]
    assert any("NEEDED libcudart.so.13" in s for s in data["sources"])
    assert any("no cu126, cu128 or +cu130 build" in s for s in data["sources"])


def test_malformed_matrix_is_refused():
    good = json.loads(MATRIX_FILE.read_text())
    bad = json.loads(json.dumps(good))
    bad["releases"]["0.32.0"]["variants"][0]["min_driver"] = "580.x"
    with pytest.raises(MatrixError, match="malformed"):
        parse_matrix(bad)
    bad = json.loads(json.dumps(good))
    bad["default_vllm"] = "9.9.9"
    with pytest.raises(MatrixError):
        parse_matrix(bad)
    bad = json.loads(json.dumps(good))  # a release other than the default is checked too
    bad["releases"]["0.20.2"]["variants"][1]["tag"] = "cu12.9"
    with pytest.raises(MatrixError, match=r"cu12\.9"):
        parse_matrix(bad)
    bad = json.loads(json.dumps(good))
    del bad["releases"]["0.20.2"]["torch"]
    with pytest.raises(MatrixError, match="malformed"):
        parse_matrix(bad)
    with pytest.raises(MatrixError, match="cannot read"):
        load_matrix(Path("/nonexistent/cuda_matrix.json"))


# -- the command --------------------------------------------------------------------------------


@pytest.mark.parametrize("host,code,status,tag", [
    ("h100-580.159.04-real", 0, "match", "cu130"),
    ("h200x4-590.48.01-constructed", 0, "match", "cu130"),
    ("rtx6000ada-575.57.08-constructed", 0, "match", "cu129"),
    ("l40s-570.172.08-constructed", 4, "driver_too_old", None),
    ("a100x2-535.247.01-constructed", 4, "driver_too_old", None),
    ("t4-470.256.02-constructed", 4, "driver_too_old", None),
    ("no-driver-constructed", 3, "no_driver", None),
    ("version-mismatch-constructed", 3, "no_driver", None),
])
def test_gpu_info_exit_codes(capsys: pytest.CaptureFixture[str], host: str, code: int, status: str,
                             tag: str | None):
    assert cuda.main_gpu_info(["--from-dir", str(FIX / host)]) == code
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == status and report["vllm"] == "0.32.0"
    assert (report["match"] or {}).get("tag") == tag
    if code == 4:
        assert report["min_driver"] == "575.51.03" and "575.51.03" in report["error"]
    if code == 3:
        assert report["detected"] is None and report["error"]


def test_gpu_info_given_versions_and_minor_compat(capsys: pytest.CaptureFixture[str]):
    assert cuda.main_gpu_info(["--cuda-version", "12.2", "--driver-version", "535.247.01"]) == 4
    capsys.readouterr()
    assert cuda.main_gpu_info(["--cuda-version", "12.2", "--driver-version", "535.247.01",
                               "--allow-minor-version-compat", "--compact"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    report = json.loads(out)
    assert report["match"]["tag"] == "cu129" and report["match"]["via"] == "minor_version_compat"
    assert report["match"]["extra_index_urls"] == ["https://wheels.vllm.ai/0.32.0/cu129",
                                                   "https://download.pytorch.org/whl/cu129"]
    assert cuda.main_gpu_info(["--driver-version", "580.1"]) == 2
    assert cuda.main_gpu_info(["--cuda-version", "13", "--driver-version", "580.1"]) == 2
    assert cuda.main_gpu_info(["--cuda-version", "13.0", "--vllm", "0.0.1"]) == 2


@pytest.mark.parametrize("host,code,tag", [
    ("h100-580.159.04-real", 0, "cu130"),
    ("rtx6000ada-575.57.08-constructed", 0, "cu129"),
    ("l40s-570.172.08-constructed", 4, None),
])
def test_gpu_info_for_vllm_0_20_2(capsys: pytest.CaptureFixture[str], host: str, code: int, tag: str | None):
    assert cuda.main_gpu_info(["--from-dir", str(FIX / host), "--vllm", "0.20.2", "--compact"]) == code
    report = json.loads(capsys.readouterr().out)
    assert report["vllm"] == "0.20.2"
    if tag is None:
        assert report["status"] == "driver_too_old" and "vLLM 0.20.2 (torch 2.11.0)" in report["error"]
        return
    match = report["match"]
    assert (match["tag"], match["vllm"], match["torch"]) == (tag, "0.20.2", "2.11.0")
    assert f"torch==2.11.0+{tag}" in match["packages"]
    if tag == "cu129":
        assert match["extra_index_urls"] == ["https://wheels.vllm.ai/0.20.2/cu129",
                                             "https://download.pytorch.org/whl/cu129"]


def test_gpu_info_unknown_release_says_which_exist(capsys: pytest.CaptureFixture[str]):
    assert cuda.main_gpu_info(["--cuda-version", "13.0", "--vllm", "0.21.0"]) == 2
    err = capsys.readouterr().err
    assert "the CUDA matrix has no vLLM 0.21.0 (it has: 0.20.2, 0.32.0, 0.33.0)" in err


@pytest.mark.parametrize("vllm", [None, "0.20.2"])
def test_runs_as_a_plain_script_without_site_packages(vllm: str | None):
    """The roles run cuda.py with the target's python3 before any venv exists."""
    proc = subprocess.run(
        [sys.executable, "-I", "-S", str(ROOT / "src" / "llmhost" / "cuda.py"),
         "--matrix-json", MATRIX_FILE.read_text(), "--from-dir", str(H100), "--compact",
         *(["--vllm", vllm] if vllm else [])],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["match"]["packages"][0] == f"vllm=={vllm or DEFAULT_VLLM}"


def test_constructed_fixtures_follow_the_real_format():
    proc = subprocess.run([sys.executable, str(FIX / "construct.py"), "--check"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_device_run_recording_is_consistent():
    """What `llmhost gpu-info` printed on the real H100 is what it computes here from that
    host's recorded nvidia-smi output, and Triton exported GPU metrics for that GPU."""
    import json

    from llmhost.cuda import choose, detect_from_dir, load_matrix

    run = FIXTURES / "gpu" / "h100-580.159.04-real"
    recorded = json.loads((run / "device-run-2026-11-22" / "gpu-info.json").read_text())
    assert recorded["status"] == "match" and recorded["match"]["tag"] == "cu130"
    info = detect_from_dir(run)
    assert info.driver_version == recorded["match"]["driver_version"] == "580.159.04"
    match = choose(info.cuda_version, info.driver_version, load_matrix())
    assert match.tag == recorded["match"]["tag"]
    metrics = (run / "device-run-2026-11-22" / "triton-metrics.txt").read_text()
    uuid = recorded["detected"]["gpus"][0]["uuid"]
    for name in ("nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes",
                 "nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption"):
        assert f'{name}{{gpu_uuid="{uuid}"}}' in metrics, name


def test_device_run_gpu_panels_returned_data():
    """The GPU panels were run against a real Prometheus on the H100: each over Triton's
    metrics returned a series, and the recorded queries over Triton's metrics are still the
    dashboards' queries (the DCGM panels came later; no DCGM ran there: tests/monitoring
    runs them over a constructed dcgm-exporter exposition)."""
    import json

    from llmhost.bench.promql import panel_queries, substitute
    from tests.harness.prom import DASHBOARDS_DIR

    rec = json.loads((FIXTURES / "gpu" / "h100-580.159.04-real"
                      / "device-run-2026-11-22" / "gpu-panels.json").read_text())
    assert rec["failed"] == []
    by_expr = {r["expr"]: r for r in rec["results"]}
    current = [substitute(q.expr, {"instance": "gpu-host", "model": ".*"})
               for q in panel_queries(DASHBOARDS_DIR) if q.gpu]
    assert current and {e for e in current if "nv_" in e} == {e for e in by_expr if "nv_" in e}
    for expr, row in by_expr.items():
        assert row["status"] == 200
        if "nv_" in expr:
            assert row["series"] >= 1, expr


def test_device_run_role_preflights_on_the_real_h100():
    """Recorded on the H100 (Ubuntu 24.04, 2026-11-22): site.yml's preflights in check mode
    against the real driver. The python_env role chose what llmhost.cuda chooses for that
    host's nvidia-smi, dcgm_exporter chose DCGM's CUDA 13 packages from the Ubuntu 24.04
    repository, and nothing changed or failed."""
    import re

    from llmhost.cuda import choose, load_matrix, parse_smi_header

    rec = FIXTURES / "gpu" / "h100-580.159.04-real" / "device-run-2026-11-22-roles"
    assert 'VERSION_ID="24.04"' in (rec / "os-release.txt").read_text()
    driver, cuda = parse_smi_header((rec / "nvidia-smi.txt").read_text())
    assert cuda is not None
    match = choose(cuda, driver, load_matrix())
    for name in ("role-preflights.txt", "site-preflight.txt"):
        text = (rec / name).read_text()
        assert re.search(r"localhost\s+: ok=\d+\s+changed=0\s+unreachable=0\s+failed=0", text), name
        assert text.rstrip().endswith("exit code: 0"), name
        flat = " ".join(text.split())
        assert f"driver {driver}, CUDA {cuda}, build {match.tag}" in flat, name
        assert " ".join(match.packages) in flat, name
        assert ("datacenter-gpu-manager-4-core datacenter-gpu-manager-4-cuda13 datacenter-gpu-manager-exporter "
                "from https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/") in flat, name


def test_recorded_gpu_runs_used_a_release_of_the_matrix(matrix: cuda.Matrix):
    """The serving runs on the lent H100 used vLLM 0.20.2 on the image's torch 2.11.0+cu130
    (../shared RECIPES.md): the matrix has that release, and for that host's nvidia-smi it
    chooses exactly that torch build."""
    runs = sorted(H100.glob("device-run-*/result.json"))
    used = {json.loads(p.read_text()).get("vllm") for p in runs} - {None}
    assert "0.20.2" in used and used <= set(matrix.releases), runs
    info = detect_from_dir(H100)
    assert info.cuda_version is not None
    m = choose(info.cuda_version, info.driver_version, matrix, vllm="0.20.2")
    assert (m.tag, m.via) == ("cu130", "native")
    assert "torch==2.11.0+cu130" in m.packages and m.packages[0] == "vllm==0.20.2"
