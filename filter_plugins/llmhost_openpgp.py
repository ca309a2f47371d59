"""The fingerprints of the OpenPGP primary keys in a key file (armored or binary), so
that the roles can check an apt repository's key against a fingerprint the inventory
gives before apt trusts it:

    {{ key_text | llmhost_openpgp_fingerprints }}   -> ['EB693B30...3BF863CC', ...]

Upper-case hex, one per primary key (packet tag 6): version 4 keys by SHA-1 of the
key packet, versions 5 and 6 by SHA-256 (RFC 4880 12.2, RFC 9580 5.5.4). A file that
is not OpenPGP key material raises an error naming what is wrong.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from typing import Any

_PUBLIC_KEY = 6


class OpenPgpError(ValueError):
    pass


def _dearmor(text: str) -> bytes:
    lines = text.strip().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("-----BEGIN PGP PUBLIC KEY BLOCK"))
        end = next(i for i, line in enumerate(lines) if i > start and line.startswith("-----END PGP"))
    except StopIteration:
        raise OpenPgpError("no '-----BEGIN PGP PUBLIC KEY BLOCK-----' ... '-----END' armor") from None
    body = lines[start + 1:end]
    if "" in [line.strip() for line in body]:  # armor headers end at the first blank line
        body = body[[line.strip() for line in body].index("") + 1:]
    data = "".join(line.strip() for line in body if not line.startswith("="))
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error:
        raise OpenPgpError("the armored key is not valid base64") from None


def _packets(data: bytes) -> list[tuple[int, bytes]]:
    out, i = [], 0
    while i < len(data):
        first = data[i]
        if not first & 0x80:
            raise OpenPgpError(f"byte {i} does not start an OpenPGP packet")
        if first & 0x40:  # new format
            tag, i = first & 0x3F, i + 1
            if i >= len(data):
                raise OpenPgpError("a packet is cut short")
            octet = data[i]
            if octet < 192:
                length, i = octet, i + 1
            elif octet < 224:
                if i + 1 >= len(data):
                    raise OpenPgpError("a packet is cut short")
                length, i = ((octet - 192) << 8) + data[i + 1] + 192, i + 2
            elif octet == 255:
                length, i = int.from_bytes(data[i + 1:i + 5], "big"), i + 5
            else:
                raise OpenPgpError("partial packet lengths do not occur in key files")
        else:  # old format
            tag, kind, i = (first >> 2) & 0x0F, first & 0x03, i + 1
            if kind == 3:
                length = len(data) - i
            else:
                size = (1, 2, 4)[kind]
                length, i = int.from_bytes(data[i:i + size], "big"), i + size
        if i + length > len(data):
            raise OpenPgpError("a packet is cut short")
        out.append((tag, data[i:i + length]))
        i += length
    return out


def fingerprints(key: Any) -> list[str]:
    """The primary keys' fingerprints in KEY (armored text or bytes)."""
    if isinstance(key, str) and "-----BEGIN" in key:
        data = _dearmor(key)
    elif isinstance(key, str):
        data = key.encode("latin-1")
    else:
        data = bytes(key)
    found = []
    for tag, body in _packets(data):
        if tag != _PUBLIC_KEY:
            continue
        if not body:
            raise OpenPgpError("an empty public key packet")
        if body[0] == 4:
            found.append(hashlib.sha1(b"\x99" + len(body).to_bytes(2, "big") + body, usedforsecurity=False)
                         .hexdigest().upper())
        elif body[0] in (5, 6):
            prefix = b"\x9a" if body[0] == 5 else b"\x9b"
            found.append(hashlib.sha256(prefix + len(body).to_bytes(4, "big") + body).hexdigest().upper())
        else:
            raise OpenPgpError(f"public key version {body[0]} is not supported")
    if not found:
        raise OpenPgpError("no public key in it")
    return found


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"llmhost_openpgp_fingerprints": fingerprints}
