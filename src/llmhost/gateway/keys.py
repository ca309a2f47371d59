"""API keys: named, stored as SHA-256 hashes, checked in constant time.

The keys file (JSON or YAML) holds only hashes, never a key::

    keys:
      - name: alice
        sha256: 2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae
        max_tokens: 256        # optional: the largest max_tokens this key may ask for
        rpm: 60                # optional: requests per minute (a token bucket, a minute's burst)
        tpm: 100000            # optional: tokens per minute, prompt + completion (a token bucket)
        max_concurrent: 4      # optional: requests and streams of this key in flight at once
        models: [tiny]         # optional: the only models this key may use (default: every one)

Over ``rpm``, ``tpm`` or ``max_concurrent`` a request gets 429 (see ``limits``). A
model outside a key's ``models`` is, to that key, a model that does not exist (404,
and absent from ``/v1/models``).

``llmhost gateway hash-key`` prints the hash of a key read from stdin.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
# A key shorter than this is refused by hash-key: guessable.
MIN_KEY_CHARS = 16
# The optional per-key limits, all positive integers.
_LIMITS = ("max_tokens", "rpm", "tpm", "max_concurrent")


class KeysError(ValueError):
    """The keys file is unusable; the message names the entry and the field."""


@dataclass(frozen=True)
class ApiKey:
    name: str
    sha256: str
    max_tokens: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    models: frozenset[str] | None = None  # None: every served model
    admin: bool = False  # may use /admin: hold an upstream out of the pool and return it

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


def hash_key(key: str) -> str:
    """The hex SHA-256 of a key, as the keys file stores it."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _entry(i: int, raw: Any) -> ApiKey:
    where = f"keys[{i}]"
    if not isinstance(raw, dict):
        raise KeysError(f"{where} must be a mapping with 'name' and 'sha256'")
    extra = sorted(set(raw) - {"name", "sha256", "models", "admin", *_LIMITS})
    if extra:
        raise KeysError(f"{where} has unknown field(s) {extra}; allowed: name, sha256, {', '.join(_LIMITS)}, "
                        "models, admin")
    name, digest = raw.get("name"), raw.get("sha256")
    if not isinstance(name, str) or not _NAME.match(name):
        raise KeysError(f"{where}.name must be 1-64 letters, digits or _.@- (got {type(name).__name__})")
    if not isinstance(digest, str) or not _HEX64.match(digest.lower()):
        raise KeysError(f"{where}.sha256 must be 64 hex digits (the output of `llmhost gateway hash-key`)")
    limits = {}
    for field in _LIMITS:
        value = raw.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise KeysError(f"{where}.{field} must be a positive integer")
        limits[field] = value
    models = raw.get("models")
    if models is not None and (not isinstance(models, list) or not models
                               or not all(isinstance(m, str) and m for m in models)):
        raise KeysError(f"{where}.models must be a non-empty list of model names")
    admin = raw.get("admin", False)
    if not isinstance(admin, bool):
        raise KeysError(f"{where}.admin must be true or false")
    return ApiKey(name, digest.lower(), **limits, models=frozenset(models) if models is not None else None,
                  admin=admin)


def parse_keys(text: str, source: str = "keys file") -> list[ApiKey]:
    """Keys from JSON or YAML text (JSON is YAML, but JSON is tried first)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        from llmhost.gateway.config import load_yaml

        try:
            data = load_yaml(text)
        except ValueError as exc:
            raise KeysError(f"{source} is neither JSON nor YAML{exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise KeysError(f"{source} must be a mapping with a 'keys' list")
    extra = sorted(set(data) - {"keys"})
    if extra:
        raise KeysError(f"{source} has unknown top-level field(s) {extra}")
    keys = [_entry(i, raw) for i, raw in enumerate(data["keys"])]
    seen: set[str] = set()
    for k in keys:
        if k.name in seen:
            raise KeysError(f"{source} names key '{k.name}' twice")
        seen.add(k.name)
    if len({k.sha256 for k in keys}) != len(keys):
        raise KeysError(f"{source} holds the same key hash twice")
    return keys


def load_keys(path: Path) -> list[ApiKey]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KeysError(f"cannot read the keys file: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise KeysError("the keys file is not UTF-8 text") from None
    return parse_keys(text)


class KeyStore:
    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = list(keys)

    def find(self, presented: str) -> ApiKey | None:
        """The key whose hash matches; every stored hash is compared, in constant time."""
        digest = hash_key(presented).encode()
        found = None
        for k in self.keys:
            if hmac.compare_digest(digest, k.sha256.encode()):
                found = k
        return found

    def authenticate(self, authorization: str | None) -> ApiKey:
        from llmhost.gateway.errors import unauthorized

        if not authorization:
            raise unauthorized("missing API key: send the header 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized("the Authorization header must be 'Bearer <key>'")
        key = self.find(token.strip())
        if key is None:
            raise unauthorized("incorrect API key")
        return key
