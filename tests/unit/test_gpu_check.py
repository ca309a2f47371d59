"""lab/gpucheck/check.py, the repeatable GPU check, without a GPU: its KIND_MODEL server
gets the entry, flags and environment the roles give the unit, its metric reader reads
only the named series, and a check whose recorded numbers fail is reported as failed.
The recorded H100 run it starts from is checked in tests/records/test_h100_serving_checks.py."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from lab.gpucheck import check as gpu_check
from llmhost.server.placement import plan
from tests.harness.paths import ROOT

RUN = ROOT / "tests" / "fixtures" / "gpu" / "h100-580.159.04-real" / "device-run-2026-11-24-check"
MODEL = Path("/tmp/lh-qwen3")


def _kind(kind: str) -> dict:
    return json.loads((RUN / "result.json").read_text())["kinds"][kind]


# --- the script's ties to the roles --------------------------------------------------------

def test_kind_model_entry_has_the_keys_the_roles_render_with():
    text = (ROOT / "roles" / "model_repository" / "vars" / "main.yml").read_text()
    context = yaml.safe_load(text)["_model_repository_context"]
    # Only when the inventory sets them:
    keys = set(re.findall(r"'(\w+)':", context)) - {"gpus", "dtype", "report_custom_metrics",
                                                          "enable_vllm_health_check", "lora_adapters"}
    entry = gpu_check.roles_model_entry(Path("/srv/m"))
    assert set(entry) == keys
    # The roles take the kind from llmhost.server.placement (filter llmhost_placement).
    assert "llmhost_placement" in yaml.safe_load(text)["_model_repository_placement"]
    assert entry["kind"] == plan([{"name": "m"}], None)[0].kind == "KIND_MODEL"


def test_kind_model_entry_takes_the_roles_defaults():
    repo = yaml.safe_load((ROOT / "roles" / "model_repository" / "defaults" / "main.yml").read_text())
    llmhost = yaml.safe_load((ROOT / "roles" / "llmhost" / "defaults" / "main.yml").read_text())
    assert llmhost["llmhost_profile"] == "gpu"
    assert gpu_check.ROLE_ENGINE_ARGS_GPU == repo["model_repository_engine_args"]["gpu"]
    assert gpu_check.ROLE_DEFAULTS == {"default_max_tokens": repo["model_repository_default_max_tokens"],
                                       "max_n": repo["model_repository_max_n"],
                                       "drain_timeout_s": llmhost["llmhost_drain_timeout_s"]}


def test_kind_model_server_gets_the_units_flags():
    # The unit renders the package's command line template (tests/ansible/test_triton.py
    # compares it with llmhost serve's); the script must pass the roles' default values.
    template = (ROOT / "src" / "llmhost" / "server" / "templates" / "tritonserver.args.j2").read_text()
    # gRPC over TLS is for hosts whose gRPC port serves other hosts; the check serves on loopback.
    plain = re.sub(r"{% if grpc_tls_cert .*?{% endif %}", "", template, flags=re.S)
    assert "--grpc-use-ssl" in template and "--grpc-use-ssl" not in plain
    flags = set(re.findall(r"(--[a-z-]+)=", plain))
    triton = yaml.safe_load((ROOT / "roles" / "triton" / "defaults" / "main.yml").read_text())
    cmd = gpu_check.unit_command(SimpleNamespace(server=Path("/x/tritonserver")), Path("/m"), Path("/b"), "k" * 32)
    assert {arg.split("=", 1)[0] for arg in cmd[1:]} == flags
    assert f"--exit-on-error={str(triton['triton_service_exit_on_error']).lower()}" in cmd
    assert f"--log-verbose={triton['triton_service_log_verbose']}" in cmd and not triton["triton_service_extra_args"]
    assert "--allow-gpu-metrics=true" in cmd
    assert f"--exit-timeout-secs={gpu_check.ROLE_DEFAULTS['drain_timeout_s'] + 30}" in cmd


def test_kind_model_server_gets_the_units_environment(tmp_path):
    template = (ROOT / "roles" / "triton" / "templates" / "tritonserver.env.j2").read_text()
    gpu_block = template[:template.index("{% if llmhost_profile == 'cpu' %}")]
    keys = set(re.findall(r"'([A-Z_]+)':", gpu_block))
    env = gpu_check.unit_environment(tmp_path, SimpleNamespace(libs=None))
    assert keys <= set(env)
    assert env["LLMHOST_STOP_FILE"] == str(tmp_path / "run" / "stopping")
    assert env["HF_HUB_OFFLINE"] == "1" and env["HOME"] == str(tmp_path)
    assert "VLLM_TARGET_DEVICE" not in keys  # profile cpu only


def test_metric_sum_reads_only_the_named_series_with_every_label():
    text = ('vllm:request_failed_total{model="llm",version="1",reason="engine_error"} 2\n'
            'vllm:request_failed_total{model="llm",version="1",reason="invalid_request"} 3\n'
            'vllm:request_failed_total_created{model="llm",version="1",reason="invalid_request"} 9\n'
            'vllm:request_failed_total{model="other",version="1",reason="invalid_request"} 5\n')
    assert gpu_check.metric_sum(text, "vllm:request_failed_total", 'model="llm"', 'reason="invalid_request"') == 3
    assert gpu_check.metric_sum(text, "vllm:request_failed_total", 'model="llm"') == 5
    assert gpu_check.metric_sum(text, "vllm:num_requests_running") == 0


@pytest.mark.parametrize(("path", "value", "check"), [
    (("bad_input", "engine_error_delta"), 1.0, "bad_input"),
    (("bad_input", "seed", "leaks"), True, "bad_input"),
    (("structured", "regex", "ok"), False, "structured"),
    (("cancellation", "cancelled_delta"), 3.0, "cancellation"),
    (("cancellation", "running_after"), 1.0, "cancellation"),
    (("gpu_metrics", "every_gpu"), False, "gpu_metrics"),
    (("stop", "processes_left"), [4242], "stop"),
    (("stop", "shm_left"), ["triton_python_backend_shm_region_1"], "stop"),
    (("rendered_kind",), "KIND_GPU", "served"),
])
def test_a_failed_check_is_reported_as_failed(path, value, check):
    case = copy.deepcopy(_kind("KIND_MODEL"))
    target = case
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    verdicts = gpu_check.passed(case)
    assert verdicts[check] is False
    assert all(ok for name, ok in verdicts.items() if name != check)


def test_the_roles_write_gpus_only_where_the_inventory_pinned_them():
    """placed_entries follows roles/model_repository's context: kind from the placement
    filter, `gpus` combined in only when the placement is pinned."""
    text = (ROOT / "roles" / "model_repository" / "vars" / "main.yml").read_text()
    yaml.safe_load(text)
    assert "_model_repository_placement.models[item.model.name].kind" in text
    assert re.search(r"combine\(\{'gpus': _model_repository_placement\.models\[item\.model\.name\]\.gpus\}\s*"
                     r"if _model_repository_placement\.models\[item\.model\.name\]\.pinned", text)
    (unpinned,) = gpu_check.placed_entries(MODEL, [{"name": "one"}], gpu_count=2)
    assert unpinned["kind"] == "KIND_MODEL" and "gpus" not in unpinned
