"""Triton's admin APIs behind a host-local key.

tritonserver 2.51 can restrict groups of HTTP APIs (``--http-restricted-api``) and
gRPC protocols (``--grpc-restricted-protocol``) to requests that carry a header
with a given value. llmhost restricts every group but health, metadata and
inference, so a client that can reach the port can infer but cannot write the log
settings, start traces, register shared memory, list the repository or read
statistics and model configurations without the key.

The key lives in a file of one ``LLMHOST_TRITON_ADMIN_KEY=<hex>`` line: a systemd
EnvironmentFile (the triton role) that `llmhost serve` also uses.

Run as a script (``python -m llmhost.server.admin_key PATH``; stdlib only), it creates
PATH with a new key (mode 0600) unless PATH exists, and never prints the key.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from pathlib import Path

# The API groups that need the key (Triton's names, the same on HTTP and gRPC). Not
# model-config: reading a model's configuration changes nothing, config.pbtxt is
# world-readable on the host, and the gateway reads the LoRA adapters a model
# publishes there without holding the key.
RESTRICTED_APIS = ("model-repository", "statistics", "trace", "logging", "shared-memory")
# The HTTP header that carries the key; on gRPC Triton expects the metadata key
# triton-grpc-protocol-<HEADER>.
HEADER = "llmhost-admin-key"
GRPC_HEADER = f"triton-grpc-protocol-{HEADER}"
# The variable of the key file (and of the unit's environment).
ENV_NAME = "LLMHOST_TRITON_ADMIN_KEY"
# What a key may look like: Triton splits its flag at ':' ',' and '=', and systemd
# expands the variable into the command line, so letters and digits only.
_KEY = re.compile(r"[A-Za-z0-9]{32,256}")
KEY_BYTES = 32


class AdminKeyError(ValueError):
    """The key file is missing, unreadable or not in the expected form."""


def new_key() -> str:
    """A fresh key: 256 random bits as 64 hex digits."""
    return secrets.token_hex(KEY_BYTES)


def parse_key(text: str) -> str:
    """The key of a key file's text: a ``LLMHOST_TRITON_ADMIN_KEY=<key>`` line
    (comments and blank lines ignored; the value may be quoted) or the bare key."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    values = [ln.split("=", 1)[1].strip() for ln in lines if ln.startswith(f"{ENV_NAME}=")]
    if not values and len(lines) == 1 and "=" not in lines[0]:
        values = lines
    if len(values) != 1:
        raise AdminKeyError(f"expected one {ENV_NAME}=<key> line")
    key = values[0].strip("\"'")
    if not _KEY.fullmatch(key):
        raise AdminKeyError("the key must be 32 to 256 letters and digits")
    return key


def read_key(path: Path) -> str:
    try:
        text = path.read_text()
    except OSError as exc:
        raise AdminKeyError(f"cannot read the admin key file {path.name}: {exc.strerror}") from None
    try:
        return parse_key(text)
    except AdminKeyError as exc:
        raise AdminKeyError(f"admin key file {path.name}: {exc}") from None


def ensure_key_file(path: Path) -> tuple[str, bool]:
    """The key in PATH, creating PATH (mode 0600, a new key) if it does not exist.
    Returns (key, created)."""
    key = new_key()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_key(path), False
    except OSError as exc:
        raise AdminKeyError(f"cannot create the admin key file {path.name}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(f"# The key of tritonserver's admin APIs (header {HEADER}). Keep it secret.\n{ENV_NAME}={key}\n")
    return key, True


def restriction(key: str) -> str:
    """The value of tritonserver's *-restricted-* flags that puts RESTRICTED_APIS behind KEY."""
    return f"{','.join(RESTRICTED_APIS)}:{HEADER}={key}"


def restriction_args(key: str) -> list[str]:
    """tritonserver's flags that put RESTRICTED_APIS behind KEY on HTTP and gRPC."""
    return [f"--http-restricted-api={restriction(key)}", f"--grpc-restricted-protocol={restriction(key)}"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m llmhost.server.admin_key PATH  (creates PATH with a new key unless it exists)",
              file=sys.stderr)
        return 2
    try:
        _, created = ensure_key_file(Path(args[0]))
    except AdminKeyError as exc:
        print(f"llmhost admin key: {exc}", file=sys.stderr)
        return 1
    print("created" if created else "exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
