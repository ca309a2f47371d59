"""Booted systemd test hosts for llmhost: Debian 12 under systemd-nspawn.

A pristine Debian 12 root filesystem is built once with debootstrap and cached.
Each host boots a fresh overlayfs copy of it with systemd as PID 1, shares the
host's network, and runs sshd on 127.0.0.1:<port> so that Ansible reaches it the
way it reaches a real server (SSH, become, systemd, apt).

``python -m tests.harness SUBCOMMAND`` (see ``--help`` of each), from the repository's root:

    rootfs      build (once) and cache the pristine root filesystem
    up          boot a host (reuses a running host of the same name)
    down        stop a host and remove everything it left (idempotent)
    exec        run a command inside a host, passing its exit status through
    status      JSON for a running host, exit 1 when it is not running
    list        JSON list of the hosts that have state
    gc          take down hosts whose nspawn or whose owner process is gone
    pip-config  the host's pip configuration (find-links, indexes) as JSON

Nothing here names a package mirror: debootstrap uses the first URI of the
host's apt sources for the suite, and those sources are copied into the rootfs.
Only the standard library is used; run it with the system python3 as root.
The pieces are in tests/harness: rootfs, apt, nspawn, state, procs, ssh, pipconf.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.harness.nspawn import clean_env, host_down, host_exec, host_up, nsenter_cmd
from tests.harness.pipconf import pip_config, pip_role_vars
from tests.harness.procs import proc_alive
from tests.harness.rootfs import CACHE_ENV, DEFAULT_CACHE, build_rootfs, cache_dir
from tests.harness.shell import TestHostError, log
from tests.harness.ssh import ssh_key
from tests.harness.state import HostState, all_states, check_name, running_state, state_base


def cmd_rootfs(a: argparse.Namespace) -> int:
    path = build_rootfs(cache_dir(a.cache), a.mirror, force=a.force)
    print(json.dumps({"rootfs": str(path), "ssh_key": str(ssh_key(cache_dir(a.cache)))}))
    return 0


def cmd_up(a: argparse.Namespace) -> int:
    cache = cache_dir(a.cache)
    binds = list(a.bind_ro)
    if a.pip_binds:
        binds += pip_config()["bind"]
    st = host_up(
        cache,
        state_base(cache, a.state),
        check_name(a.name),
        a.ssh_port,
        binds,
        a.group,
        a.timeout,
        a.owner_pid,
        a.keep_on_failure,
    )
    print(json.dumps(st.public()))
    return 0


def cmd_down(a: argparse.Namespace) -> int:
    cache = cache_dir(a.cache)
    host_down(state_base(cache, a.state), check_name(a.name))
    return 0


def cmd_exec(a: argparse.Namespace) -> int:
    cache = cache_dir(a.cache)
    st = running_state(state_base(cache, a.state), check_name(a.name))
    cmd = list(a.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise TestHostError("exec: no command given (use: exec --name NAME -- CMD...)")
    assert st.leader is not None
    return subprocess.run(nsenter_cmd(st.leader, cmd), env=clean_env(), check=False).returncode


def cmd_status(a: argparse.Namespace) -> int:
    cache = cache_dir(a.cache)
    st = HostState.load(state_base(cache, a.state) / check_name(a.name))
    if st is None or not st.running():
        print(json.dumps({"name": a.name, "running": False}))
        return 1
    assert st.leader is not None
    r = host_exec(st.leader, ["systemctl", "is-system-running"], timeout=10)
    print(json.dumps({**st.public(), "running": True, "system_state": r.stdout.strip()}))
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    base = state_base(cache_dir(a.cache), a.state)
    print(json.dumps([{**st.public(), "running": st.running()} for st in all_states(base)]))
    return 0


def cmd_gc(a: argparse.Namespace) -> int:
    base = state_base(cache_dir(a.cache), a.state)
    for st in all_states(base):
        if a.prefix and not st.name.startswith(a.prefix):
            continue
        if st.owner_pid is not None:
            # An owned host may still be booting: only its owner's death makes it garbage.
            if proc_alive(st.owner_pid, st.owner_starttime):
                continue
            reason = f"owner pid {st.owner_pid} is gone"
        elif st.running():
            continue
        else:
            reason = "not running"
        log(f"gc: {st.name} ({reason})")
        host_down(base, st.name)
    return 0


def cmd_pip_config(a: argparse.Namespace) -> int:
    cfg = pip_config()
    if a.vars_file:
        Path(a.vars_file).parent.mkdir(parents=True, exist_ok=True)
        Path(a.vars_file).write_text(json.dumps(pip_role_vars(cfg), indent=2) + "\n")
    print(json.dumps(cfg))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.harness", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, state: bool = True) -> None:
        sp.add_argument("--cache", help=f"cache dir (default: ${CACHE_ENV} or {DEFAULT_CACHE})")
        if state:
            sp.add_argument("--state", help="directory holding the hosts' state dirs (default: CACHE/hosts)")

    sp = sub.add_parser("rootfs", help="build and cache the pristine Debian rootfs")
    common(sp, state=False)
    sp.add_argument("--mirror", help="debootstrap mirror (default: from the host's apt sources)")
    sp.add_argument("--force", action="store_true", help="rebuild even when cached")
    sp.set_defaults(func=cmd_rootfs)

    sp = sub.add_parser("up", help="boot a host (reuse it when running)")
    common(sp)
    sp.add_argument("--name", required=True)
    sp.add_argument("--ssh-port", type=int, required=True)
    sp.add_argument("--bind-ro", action="append", default=[], metavar="SRC[:DST]")
    sp.add_argument("--pip-binds", action="store_true", help="also bind the folders of the host's pip config")
    sp.add_argument("--group", action="append", default=[], help="inventory group for the host (repeatable)")
    sp.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for boot (default 120)")
    sp.add_argument("--owner-pid", type=int, help="`gc` takes the host down once this process is gone")
    sp.add_argument("--keep-on-failure", action="store_true", help="leave a failed host for debugging")
    sp.set_defaults(func=cmd_up)

    sp = sub.add_parser("down", help="stop a host and remove its state (idempotent)")
    common(sp)
    sp.add_argument("--name", required=True)
    sp.set_defaults(func=cmd_down)

    sp = sub.add_parser("exec", help="run a command inside a host (nsenter)")
    common(sp)
    sp.add_argument("--name", required=True)
    sp.add_argument("cmd", nargs=argparse.REMAINDER)
    sp.set_defaults(func=cmd_exec)

    sp = sub.add_parser("status", help="JSON for a running host; exit 1 when not running")
    common(sp)
    sp.add_argument("--name", required=True)
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("list", help="JSON list of hosts with state")
    common(sp)
    sp.set_defaults(func=cmd_list)

    sp = sub.add_parser("gc", help="take down hosts that are dead or whose owner process is gone")
    common(sp)
    sp.add_argument("--prefix", help="only hosts whose name starts with this")
    sp.set_defaults(func=cmd_gc)

    sp = sub.add_parser("pip-config", help="the host's pip index configuration as JSON")
    sp.add_argument("--vars-file", help="also write the python_env role's pip variables (YAML/JSON) here")
    sp.set_defaults(func=cmd_pip_config)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except TestHostError as exc:
        print(f"testhost: error: {exc}", file=sys.stderr)
        return 2
