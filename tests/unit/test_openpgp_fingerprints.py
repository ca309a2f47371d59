"""filter_plugins/llmhost_openpgp: the fingerprints the roles check apt keys by agree
with GnuPG's own on keys GnuPG makes (armored and binary, RSA and ed25519), and a
file that is no key is refused by what is wrong with it."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from filter_plugins.llmhost_openpgp import OpenPgpError, fingerprints

pytestmark = pytest.mark.skipif(shutil.which("gpg") is None, reason="needs GnuPG to make keys")


def _gpg(home: Path, *args: str, data: bytes | None = None) -> bytes:
    env = {**os.environ, "GNUPGHOME": str(home)}
    return subprocess.run(["gpg", "--batch", "--quiet", "--pinentry-mode", "loopback", "--passphrase", "", *args],
                          input=data, env=env, capture_output=True, check=True, timeout=120).stdout


@pytest.fixture
def gnupg_home(tmp_path: Path) -> Iterator[Path]:
    """A GnuPG home of its own; the agent GnuPG starts for it is stopped afterwards."""
    home = tmp_path / "gnupg"
    home.mkdir(mode=0o700)
    yield home
    subprocess.run(["gpgconf", "--kill", "all"], env={**os.environ, "GNUPGHOME": str(home)},
                   capture_output=True, timeout=30, check=False)


@pytest.mark.parametrize("algo", ["ed25519", "rsa2048"])
def test_fingerprints_agree_with_gnupg(gnupg_home: Path, algo: str):
    home = gnupg_home
    _gpg(home, "--quick-generate-key", f"llmhost test {algo} <test@example.invalid>", algo, "sign", "1d")
    _gpg(home, "--quick-generate-key", "second key <second@example.invalid>", "ed25519", "sign", "1d")
    listing = _gpg(home, "--with-colons", "--fingerprint", "--list-keys").decode()
    want: list[str] = []
    lines = listing.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("pub:"):
            want.append(next(ln for ln in lines[i + 1:] if ln.startswith("fpr:")).split(":")[9])
    armored = _gpg(home, "--armor", "--export").decode()
    binary = _gpg(home, "--export")
    assert len(want) == 2
    assert fingerprints(armored) == want
    assert fingerprints(binary) == want
    assert fingerprints(armored.replace("\n", "\r\n")) == want


@pytest.mark.parametrize("text,error", [
    ("not a key at all", "does not start an OpenPGP packet"),
    ("-----BEGIN PGP PUBLIC KEY BLOCK-----\n\n!!!!\n-----END PGP PUBLIC KEY BLOCK-----\n", "base64"),
    ("-----BEGIN PGP PUBLIC KEY BLOCK-----\nno end", "armor"),
    ("-----BEGIN PGP PUBLIC KEY BLOCK-----\n\nzQ==\n-----END PGP PUBLIC KEY BLOCK-----\n", "cut short"),
])
def test_what_is_no_key_is_refused_by_name(text: str, error: str):
    with pytest.raises(OpenPgpError, match=error):
        fingerprints(text)
