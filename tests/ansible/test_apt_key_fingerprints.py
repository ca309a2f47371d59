"""apt repository keys checked by fingerprint: roles/common's apt_key.yml (which the CUDA
repository and Grafana's run before adding their repository) runs for real on this
machine with a key GnuPG makes: a key of another fingerprint is removed and the play
stops; the key's own fingerprint passes and the key stays. The defaults carry the
fingerprints of the CUDA and Grafana keys."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ansible._helpers import ROLES, ansible_playbook, load_yaml

pytestmark = pytest.mark.skipif(shutil.which("gpg") is None, reason="needs GnuPG to make a key")

CUDA_KEY = "EB693B3035CD5710E231E123A4B469963BF863CC"  # 3bf863cc.pub (NVIDIA/cuda-repo-management#39)
GRAFANA_KEY = "B53AE77BADB630A683046005963FA27710458545"  # apt.grafana.com since 2023-08-24


def _key(tmp_path: Path) -> tuple[Path, str]:
    home = tmp_path / "gnupg"
    home.mkdir(mode=0o700)
    env = {**os.environ, "GNUPGHOME": str(home)}
    run = {"env": env, "capture_output": True, "check": True, "timeout": 120}
    subprocess.run(["gpg", "--batch", "--passphrase", "", "--quick-generate-key", "repo <repo@example.invalid>",
                    "ed25519", "sign", "1d"], **run)
    listing = subprocess.run(["gpg", "--with-colons", "--fingerprint", "--list-keys"], text=True, **run).stdout
    fingerprint = next(line for line in listing.splitlines() if line.startswith("fpr:")).split(":")[9]
    key = tmp_path / "repo" / "key.asc"
    key.parent.mkdir()
    key.write_bytes(subprocess.run(["gpg", "--armor", "--export"], **run).stdout)
    return key, fingerprint


def _run(tmp_path: Path, key: Path, fingerprint: str):
    """roles/common's apt_key.yml on KEY (copied where a download would put it)."""
    keyring = tmp_path / "keyring.asc"
    shutil.copy(key, keyring)
    play = [{"hosts": "localhost", "gather_facts": False, "connection": "local",
             "vars": {"ansible_python_interpreter": sys.executable},
             "tasks": [{"name": "Check the key", "ansible.builtin.include_role": {
                 "name": "common", "tasks_from": "apt_key.yml"}}]}]
    book = tmp_path / "play.yml"
    book.write_text(json.dumps(play))
    variables = {"common_apt_key_file": str(keyring), "common_apt_key_fingerprint": fingerprint,
                 "common_apt_key_source": "https://repo.example.invalid/key.asc"}
    return ansible_playbook("-i", "localhost,", "-e", json.dumps(variables), str(book))


def test_a_key_of_another_fingerprint_is_removed_and_the_play_stops(tmp_path: Path):
    key, fingerprint = _key(tmp_path)
    run = _run(tmp_path, key, CUDA_KEY)
    assert run.rc != 0
    text = " ".join(run.output.split())
    assert (f"https://repo.example.invalid/key.asc is not the key with fingerprint {CUDA_KEY} (it has "
            f"{fingerprint})") in text, run.output[-3000:]
    assert not (tmp_path / "keyring.asc").exists()


def test_the_keys_own_fingerprint_passes_and_the_key_stays(tmp_path: Path):
    key, fingerprint = _key(tmp_path)
    spaced = " ".join(fingerprint[i:i + 4] for i in range(0, 40, 4)).lower()  # as gpg prints it
    run = _run(tmp_path, key, spaced)
    assert run.rc == 0, run.output[-3000:]
    assert "Assert the repository key has its fingerprint" in run.output
    assert (tmp_path / "keyring.asc").read_bytes() == key.read_bytes()


def test_the_defaults_carry_the_published_fingerprints():
    for role in ("nvidia_driver", "dcgm_exporter"):
        assert load_yaml(ROLES / role / "defaults" / "main.yml")[f"{role}_cuda_repo_key_fingerprint"] == CUDA_KEY
    assert load_yaml(ROLES / "grafana" / "defaults" / "main.yml")["grafana_apt_key_fingerprint"] == GRAFANA_KEY
