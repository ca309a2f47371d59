"""`llmhost serve`'s tritonserver command line, rendered from the package's
templates/tritonserver.args.j2 (the triton role's unit renders the same template;
tests/ansible/test_triton.py compares the two): every flag, in order."""

from __future__ import annotations

from pathlib import Path

from llmhost.server.admin_key import restriction
from llmhost.server.layout import TritonInstall
from llmhost.server.serve import ServeOptions, server_command


def _triton(root: Path) -> TritonInstall:
    return TritonInstall(server=root / "bin" / "tritonserver", python_backend=root / "backends" / "python",
                         stub=root / "stub")


def test_serve_command_line_has_every_flag_in_order(tmp_path: Path) -> None:
    opts = ServeOptions(model=tmp_path, host="0.0.0.0", metrics_host="127.0.0.2", http_port=9000,
                        grpc_port=9001, metrics_port=9002, drain_timeout_s=45.5, log_verbose=2,
                        triton_args=["--http-thread-count=32", "--log-info=false"])
    key = "k" * 64
    assert server_command(_triton(tmp_path / "t"), tmp_path / "w", opts, "gpu", key) == [
        str(tmp_path / "t" / "bin" / "tritonserver"),
        f"--model-repository={tmp_path / 'w' / 'models'}",
        f"--backend-directory={tmp_path / 'w' / 'backends'}",
        "--http-address=0.0.0.0", "--http-port=9000",
        "--grpc-address=0.0.0.0", "--grpc-port=9001",
        "--metrics-address=127.0.0.2", "--metrics-port=9002",
        "--allow-gpu-metrics=true",
        "--exit-timeout-secs=75",
        "--strict-readiness=true",
        f"--http-restricted-api={restriction(key)}",
        f"--grpc-restricted-protocol={restriction(key)}",
        "--log-verbose=2",
        "--http-thread-count=32", "--log-info=false",
    ]


def test_serve_keeps_values_whole_and_leaves_exit_on_error_to_triton(tmp_path: Path) -> None:
    work = tmp_path / "a dir with spaces"
    cmd = server_command(_triton(tmp_path), work, ServeOptions(model=tmp_path, triton_args=["--log-file=/x y"]),
                         "cpu", "0" * 64)
    assert f"--model-repository={work / 'models'}" in cmd
    assert cmd[-1] == "--log-file=/x y"
    assert "--allow-gpu-metrics=false" in cmd
    assert not [a for a in cmd if a.startswith("--exit-on-error")]
