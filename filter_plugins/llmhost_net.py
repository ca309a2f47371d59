"""Filters that turn the address a service binds into the address to reach it on the host itself.

    {{ '0.0.0.0' | llmhost_local_host }}        -> 127.0.0.1
    {{ '::' | llmhost_local_host }}             -> [::1]
    {{ 'fd00::5' | llmhost_local_host }}        -> [fd00::5]   (ready for a URL)
    {{ ':9100' | llmhost_local_address }}       -> 127.0.0.1:9100
    {{ '[::]:9100' | llmhost_local_address }}   -> [::1]:9100
    {{ 'fd00::5' | llmhost_host_port(8080) }}   -> [fd00::5]:8080

The roles check their services from the host they run on (readiness waits, the
smoke probe, Grafana's datasource): a wildcard bind is reached on loopback.
"""

from __future__ import annotations

from typing import Any

_ANY_V4 = ("", "0.0.0.0", "*")
_ANY_V6 = ("::", "[::]")


def url_host(host: Any) -> str:
    """A host for a URL or HOST:PORT: IPv6 addresses in brackets."""
    host = str(host).strip()
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def local_host(bind: Any) -> str:
    """The host to reach a service bound to ``bind`` (an address, or a wildcard) from the host itself."""
    bind = str(bind).strip()
    if bind in _ANY_V4:
        return "127.0.0.1"
    if bind in _ANY_V6:
        return "[::1]"
    return url_host(bind)


def local_address(listen: Any) -> str:
    """HOST:PORT to reach a service listening on ``listen`` (HOST:PORT, HOST may be empty) from the host itself."""
    host, _, port = str(listen).strip().rpartition(":")
    return f"{local_host(host)}:{port}"


def host_port(host: Any, port: Any) -> str:
    return f"{url_host(host)}:{port}"


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"llmhost_local_host": local_host, "llmhost_local_address": local_address,
                "llmhost_host_port": host_port}
