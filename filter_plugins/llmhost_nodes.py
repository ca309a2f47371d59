"""Filters for models spread over several hosts (a model's ``nodes``: the head first).

    {{ llmhost_models | llmhost_served(inventory_hostname) }}
        the models this host serves in Triton: those without nodes, and those it heads
    {{ llmhost_models | llmhost_followed(inventory_hostname) }}
        the models whose workers it runs for another host's Triton, each with its node_rank
    {{ model | llmhost_node_layout(hostvars, 29500) }}
        what the model's model.json adds on every one of its hosts: vLLM's nnodes,
        node_rank (the head's, 0), master_addr and master_port, and the backend's
        followers and host_ip settings; {} for a model on one host

A host's address among a model's hosts is its ``llmhost_node_address`` (default: its
``ansible_host``, else its inventory name). The roles render the same model.json on
every host of the model; a follower takes its own rank and address from its unit
(llmhost follow --node-rank --host-ip).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any


def _nodes(model: Mapping[str, Any]) -> list[str]:
    nodes = model.get("nodes") or []
    return [str(n) for n in nodes] if isinstance(nodes, Sequence) and not isinstance(nodes, str) else []


def served(models: Sequence[Mapping[str, Any]], host: str) -> list[Mapping[str, Any]]:
    """The models HOST serves in its Triton: every model without nodes, and those HOST heads."""
    return [m for m in models if not _nodes(m) or _nodes(m)[0] == str(host)]


def followed(models: Sequence[Mapping[str, Any]], host: str) -> list[dict[str, Any]]:
    """The models HOST follows (in nodes, not first), each with ``node_rank``: its place in nodes."""
    out = []
    for m in models:
        nodes = _nodes(m)
        if str(host) in nodes[1:]:
            out.append({**m, "node_rank": nodes.index(str(host))})
    return out


def node_address(hostvars: Mapping[str, Any], host: str) -> str:
    """The address HOST has among a model's hosts."""
    seen = hostvars.get(host) or {}
    return str(seen.get("llmhost_node_address") or seen.get("ansible_host") or host)


def is_ip(value: Any) -> bool:
    """Whether VALUE is an IPv4 or IPv6 address (not a name)."""
    try:
        ipaddress.ip_address(str(value))
    except ValueError:
        return False
    return True


def node_problems(model: Mapping[str, Any], inference: Sequence[str]) -> list[str]:
    """What is wrong with a model's nodes and node_port ([] when nothing, or no nodes)."""
    nodes = model.get("nodes")
    if nodes is None:
        return []
    found = []
    if not isinstance(nodes, Sequence) or isinstance(nodes, str) or not all(isinstance(n, str) for n in nodes):
        return [f"nodes must be a list of inventory host names, got {nodes!r}"]
    if len(nodes) < 2:
        found.append(f"nodes needs two hosts or more (the head first), got {list(nodes)}")
    if len(set(nodes)) != len(nodes):
        found.append(f"nodes names a host twice: {list(nodes)}")
    outside = [n for n in nodes if n not in inference]
    if outside:
        found.append(f"nodes {', '.join(outside)} not in the inference group")
    port = model.get("node_port")
    if port is not None and (isinstance(port, bool) or not str(port).isdigit() or not 1 <= int(port) <= 65535):
        found.append(f"node_port must be a port (1-65535), got {port!r}")
    if int(model.get("instance_count", 1) or 1) != 1:
        found.append("instance_count must be 1 for a model across hosts (one engine spans its hosts)")
    own = sorted(set(model.get("engine_args") or {}) & {"nnodes", "node_rank", "master_addr", "master_port",
                                                       "headless", "distributed_executor_backend"})
    if own:
        found.append(f"engine_args sets {', '.join(own)}: the roles set these from nodes and node_port")
    return found


def node_layout(model: Mapping[str, Any], hostvars: Mapping[str, Any], default_port: Any) -> dict[str, Any]:
    """{'engine_args': {...}, 'settings': {...}} that a model across hosts adds to its
    model.json (the same on each of its hosts); {} for a model on one host."""
    nodes = _nodes(model)
    if len(nodes) < 2:
        return {}
    head = node_address(hostvars, nodes[0])
    port = int(model.get("node_port") or default_port)
    return {"engine_args": {"nnodes": len(nodes), "node_rank": 0, "master_addr": head, "master_port": port},
            "settings": {"followers": ",".join(node_address(hostvars, n) for n in nodes[1:]), "host_ip": head}}


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"llmhost_served": served, "llmhost_followed": followed, "llmhost_node_layout": node_layout,
                "llmhost_node_address": lambda host, hostvars: node_address(hostvars, host),
                "llmhost_is_ip": is_ip, "llmhost_node_problems": node_problems}
