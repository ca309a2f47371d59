#!/usr/bin/python
"""The CA the play makes for Triton's gRPC between hosts, on the controller.

Keeps a CA (an EC P-256 key, ca.key, 0600, and its certificate, ca.crt) in a directory
of the controller, making it when it is missing; the CA key never leaves that
directory. Given a host's public key (the host makes and keeps its private key), it
returns a certificate for it signed by the CA: the current one when it is still good
(signed by this CA, for this key, with exactly these names, and not within
renew_before_days of its end), a new one otherwise. In check mode it writes nothing
and signs with a CA in memory where none exists yet (for --diff).

Runs with the controller's Python, on the `cryptography` library that ansible-core
itself depends on.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: llmhost_grpc_pki
short_description: llmhost's CA for Triton's gRPC, and certificates it signs (on the controller)
description:
  - Makes the CA once in I(pki_dir) (ca.key 0600, ca.crt) and returns its certificate.
  - With I(public_key), returns a certificate for that key signed by the CA, reusing I(certificate) while it is
    signed by this CA for this key with exactly I(subject_alt_names) and valid beyond I(renew_before_days).
options:
  pki_dir: {type: path, required: true, description: The CA's directory on the controller (made 0700).}
  ca_common_name: {type: str, default: llmhost gRPC CA, description: The CA's subject.}
  ca_valid_days: {type: int, default: 3650, description: Days a new CA is valid.}
  public_key: {type: str, default: "", description: The host's public key (PEM); empty makes the CA only.}
  certificate: {type: str, default: "", description: The host's current certificate (PEM), if any.}
  common_name: {type: str, default: "", description: The certificate's subject.}
  subject_alt_names: {type: list, elements: str, default: [], description: IP addresses and DNS names.}
  valid_days: {type: int, default: 365, description: Days a new certificate is valid.}
  renew_before_days: {type: int, default: 30, description: A certificate ending within this many days is remade.}
"""

RETURN = r"""
ca_certificate: {type: str, description: The CA's certificate (PEM).}
certificate: {type: str, description: The host's certificate (PEM); empty without I(public_key).}
reasons: {type: list, description: Why the certificate was made (empty when the current one is kept).}
"""

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    HAS_CRYPTOGRAPHY = True
except ImportError:  # pragma: no cover - ansible-core depends on cryptography
    HAS_CRYPTOGRAPHY = False

CA_KEY = "ca.key"
CA_CERT = "ca.crt"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _not_after(cert: x509.Certificate) -> datetime.datetime:
    end = getattr(cert, "not_valid_after_utc", None)
    if end is None:  # cryptography < 42
        end = cert.not_valid_after.replace(tzinfo=datetime.timezone.utc)
    return end


def _general_name(name: str) -> x509.GeneralName:
    bare = name.strip("[]")
    try:
        return x509.IPAddress(ipaddress.ip_address(bare))
    except ValueError:
        return x509.DNSName(bare)


def _names(values: list[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for value in values:
        name = _general_name(value)
        if name not in out:
            out.append(name)
    return out


def _spki(key: Any) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _new_ca(common_name: str, days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                          encipher_only=False, decipher_only=False),
            critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _load_or_make_ca(module: AnsibleModule, pki_dir: Path) -> tuple[Any, x509.Certificate, bool]:
    key_path, cert_path = pki_dir / CA_KEY, pki_dir / CA_CERT
    if key_path.exists() and cert_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        if _spki(key.public_key()) != _spki(cert.public_key()):
            module.fail_json(msg=f"{key_path} and {cert_path} (llmhost_pki_dir) are not one key pair")
        return key, cert, False
    if key_path.exists() or cert_path.exists():
        module.fail_json(msg=f"{pki_dir} (llmhost_pki_dir) holds one of {CA_KEY} and {CA_CERT} without the other: "
                             "restore the missing one, or remove both to make a new CA")
    key, cert = _new_ca(module.params["ca_common_name"], module.params["ca_valid_days"])
    if not module.check_mode:
        pki_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()), 0o600)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return key, cert, True


def _why_renew(current: str, ca_key: Any, ca_cert: x509.Certificate, public_key: Any,
               names: list[x509.GeneralName], renew_days: int) -> list[str]:
    if not current.strip():
        return ["no certificate"]
    try:
        cert = x509.load_pem_x509_certificate(current.encode())
    except ValueError:
        return ["the certificate is not PEM"]
    reasons: list[str] = []
    try:
        if cert.issuer != ca_cert.subject or cert.signature_hash_algorithm is None:
            raise ValueError
        ca_key.public_key().verify(cert.signature, cert.tbs_certificate_bytes,
                                   ec.ECDSA(cert.signature_hash_algorithm))
    except Exception:  # noqa: BLE001 - any failure means "not signed by this CA"
        reasons.append("not signed by this CA")
    if _spki(cert.public_key()) != _spki(public_key):
        reasons.append("for another key")
    try:
        have = list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        have = []
    if set(have) != set(names):
        reasons.append("other names")
    if _not_after(cert) - _now() < datetime.timedelta(days=renew_days):
        reasons.append(f"ends within {renew_days} days")
    return reasons


def _sign(ca_key: Any, ca_cert: x509.Certificate, public_key: Any, common_name: str,
          names: list[x509.GeneralName], days: int) -> x509.Certificate:
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
                          encipher_only=False, decipher_only=False),
            critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "pki_dir": {"type": "path", "required": True},
            "ca_common_name": {"type": "str", "default": "llmhost gRPC CA"},
            "ca_valid_days": {"type": "int", "default": 3650},
            "public_key": {"type": "str", "default": ""},
            "certificate": {"type": "str", "default": ""},
            "common_name": {"type": "str", "default": ""},
            "subject_alt_names": {"type": "list", "elements": "str", "default": []},
            "valid_days": {"type": "int", "default": 365},
            "renew_before_days": {"type": "int", "default": 30},
        },
        supports_check_mode=True,
    )
    if not HAS_CRYPTOGRAPHY:
        module.fail_json(msg="the controller's Python lacks the cryptography library (ansible-core depends on it)")
    p = module.params
    ca_key, ca_cert, changed = _load_or_make_ca(module, Path(p["pki_dir"]))
    result: dict[str, Any] = {"ca_certificate": ca_cert.public_bytes(serialization.Encoding.PEM).decode(),
                              "certificate": "", "reasons": []}
    if p["public_key"].strip():
        names = _names(p["subject_alt_names"])
        if not names:
            module.fail_json(msg="subject_alt_names is empty: a certificate must name its host")
        public_key = serialization.load_pem_public_key(p["public_key"].encode())
        reasons = _why_renew(p["certificate"], ca_key, ca_cert, public_key, names, p["renew_before_days"])
        if reasons:
            cert = _sign(ca_key, ca_cert, public_key, p["common_name"] or p["subject_alt_names"][0], names,
                         p["valid_days"])
            result.update(certificate=cert.public_bytes(serialization.Encoding.PEM).decode(), reasons=reasons)
            changed = True
        else:
            result["certificate"] = p["certificate"]
    module.exit_json(changed=changed, **result)


if __name__ == "__main__":
    main()
