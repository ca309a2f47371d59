"""Triton 2.51 is exposed beyond the host only when the inventory says so on purpose.

The bundled Triton has unauthenticated CVEs (fixed in Triton 25.07), so preflight
refuses an llmhost_bind_address other than loopback unless
llmhost_allow_public_triton is true, naming the variable and the CVEs. Each case is
the serving preflight in check mode against this machine (see test_preflight).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.ansible._helpers import PlaybookRun
from tests.ansible.test_preflight import assert_fails_naming, preflight

CVES = ("CVE-2025-23310", "CVE-2025-23311", "CVE-2025-23317", "CVE-2025-23319", "CVE-2025-23320", "CVE-2025-23334")
CASES: dict[str, dict[str, Any]] = {
    "every interface": {"llmhost_bind_address": "0.0.0.0"},
    "every IPv6 interface": {"llmhost_bind_address": "::"},
    "a private address": {"llmhost_bind_address": "10.0.0.11"},
    "acknowledged": {"llmhost_bind_address": "0.0.0.0", "llmhost_allow_public_triton": True},
    "loopback": {"llmhost_bind_address": "127.0.0.2"},
    "IPv6 loopback": {"llmhost_bind_address": "::1"},
}
REFUSED = ["every interface", "every IPv6 interface", "a private address"]
ALLOWED = ["acknowledged", "loopback", "IPv6 loopback"]


@pytest.fixture(scope="module")
def runs() -> dict[str, PlaybookRun]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(preflight, override) for name, override in CASES.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", REFUSED)
def test_a_public_address_is_refused_naming_the_switch_and_the_cves(runs: dict[str, PlaybookRun], name: str) -> None:
    address = CASES[name]["llmhost_bind_address"]
    assert_fails_naming(runs[name], f'llmhost_bind_address is "{address}"', "llmhost_allow_public_triton", *CVES,
                        "fixed in Triton 25.07")


@pytest.mark.parametrize("name", ALLOWED)
def test_loopback_or_an_acknowledged_public_address_passes(runs: dict[str, PlaybookRun], name: str) -> None:
    assert runs[name].rc == 0, runs[name].output
