"""The triton role's admin key and bind addresses without a host: the unit
and the smoke probe's unit rendered by the roles' own templates and variables,
and the admin key tasks run against a scratch directory on this machine (as root):
created once, 0600 root, kept (changed=0 the second time), never printed, also not
with --check --diff -vvv."""

from __future__ import annotations

import json
import os
import shlex
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmhost.server.admin_key import ENV_NAME, HEADER, RESTRICTED_APIS, read_key, restriction_args

from ._helpers import REPO, PlaybookRun, ansible_playbook, ansible_playbook_on_hosts, host_name, load_yaml

VENV = Path(sys.executable).parent.parent


def _play(tmp_path: Path, tasks: list[dict[str, Any]], variables: dict[str, Any], name: str) -> Path:
    play = [{"hosts": "localhost", "gather_facts": False, "connection": "local",
             "vars": {"ansible_python_interpreter": sys.executable, "llmhost_profile": "cpu",
                      "llmhost_source_dir": str(REPO), **variables},
             "tasks": tasks}]
    book = tmp_path / f"{name}.yml"
    book.write_text(yaml.safe_dump(play))
    return book


def _include(role: str, tasks_from: str) -> dict[str, Any]:
    return {"name": f"Include {role} {tasks_from}", "ansible.builtin.include_role":
            {"name": role, "tasks_from": tasks_from, "public": True}}


def _exec_start(unit: str) -> list[str]:
    """ExecStart= of a unit file as systemd splits it (continuation lines joined)."""
    text = unit.replace("\\\n", " ")
    lines = [ln for ln in text.splitlines() if ln.startswith("ExecStart=")]
    assert len(lines) == 1, unit
    return shlex.split(lines[0].removeprefix("ExecStart="))


TRITON_UNIT = REPO / "roles" / "triton" / "templates" / "tritonserver.service.j2"
TRITON_ENV = REPO / "roles" / "triton" / "templates" / "tritonserver.env.j2"
SMOKE_UNIT = REPO / "roles" / "smoke" / "templates" / "llmhost-smoke@.service.j2"

# The bind addresses of test_unit_binds_inference_and_metrics_apart_and_restricts_admin_apis
# and the (gRPC, metrics) addresses the unit must have with them.
BINDS: list[tuple[dict[str, Any], tuple[str, str]]] = [
    ({}, ("127.0.0.1", "127.0.0.1")),
    ({"llmhost_bind_address": "0.0.0.0", "llmhost_allow_public_triton": True,
      "llmhost_metrics_bind_address": "10.1.2.3"}, ("0.0.0.0", "10.1.2.3")),
    ({"llmhost_metrics_bind_address": "127.0.0.2"}, ("127.0.0.1", "127.0.0.2")),
]
PUBLIC = {"llmhost_venv_dir": str(VENV), "llmhost_bind_address": "0.0.0.0", "llmhost_allow_public_triton": True}
SERVE_EXTRA = ["--http-thread-count=32", "--log-info=false"]  # triton_service_extra_args of "serve"


def render_cases(folder: Path) -> dict[str, tuple[str, Path, dict[str, Any]]]:
    """Every render of the tests below by name: (role, template, variables). Paths the
    variables name are under `folder`: grpc.crt and grpc.key, the Triton folders."""
    tls = {"triton_grpc_tls_cert_file": str(folder / "grpc.crt"), "triton_grpc_tls_key_file": str(folder / "grpc.key")}
    root = folder / "llmhost"

    def environment(name: str, variables: dict[str, Any]) -> tuple[str, Path, dict[str, Any]]:
        triton_dir = folder / "env" / name / "llmhost"
        return "triton", TRITON_ENV, {"llmhost_venv_dir": str(VENV), "llmhost_triton_dir": str(triton_dir), **variables}

    return {
        **{f"binds {i}": ("triton", TRITON_UNIT, {"llmhost_venv_dir": str(VENV), **binds})
           for i, (binds, _) in enumerate(BINDS)},
        "ready timeout": ("triton", TRITON_UNIT, {"llmhost_venv_dir": str(VENV), "triton_http_port": 18000,
                                                  "triton_service_ready_timeout_s": 420}),
        "gRPC over TLS": ("triton", TRITON_UNIT, {**PUBLIC, **tls}),
        "plain gRPC": ("triton", TRITON_UNIT, PUBLIC),
        "probe, gRPC over TLS": ("smoke", SMOKE_UNIT, {**PUBLIC, **tls}),
        "probe, metrics address": ("smoke", SMOKE_UNIT, {**PUBLIC, "llmhost_metrics_bind_address": "127.0.0.2",
                                                         "triton_metrics_port": 9002}),
        "serve": ("triton", TRITON_UNIT, {
            "llmhost_venv_dir": str(VENV), "llmhost_triton_dir": str(root),
            "llmhost_model_repository_dir": str(root / "models"),
            "llmhost_bind_address": "0.0.0.0", "llmhost_allow_public_triton": True,
            "llmhost_metrics_bind_address": "127.0.0.2", "triton_http_port": 9000,
            "triton_grpc_port": 9001, "triton_metrics_port": 9002, "llmhost_drain_timeout_s": 45,
            "triton_service_log_verbose": 2, "triton_service_extra_args": SERVE_EXTRA}),
        "env cpu": environment("cpu", {}),
        "env compile": environment("compile", {"triton_service_cpu_torch_compile": True}),
        "env gpu": environment("gpu", {"llmhost_profile": "gpu"}),
        "env mine": environment("mine", {"triton_service_environment": {"TORCHDYNAMO_DISABLE": "0"}}),
    }


@dataclass
class Renders:
    folder: Path  # where render_cases put its files
    runs: dict[str, tuple[PlaybookRun, Path]]  # by case: its host's output, the rendered file

    def text(self, name: str) -> str:
        """The file rendered for case `name`, once its run passed."""
        run, out = self.runs[name]
        assert run.rc == 0, run.output
        return out.read_text()


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> Renders:
    """Every case of render_cases rendered as _render does (the role's preflight, then the
    template), all in one ansible-playbook run: one local host per case, its variables its
    host vars, a play per role."""
    folder = tmp_path_factory.mktemp("triton-renders")
    (folder / "grpc.crt").write_text("certificate\n")
    (folder / "grpc.key").write_text("key\n")
    cases = render_cases(folder)
    groups: dict[str, dict[str, Any]] = {"triton": {"hosts": {}}, "smoke": {"hosts": {}}}
    outs: dict[str, Path] = {}
    for i, (name, (role, template, variables)) in enumerate(cases.items()):
        outs[name] = folder / f"case-{i:03d}.out"
        groups[role]["hosts"][host_name(i)] = {
            "ansible_connection": "local", "ansible_python_interpreter": sys.executable, "llmhost_profile": "cpu",
            "llmhost_source_dir": str(REPO), **variables, "_render_src": str(template), "_render_dest": str(outs[name])}
    book = [{"hosts": role, "gather_facts": False,
             "tasks": [_include(role, "preflight.yml"),
                       {"name": "Render", "ansible.builtin.template":
                        {"src": "{{ _render_src }}", "dest": "{{ _render_dest }}", "mode": "0644"}}]}
            for role in groups]
    play = folder / "render.yml"
    play.write_text(yaml.safe_dump(book))
    runs = ansible_playbook_on_hosts({"all": {"children": groups}}, len(cases), str(play))
    return Renders(folder, {name: (run, outs[name]) for name, run in zip(cases, runs, strict=True)})


def _flag(argv: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]


@pytest.mark.parametrize("binds,want", BINDS)
def test_unit_binds_inference_and_metrics_apart_and_restricts_admin_apis(
        renders: Renders, binds: dict[str, Any], want: tuple[str, str]) -> None:
    unit = renders.text(f"binds {BINDS.index((binds, want))}")
    argv = _exec_start(unit)
    inference, metrics = want
    # HTTP (the API with Triton 2.51's CVEs) stays on loopback; gRPC follows llmhost_bind_address.
    assert _flag(argv, "http-address") == ["127.0.0.1"] and _flag(argv, "grpc-address") == [inference]
    assert _flag(argv, "metrics-address") == [metrics]
    # The flags llmhost serve passes, with systemd's expansion of the key file's variable.
    assert [a for a in argv if "-restricted-" in a] == restriction_args(f"${{{ENV_NAME}}}")
    # The key itself is never in the unit: systemd reads it from the root-only file.
    assert unit.count("EnvironmentFile=") == 2
    assert "EnvironmentFile=/etc/llmhost/tritonserver-admin-key.env" in unit.splitlines()
    # Each model instance's engine socket, in a folder the gateway's group may enter.
    assert "Environment=LLMHOST_ENGINE_SOCKET_DIR=%t/tritonserver/engine" in unit.splitlines()
    assert "RuntimeDirectoryMode=0750" in unit.splitlines()
    # Counts that outlive the restarts (engine hangs) in a state folder of the service's own.
    assert {"StateDirectory=tritonserver", "StateDirectoryMode=0750",
            "Environment=LLMHOST_STATE_DIR=%S/tritonserver"} <= set(unit.splitlines())


def test_a_start_that_never_answers_fails_within_the_ready_timeout(renders: Renders) -> None:
    """The unit's start ends once tritonserver answers on its HTTP address (the start
    check, run with the venv's python), bounded by triton_service_ready_timeout_s;
    systemd's own start timeout leaves the check time to say so first."""
    unit = renders.text("ready timeout")
    lines = unit.splitlines()
    posts = [shlex.split(ln.removeprefix("ExecStartPost=")) for ln in lines if ln.startswith("ExecStartPost=")]
    assert posts == [[f"{VENV}/bin/python", "-I", "-m", "llmhost.server.startcheck",
                      "--url", "http://127.0.0.1:18000", "--timeout-s", "420",
                      "--repository", "/opt/llmhost/models"]], unit
    assert "TimeoutStartSec=450" in lines and "Restart=always" in lines, unit
    # The check's arguments are the ones it takes.
    from llmhost.server import startcheck
    assert startcheck.main([*posts[0][4:6], "--timeout-s", "0.5", *posts[0][8:10]]) == 1


def test_grpc_over_tls_gets_the_certificate_as_credentials(renders: Renders) -> None:
    cert, key = renders.folder / "grpc.crt", renders.folder / "grpc.key"
    unit = renders.text("gRPC over TLS")
    argv = _exec_start(unit)
    assert ["--grpc-use-ssl=true", "--grpc-server-cert=%d/grpc-tls.crt", "--grpc-server-key=%d/grpc-tls.key"] == [
        a for a in argv if a.startswith(("--grpc-use-ssl", "--grpc-server-"))]
    assert f"LoadCredential=grpc-tls.crt:{cert}" in unit.splitlines()
    assert f"LoadCredential=grpc-tls.key:{key}" in unit.splitlines()
    plain = _exec_start(renders.text("plain gRPC"))
    assert not [a for a in plain if "ssl" in a or "server-cert" in a]
    probe = _exec_start(renders.text("probe, gRPC over TLS"))
    assert "--no-grpc" in probe and "--grpc-url" not in probe  # the probe speaks plaintext gRPC


# The gRPC TLS settings of test_grpc_tls_settings_are_checked_by_name and what the failure must say.
TLS_SETTINGS: list[tuple[dict[str, Any], str]] = [
    ({"triton_grpc_tls_cert_file": "/nonexistent/grpc.crt"}, "triton_grpc_tls_key_file must both be"),
    ({"triton_grpc_tls_cert_file": "/nonexistent/grpc.crt", "triton_grpc_tls_key_file": "/nonexistent/grpc.key"},
     "/nonexistent/grpc.crt (triton_grpc_tls_cert_file / triton_grpc_tls_key_file) is not a file"),
]


@pytest.fixture(scope="module")
def tls_preflights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PlaybookRun]:
    """The role's preflight.yml (as _play includes it) for each case of TLS_SETTINGS, on the network
    ("settings 0", "settings 1"), and for a certificate on loopback ("loopback"), in one
    ansible-playbook run: one local host per case, its variables its host vars."""
    folder = tmp_path_factory.mktemp("triton-tls")
    cert = folder / "grpc.crt"
    cert.write_text("certificate\n")
    public = {"llmhost_venv_dir": str(VENV), "llmhost_bind_address": "0.0.0.0", "llmhost_allow_public_triton": True}
    cases = {**{f"settings {i}": {**public, **extra} for i, (extra, _) in enumerate(TLS_SETTINGS)},
             "loopback": {"llmhost_venv_dir": str(VENV), "triton_grpc_tls_cert_file": str(cert),
                          "triton_grpc_tls_key_file": str(cert)}}
    hosts = {host_name(i): {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                            "llmhost_profile": "cpu", "llmhost_source_dir": str(REPO), **variables}
             for i, variables in enumerate(cases.values())}
    book = folder / "preflight.yml"
    book.write_text(yaml.safe_dump([{"hosts": "all", "gather_facts": False,
                                     "tasks": [_include("triton", "preflight.yml")]}]))
    runs = ansible_playbook_on_hosts({"all": {"hosts": hosts}}, len(cases), str(book))
    return dict(zip(cases, runs, strict=True))


@pytest.mark.parametrize("extra,needle", TLS_SETTINGS)
def test_grpc_tls_settings_are_checked_by_name(tls_preflights: dict[str, PlaybookRun], extra: dict[str, Any],
                                               needle: str) -> None:
    run = tls_preflights[f"settings {TLS_SETTINGS.index((extra, needle))}"]
    assert run.rc != 0 and needle in " ".join(run.output.split()), run.output[-3000:]


def test_grpc_tls_on_loopback_is_refused(tls_preflights: dict[str, PlaybookRun]) -> None:
    run = tls_preflights["loopback"]
    assert run.rc != 0 and "loopback stays plaintext" in " ".join(run.output.split()), run.output[-3000:]


def test_role_and_package_agree_on_header_apis_and_variable() -> None:
    private = load_yaml(REPO / "roles" / "triton" / "vars" / "main.yml")
    assert private["_triton_service_admin_header"] == HEADER
    assert tuple(private["_triton_service_restricted_apis"]) == RESTRICTED_APIS
    assert private["_triton_service_admin_key_var"] == ENV_NAME


def test_smoke_probe_reads_metrics_at_the_metrics_address(renders: Renders) -> None:
    unit = renders.text("probe, metrics address")
    argv = _exec_start(unit)
    assert argv[argv.index("--url") + 1] == "http://127.0.0.1:8000"
    assert argv[argv.index("--metrics-url") + 1] == "http://127.0.0.2:9002"
    assert argv[argv.index("--grpc-url") + 1] == "127.0.0.1:8001"
    assert "key" not in unit.lower()  # the probe uses no admin API


# What the unit's tritonserver command line has that llmhost serve's has not, on
# purpose: serve leaves --exit-on-error at Triton's default (true: a model that fails
# stops it, and serve reports that), the role sets triton_service_exit_on_error.
UNIT_ONLY = ["--exit-on-error=false"]


def test_unit_and_llmhost_serve_render_one_command_line(renders: Renders, tmp_path: Path) -> None:
    """Both render src/llmhost/server/templates/tritonserver.args.j2; from the same inputs
    they give the same argv, in the same order, but for UNIT_ONLY (the admin key is
    passed to serve as the unit's ${VAR}, which systemd expands)."""
    from llmhost.server.layout import TritonInstall
    from llmhost.server.serve import ServeOptions, server_command

    root = renders.folder / "llmhost"  # llmhost_triton_dir of the case "serve"
    extra = SERVE_EXTRA
    unit = renders.text("serve")
    opts = ServeOptions(model=tmp_path, host="0.0.0.0", http_host="127.0.0.1", metrics_host="127.0.0.2",
                        http_port=9000, grpc_port=9001,
                        metrics_port=9002, drain_timeout_s=45, log_verbose=2, triton_args=extra)
    triton = TritonInstall(server=root / "bin" / "tritonserver", python_backend=root / "backends" / "python",
                           stub=root / "stub")
    serve = server_command(triton, root, opts, "cpu", f"${{{ENV_NAME}}}")
    argv = _exec_start(unit)
    assert [a for a in argv if a not in UNIT_ONLY] == serve
    assert all(a in argv for a in UNIT_ONLY)


# -- the admin key tasks ------------------------------------------------------------------


def _key_play(tmp_path: Path, config_dir: Path) -> Path:
    extracted = tmp_path / "extracted"
    tasks = [
        _include("triton", "admin_key.yml"),
        # What the readiness wait sends (written here only to compare it).
        {"name": "Write what the role read", "ansible.builtin.copy":
            {"content": "{{ _triton_service_admin_key }}", "dest": str(extracted), "mode": "0600"},
         "no_log": True, "when": "not ansible_check_mode"},
        # The role's handler would restart a tritonserver this machine does not run.
        {"name": "Stop before handlers", "ansible.builtin.meta": "end_play"},
    ]
    return _play(tmp_path, tasks, {"llmhost_venv_dir": str(VENV), "triton_service_config_dir": str(config_dir)},
                 "admin-key")


def _run(book: Path, *args: str) -> PlaybookRun:
    run = ansible_playbook("-i", "localhost,", *args, str(book))
    assert run.rc == 0, run.output
    return run


@pytest.mark.skipif(os.geteuid() != 0, reason="the key file is root's: needs root")
def test_admin_key_is_made_once_root_only_and_never_printed(tmp_path: Path) -> None:
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    key_file = config_dir / "tritonserver-admin-key.env"
    book = _key_play(tmp_path, config_dir)

    dry = _run(book, "--check", "--diff", "-vvv")
    assert dry.recap()["localhost"]["changed"] == 1, dry.output
    assert not key_file.exists()

    first = _run(book, "-vvv")
    assert first.recap()["localhost"]["changed"] >= 1, first.output
    st = key_file.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, 0, 0)
    key = read_key(key_file)
    assert (tmp_path / "extracted").read_text() == key
    text = key_file.read_text()

    # Drift in mode or owner is repaired; the key stays.
    key_file.chmod(0o644)
    again = _run(book, "-vvv")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and key_file.read_text() == text
    steady = _run(book, "-vvv")
    assert steady.recap()["localhost"]["changed"] == 0, steady.output
    check = _run(book, "--check", "--diff", "-vvv")
    assert check.recap()["localhost"]["changed"] == 0, check.output
    for run in (dry, first, again, steady, check):
        assert key not in run.output
    assert json.dumps(key) not in first.output


def test_argument_specs_document_the_metrics_bind_address() -> None:
    spec = load_yaml(REPO / "roles" / "llmhost" / "meta" / "argument_specs.yml")["argument_specs"]["main"]
    option = spec["options"]["llmhost_metrics_bind_address"]
    assert option["type"] == "str" and option["default"] == "127.0.0.1"
    defaults = load_yaml(REPO / "roles" / "llmhost" / "defaults" / "main.yml")
    assert defaults["llmhost_metrics_bind_address"] == "127.0.0.1"


# -- the unit's environment ---------------------------------------------------------------


def _environment(renders: Renders, name: str) -> dict[str, str]:
    """The unit's environment file of the case `name` of render_cases, as a dict."""
    text = renders.text(name)
    pairs = [line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {key: json.loads(value) for key, value in pairs}


def test_a_cpu_host_runs_torch_eagerly_unless_asked(renders: Renders) -> None:
    """vLLM's sampler compiles its log-probability kernels with inductor, which needs a
    C++ compiler: a CPU host without one would lose its engine on the first request with
    `logprobs`, so the profile's default turns torch.compile off."""
    cpu = _environment(renders, "env cpu")
    assert cpu["TORCHDYNAMO_DISABLE"] == "1" and cpu["VLLM_TARGET_DEVICE"] == "cpu", cpu
    assert "TORCHDYNAMO_DISABLE" not in _environment(renders, "env compile")
    gpu = _environment(renders, "env gpu")
    assert "TORCHDYNAMO_DISABLE" not in gpu and "VLLM_TARGET_DEVICE" not in gpu, gpu
    # The inventory's own environment still wins.
    assert _environment(renders, "env mine")["TORCHDYNAMO_DISABLE"] == "0"
