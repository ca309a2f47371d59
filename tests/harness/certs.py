"""Certificates for TLS tests, made with `cryptography`: a CA, and certificates for an
IP address signed by a CA or by their own key (self-signed)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Issued:
    """A certificate and its key as PEM files, and as `cryptography` objects (to sign others)."""

    cert_path: Path
    key_path: Path
    cert: Any
    key: Any


def issue(folder: Path, name: str, host: str | None = None, issuer: Issued | None = None,
          ca: bool = False) -> Issued:
    """A certificate named NAME (FOLDER/NAME.crt and .key, one day valid): a CA's (CA
    true), or one for the IP address HOST (its subject alternative name); signed by
    ISSUER, or by its own key without one."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host or name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer.cert.subject if issuer is not None else subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1)))
    if ca:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
    if host is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]),
                                        critical=False)
    cert = builder.sign(issuer.key if issuer is not None else key, hashes.SHA256())
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return Issued(cert_path, key_path, cert, key)


def self_signed(folder: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A self-signed certificate for HOST and its key: FOLDER/gateway.crt and .key."""
    issued = issue(folder, "gateway", host)
    return issued.cert_path, issued.key_path
