"""gRPC between hosts over TLS: a real tritonserver with --grpc-use-ssl (a certificate
from a small CA) on an address off loopback, and the gateway's upstream client: with
the CA it is answered; plaintext, or TLS with another CA, it is not. The same with the
certificate, key and CA file the roles' own tasks make (llmhost_grpc_tls_ca). The
gateway process itself refuses a CA file that holds no certificate, naming the flag."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from llmhost.gateway.app import upstream_ca
from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.upstreams.client import Upstream, UpstreamDown
from llmhost.server.layout import TritonInstall
from tests.ansible.test_grpc_pki import pki_book, run_book
from tests.harness.certs import issue
from tests.harness.net import free_port


def _host_address() -> str | None:
    """This machine's address off loopback (the one its default route uses), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # no packet is sent: only the route is looked up
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(address).is_loopback else address


class Tls:
    def __init__(self, target: str, ca: Path, other_ca: Path) -> None:
        self.target, self.ca, self.other_ca = target, ca, other_ca


def _address() -> str:
    address = _host_address()
    # Loopback upstreams stay plaintext by design, so TLS needs an address off loopback;
    # this machine and CI's have one (their default route's).
    assert address is not None, "this machine has no address off loopback to serve gRPC over TLS on"
    return address


@pytest.fixture(scope="module")
def triton_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tls]:
    address = _address()
    work = tmp_path_factory.mktemp("grpc-tls")
    ca = issue(work, "llmhost-grpc-ca", ca=True)
    other_ca = issue(work, "another-ca", ca=True).cert_path
    server = issue(work, "triton-grpc", address, issuer=ca)
    with _tritonserver(work, address, server.cert_path, server.key_path) as target:
        yield Tls(target, ca.cert_path, other_ca)


@pytest.fixture(scope="module")
def triton_play_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tls]:
    """tritonserver with the key and certificate the triton role's tasks made, and the CA
    file the gateway role's tasks installed (as root: the key is root's)."""
    # `make test` runs as root (the booted hosts need it too); the play's key is root's.
    assert os.geteuid() == 0, "the play's tasks make a root-owned key: run the tests as root"
    address = _address()
    work = tmp_path_factory.mktemp("grpc-play-tls")
    for folder in ("etc", "gw"):
        (work / folder).mkdir()
    run_book(pki_book(work, {"llmhost_bind_address": address, "gateway_upstreams": [f"{address}:8001"]}))
    cert, key = work / "etc" / "tritonserver-grpc-tls.crt", work / "etc" / "tritonserver-grpc-tls.key"
    other_ca = issue(work, "another-ca", ca=True).cert_path
    with _tritonserver(work, address, cert, key) as target:
        yield Tls(target, work / "gw" / "llmhost-grpc-ca.crt", other_ca)


@contextmanager
def _tritonserver(work: Path, address: str, cert: Path, key: Path) -> Iterator[str]:
    """tritonserver (an empty model repository) serving gRPC over TLS at ADDRESS; yields HOST:PORT."""
    (work / "models").mkdir()
    triton = TritonInstall.from_pytriton()
    port = free_port()
    cmd = [str(triton.server), f"--model-repository={work / 'models'}", "--http-address=127.0.0.1",
           f"--http-port={free_port()}", f"--grpc-address={address}", f"--grpc-port={port}",
           "--allow-metrics=false", "--allow-gpu-metrics=false", "--grpc-use-ssl=true",
           f"--grpc-server-cert={cert}", f"--grpc-server-key={key}"]
    env = dict(os.environ)
    if triton.libs is not None:
        env["LD_LIBRARY_PATH"] = f"{triton.libs}:{env.get('LD_LIBRARY_PATH', '')}"
    log = work / "tritonserver.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while "Started GRPCInferenceService" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.2)
        yield f"{address}:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _live(target: str, credentials: grpc.ChannelCredentials | None) -> bool:
    async def run() -> bool:
        channel = (grpc.aio.secure_channel(target, credentials) if credentials is not None
                   else grpc.aio.insecure_channel(target))
        async with channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            return bool((await stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=5)).live)

    return asyncio.run(run())


def test_the_gateway_reaches_triton_over_tls_with_the_ca(triton_tls: Tls):
    config = GatewayConfig(upstreams=[triton_tls.target], models=["m"], upstream_ca=triton_tls.ca)
    ca = upstream_ca(config, triton_tls.target)
    assert ca == triton_tls.ca.read_bytes()

    async def run() -> bool:
        upstream = Upstream(triton_tls.target, 5.0, ca=ca)
        try:
            return await upstream.model_ready("m")  # no such model: an answer, False
        finally:
            await upstream.close()

    assert asyncio.run(run()) is False
    assert _live(triton_tls.target, grpc.ssl_channel_credentials(root_certificates=ca))


def test_plaintext_or_another_ca_gets_no_answer(triton_tls: Tls):
    async def ready(ca: bytes | None) -> bool:
        upstream = Upstream(triton_tls.target, 5.0, ca=ca)
        try:
            return await upstream.model_ready("m")
        finally:
            await upstream.close()

    for ca in (None, triton_tls.other_ca.read_bytes()):
        with pytest.raises(UpstreamDown):
            asyncio.run(ready(ca))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _live(triton_tls.target, None)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_loopback_upstreams_stay_plaintext(tmp_path: Path):
    ca = issue(tmp_path, "ca", ca=True).cert_path
    config = GatewayConfig(upstreams=["127.0.0.1:8001", "[::1]:8001", "10.0.0.12:8001"], models=["m"],
                           upstream_ca=ca)
    assert upstream_ca(config, "127.0.0.1:8001") is None and upstream_ca(config, "[::1]:8001") is None
    assert upstream_ca(config, "10.0.0.12:8001") == ca.read_bytes()
    assert upstream_ca(GatewayConfig(models=["m"]), "10.0.0.12:8001") is None


@pytest.mark.parametrize("content", [b"", b"not a certificate\n", b"\xff\xfe"])
def test_the_gateway_refuses_a_ca_file_without_certificates(content: bytes, tmp_path: Path):
    keys = tmp_path / "keys.yml"
    keys.write_text("keys:\n  - name: t\n    sha256: '" + "0" * 64 + "'\n")
    bad = tmp_path / "ca.crt"
    bad.write_bytes(content)
    r = subprocess.run([str(Path(sys.executable).parent / "llmhost"), "gateway", "--keys-file", str(keys),
                        "--model", "m", "--upstream", "10.0.0.12:8001", "--upstream-ca", str(bad)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "--upstream-ca" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_plays_certificate_and_ca_carry_grpc_over_tls(triton_play_tls: Tls):
    """What llmhost_grpc_tls_ca makes: Triton serves with the host's certificate, the
    gateway's upstream client is answered with the CA file, not in plaintext nor with
    another CA."""
    ca = triton_play_tls.ca.read_bytes()

    async def ready(ca: bytes | None) -> bool:
        upstream = Upstream(triton_play_tls.target, 5.0, ca=ca)
        try:
            return await upstream.model_ready("m")  # no such model: an answer, False
        finally:
            await upstream.close()

    assert asyncio.run(ready(ca)) is False
    assert _live(triton_play_tls.target, grpc.ssl_channel_credentials(root_certificates=ca))
    for other in (None, triton_play_tls.other_ca.read_bytes()):
        with pytest.raises(UpstreamDown):
            asyncio.run(ready(other))
