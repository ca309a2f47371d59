"""roles/rolling/files/gateway_admin.py, the part of playbooks/rolling.yml that runs on a
gateway's host, against the real gateway app over HTTP: it finds the upstreams that are
the rolled host (its addresses, Triton's gRPC port), holds them, waits until their
requests in flight end, returns them and waits until they are in service; it reads the
key from the file the gateway role made, and reports a host without a gateway."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.keys import KeyStore, hash_key, parse_keys
from llmhost.gateway.routing.pool import PoolSettings, UpstreamPool
from tests.harness.net import free_port
from tests.harness.paths import ROOT
from tests.unit._gateway_fakes import KEY, Fake, make_app

ADMIN_KEY = "rolling-admin-key-0123456789"
A, B = "10.0.0.1:8001", "10.0.0.2:8001"


SCRIPT = ROOT / "roles" / "rolling" / "files" / "gateway_admin.py"


class Gateway:
    def __init__(self, pool: UpstreamPool, loop: asyncio.AbstractEventLoop, url: str) -> None:
        self.pool, self.loop, self.url = pool, loop, url

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    keys = KeyStore(parse_keys(json.dumps({"keys": [{"name": "alice", "sha256": hash_key(KEY)},
                                                    {"name": "llmhost-admin", "sha256": hash_key(ADMIN_KEY),
                                                     "admin": True}]})))
    pool = UpstreamPool([(A, Fake("a")), (B, Fake("b"))], ["m"], PoolSettings())
    app = make_app(pool, keys, config=GatewayConfig(upstreams=[A, B], models=["m"], max_body_bytes=4096))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.02)
    gw = Gateway(pool, loop, f"http://127.0.0.1:{port}")
    gw.run(pool.check())
    try:
        yield gw
    finally:
        server.should_exit = True
        thread.join(10)


def _admin_file(tmp_path: Path, url: str, key: str = ADMIN_KEY) -> Path:
    key_file = tmp_path / "admin-key"
    key_file.write_text(key)
    admin_file = tmp_path / "admin.json"
    admin_file.write_text(json.dumps({"url": url, "key_file": str(key_file)}))
    return admin_file


def _request(admin_file: Path, action: str, addresses: tuple[str, ...] = ("10.0.0.1",), **kw: Any) -> str:
    return json.dumps({"admin_file": str(admin_file), "action": action, "port": 8001,
                       "addresses": list(addresses), **kw})


def _run(request: str) -> tuple[int, dict[str, Any]]:
    """The script as the role runs it: `python -I -c <its text> <request>`."""
    r = subprocess.run([sys.executable, "-I", "-c", SCRIPT.read_text(), request], capture_output=True, text=True,
                       timeout=60, check=False)
    assert not r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout)


def test_hold_drain_return_in_service(gateway: Gateway, tmp_path: Path):
    admin_file = _admin_file(tmp_path, gateway.url)
    rc, out = _run(_request(admin_file, "hold"))
    assert rc == 0 and out["targets"] == [A] and out["changed"] is True, out
    assert [(m.target, m.held, m.state) for m in gateway.pool.members] == [(A, True, "draining"),
                                                                           (B, False, "in_service")]
    rc, out = _run(_request(admin_file, "hold"))
    assert rc == 0 and out["changed"] is False, out  # holding a held upstream changes nothing

    gateway.pool.members[0].outstanding = 2  # two requests still in flight on A
    rc, out = _run(_request(admin_file, "drained", timeout_s=0.2))
    assert rc == 0 and out["drained"] is False and out["upstreams"][0]["outstanding"] == 2, out
    gateway.pool.members[0].outstanding = 0
    rc, out = _run(_request(admin_file, "drained", timeout_s=5))
    assert rc == 0 and out["drained"] is True, out

    rc, out = _run(_request(admin_file, "return"))
    assert rc == 0 and out["changed"] is True and not gateway.pool.members[0].held, out
    rc, out = _run(_request(admin_file, "in_service", timeout_s=5))
    assert rc == 0 and out["in_service"] is True, out


def test_in_service_that_does_not_come_fails(gateway: Gateway, tmp_path: Path):
    gateway.pool.members[0].in_service = False
    rc, out = _run(_request(_admin_file(tmp_path, gateway.url), "in_service", timeout_s=0.3))
    assert rc == 1 and out["in_service"] is False and out["upstreams"][0]["state"] == "out", out


def test_only_upstreams_at_the_hosts_address_and_port_are_touched(gateway: Gateway, tmp_path: Path):
    admin_file = _admin_file(tmp_path, gateway.url)
    for addresses in (("10.0.0.3",), ("10.0.0.10", "10.0.0.1x")):
        rc, out = _run(_request(admin_file, "hold", addresses))
        assert rc == 0 and out["targets"] == [] and out["changed"] is False, out
    assert not any(m.held for m in gateway.pool.members)


def test_a_host_without_a_gateway_is_reported_and_skipped(tmp_path: Path):
    rc, out = _run(_request(tmp_path / "missing.json", "hold"))
    assert rc == 0 and out == {"gateway": False, "targets": [], "changed": False}


def test_a_key_that_is_not_an_admin_key_fails_naming_the_refusal(gateway: Gateway, tmp_path: Path):
    rc, out = _run(_request(_admin_file(tmp_path, gateway.url, key=KEY), "hold"))
    assert rc == 1 and "HTTP 403" in out["error"], out
    rc, out = _run(_request(_admin_file(tmp_path, f"http://127.0.0.1:{free_port()}"), "hold"))
    assert rc == 1 and "/admin/upstreams" in out["error"], out


def test_a_hold_that_would_leave_nothing_in_service_is_refused(gateway: Gateway, tmp_path: Path):
    """B is already held (a roll that failed there): holding A too would leave the gateway
    nothing to send requests to, so the hold is refused and A keeps serving."""
    admin_file = _admin_file(tmp_path, gateway.url)
    gateway.run(gateway.pool.hold(gateway.pool.members[1], True))
    rc, out = _run(_request(admin_file, "hold"))
    assert rc == 1 and "no upstream in service" in out["error"] and f"{B} (held)" in out["error"], out
    assert not gateway.pool.members[0].held
    # Once B is back, A may be held.
    gateway.run(gateway.pool.hold(gateway.pool.members[1], False))
    rc, out = _run(_request(admin_file, "hold"))
    assert rc == 0 and gateway.pool.members[0].held, out


def test_a_gateway_of_the_rolled_host_alone_lets_it_be_held(gateway: Gateway, tmp_path: Path):
    # Both upstreams are the rolled host's (no other to keep serving): held, as one host's roll must.
    rc, out = _run(_request(_admin_file(tmp_path, gateway.url), "hold", ("10.0.0.1", "10.0.0.2")))
    assert rc == 0 and out["targets"] == [A, B] and all(m.held for m in gateway.pool.members), out
