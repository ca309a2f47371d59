"""Hub tokens reach the downloads only through token files that are removed afterwards.

The model_repository role's staging (install.yml) runs for real on this machine
(inventory/localhost.yml, connection local) with `-vvv`: the real `hf` CLI of the
test venv downloads from a local stand-in for the Hugging Face hub (HF_ENDPOINT)
that records the Authorization header of each request, and a stand-in `modelscope`
CLI records what it was given. The fake tokens must arrive where they are needed
and appear nowhere in Ansible's output, on a command line, in the environment a
process starts with, or on disk after the run, whether the download works or not.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.ansible._helpers import REPO, PlaybookRun, ansible_playbook

TOKEN_PARENT = Path("/run")
TOKEN_PREFIX = "llmhost-hub-tokens-"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CONFIG = b'{"model_type": "llama"}\n'

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="staging writes root-owned directories and /run")


# -- a stand-in for the Hugging Face hub ------------------------------------------------


@dataclass
class FakeHub:
    url: str
    authorizations: list[tuple[str, str | None]] = field(default_factory=list)


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        """The hub API calls of `hf download`: revision info, file tree, HEAD and GET of a file.
        Repositories under `denied/` answer 401, as the hub does for a token without access."""

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _reply(self, code: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            hub.authorizations.append((path, self.headers.get("Authorization")))
            json_type = {"Content-Type": "application/json"}
            if "/denied/" in path or path.startswith("/denied/"):
                self._reply(401, b'{"error": "Invalid credentials in Authorization header"}', json_type)
            elif path.startswith("/api/models/") and "/tree/" in path:
                tree = [{"type": "file", "path": "config.json", "size": len(CONFIG), "oid": "e-config"}]
                self._reply(200, json.dumps(tree).encode(), json_type)
            elif path.startswith("/api/models/") and "/revision/" in path:
                repo = path.removeprefix("/api/models/").split("/revision/")[0]
                info = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": "config.json"}]}
                self._reply(200, json.dumps(info).encode(), json_type)
            elif path.endswith(f"/resolve/{COMMIT}/config.json"):
                self._reply(200, CONFIG, {"X-Repo-Commit": COMMIT, "ETag": '"e-config"'})
            else:
                self._reply(404, b"{}", json_type)

        do_HEAD = do_GET

    return Handler


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    fake = FakeHub("")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()


# -- a venv with the real hf CLI and a recording modelscope CLI ------------------------

FAKE_MODELSCOPE = """\
import glob, hashlib, json, os, sys
args = sys.argv[1:]
assert args[0] == "download", args
opts = dict(zip(args[1::2], args[2::2]))
token = os.environ.get("MODELSCOPE_API_TOKEN")
files = glob.glob({parent!r} + "/" + {prefix!r} + "*/modelscope-token")
record = {{
    "token_sha256": hashlib.sha256(token.encode()).hexdigest() if token else None,
    "cmdline": open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode(),
    "start_environ": open("/proc/self/environ", "rb").read().replace(b"\\0", b" ").decode(),
    "token_file_modes": [oct(os.stat(f).st_mode & 0o777) for f in files],
    "token_dir_modes": [oct(os.stat(os.path.dirname(f)).st_mode & 0o777) for f in files],
    "opts": opts,
}}
with open({record!r}, "w") as f:
    json.dump(record, f)
os.makedirs(opts["--local_dir"], exist_ok=True)
with open(os.path.join(opts["--local_dir"], "config.json"), "w") as f:
    f.write('{{"model_type": "llama"}}')
"""


def fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv directory for the role: bin/hf is the test venv's, bin/python runs the test
    venv's Python, bin/modelscope records its arguments, environment and token."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    record = tmp_path / "modelscope-record.json"
    hf = Path(sys.executable).parent / "hf"
    assert hf.is_file(), f"{hf} is missing: huggingface_hub comes with vLLM (make setup)"
    (venv / "bin" / "hf").symlink_to(hf)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    modelscope = venv / "bin" / "modelscope"
    modelscope.write_text(f"#!{sys.executable}\n"
                          + FAKE_MODELSCOPE.format(parent=str(TOKEN_PARENT), prefix=TOKEN_PREFIX, record=str(record)))
    for exe in (python, modelscope):
        exe.chmod(0o755)
    return venv, record


@dataclass
class Staging:
    run: PlaybookRun
    hf_token: str
    ms_token: str
    weights: Path
    record: Path


def stage(tmp_path: Path, hub: FakeHub, models: list[dict[str, Any]], *args: str) -> Staging:
    venv, record = fake_venv(tmp_path)
    hf_token = "hf_llmhostFAKE" + secrets.token_hex(12)
    ms_token = "ms-llmhostFAKE" + secrets.token_hex(12)
    weights = tmp_path / "weights"
    variables = {
        "llmhost_profile": "cpu",
        "llmhost_venv_dir": str(venv),
        "llmhost_models": models,
        "model_repository_weights_dir": str(weights),
        "model_repository_hf_endpoint": hub.url,
        "model_repository_hf_token": hf_token,
        "model_repository_modelscope_token": ms_token,
        "model_repository_download_timeout_s": 120,
    }
    # The variables from a file: the tokens are not even on ansible-playbook's own command line.
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "vars.json").write_text(json.dumps(variables))
    book = tmp_path / "stage.yml"
    book.write_text(
        "- name: Stage the models' weights\n"
        "  hosts: inference\n"
        "  gather_facts: false\n"
        "  tasks:\n"
        "    - name: Stage\n"
        "      ansible.builtin.include_role:\n"
        "        name: model_repository\n"
        "        tasks_from: install.yml\n"
    )
    run = ansible_playbook("-vvv", "-i", "inventory/localhost.yml", "-e", f"@{private / 'vars.json'}", *args, str(book))
    return Staging(run, hf_token, ms_token, weights, record)


@pytest.fixture(autouse=True)
def _no_tokens_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connection local passes this environment on: no token or offline switch of the tester's."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE",
                 "MODELSCOPE_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def assert_tokens_nowhere(s: Staging, tmp_path: Path) -> None:
    for token in (s.hf_token, s.ms_token):
        assert token not in s.run.output, f"a token is in the -vvv output:\n{s.run.output}"
        # Nor on disk: the weights, Ansible's temporary files on the target and the controller.
        roots = [tmp_path, REPO / ".cache" / "ansible" / "tmp", Path.home() / ".ansible" / "tmp"]
        for root in roots:
            for path in root.rglob("*") if root.is_dir() else []:
                if path.is_file() and not path.is_relative_to(tmp_path / "private"):
                    with open(path, "rb") as f:
                        assert token.encode() not in f.read(), f"a token is in {path}"
    left = sorted(TOKEN_PARENT.glob(TOKEN_PREFIX + "*"))
    assert not left, f"token directories left behind: {left}"
    # The output is verbose enough to show a token had one been put in an environment:
    # -vvv prints the command each module runs with, environment first.
    assert "HF_TOKEN_PATH=" in s.run.output, s.run.output
    # The token files travel to the host through Ansible's temporary directory: made in the
    # home of the user Ansible runs as (mode 0700), never in a world-writable directory.
    made = set(re.findall(r'umask 77 && mkdir -p "` echo (\S+) `"', s.run.output))
    assert made == {str(Path.home() / ".ansible" / "tmp")}, made


def test_tokens_reach_both_hubs_through_files_only(tmp_path: Path, hub: FakeHub) -> None:
    s = stage(tmp_path, hub, [
        {"name": "open", "source": "huggingface", "repo": "org/open", "revision": "main"},
        {"name": "scope", "source": "modelscope", "repo": "org/scope", "revision": "master"},
    ])
    assert s.run.rc == 0, s.run.output
    # Hugging Face: every request of the download carried the token (read from HF_TOKEN_PATH).
    model_requests = [auth for path, auth in hub.authorizations if "org/open" in path]
    assert model_requests, hub.authorizations
    assert set(model_requests) == {f"Bearer {s.hf_token}"}, model_requests
    assert (s.weights / "open" / "hf-main" / "config.json").read_bytes() == CONFIG
    # ModelScope: the CLI found the token in its environment, set inside the process from
    # the token file (mode 0600 in a directory of mode 0700), and not on a command line or
    # in the environment the process was started with.
    record = json.loads(s.record.read_text())
    assert record["token_sha256"] == hashlib.sha256(s.ms_token.encode()).hexdigest(), record
    assert s.ms_token not in record["cmdline"] and s.ms_token not in record["start_environ"], record
    assert s.hf_token not in record["cmdline"] and s.hf_token not in record["start_environ"], record
    assert record["token_file_modes"] == ["0o600"] and record["token_dir_modes"] == ["0o700"], record
    assert record["opts"]["--model"] == "org/scope"
    assert (s.weights / "scope" / "ms-master" / "config.json").is_file()
    assert_tokens_nowhere(s, tmp_path)


def test_tokens_are_removed_when_the_download_fails(tmp_path: Path, hub: FakeHub) -> None:
    s = stage(tmp_path, hub, [{"name": "gated", "source": "huggingface", "repo": "denied/gated", "revision": "main"}])
    assert s.run.rc != 0, s.run.output
    failure = s.run.failure()
    assert "Staging the weights of gated failed" in failure, failure
    # The hub's answer (the download is no longer no_log: nothing secret is in it) and the advice.
    assert "401 Unauthorized" in failure and "The hub refused access" in failure, failure
    assert [auth for path, auth in hub.authorizations if "denied/gated" in path][:1] == [f"Bearer {s.hf_token}"]
    assert not (s.weights / "gated" / "hf-main").exists()
    assert_tokens_nowhere(s, tmp_path)


def test_check_mode_writes_no_token_and_downloads_nothing(tmp_path: Path, hub: FakeHub) -> None:
    s = stage(tmp_path, hub, [
        {"name": "open", "source": "huggingface", "repo": "org/open", "revision": "main"},
        {"name": "scope", "source": "modelscope", "repo": "org/scope", "revision": "master"},
    ], "--check", "--diff")
    assert s.run.rc == 0, s.run.output
    assert s.run.recap()["localhost"]["failed"] == 0, s.run.output
    assert not hub.authorizations and not s.record.exists()
    for token in (s.hf_token, s.ms_token):
        assert token not in s.run.output, s.run.output
    assert not sorted(TOKEN_PARENT.glob(TOKEN_PREFIX + "*"))
