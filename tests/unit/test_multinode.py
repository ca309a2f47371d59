"""A model spread over several hosts: the head's watch on its followers, the
follower's watch on its head, and the settings and engine arguments they take."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmhost.backend.config import ConfigError, parse_model_config
from llmhost.backend.watchdog import FollowerWatch, connected_endpoints, connected_peers, resolve_followers
from llmhost.multinode import nodecheck
from llmhost.multinode.follower import HeadWatch, follower_engine_args
from llmhost.multinode.nodecheck import problems
from tests.harness.net import free_port


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_follower_watch_tells_once_a_follower_is_gone_for_its_grace():
    clock = Clock()
    watch = FollowerWatch(["10.0.0.2", "::ffff:10.0.0.3"], grace_s=2.0, clock=clock)
    assert watch.check({"10.0.0.2", "10.0.0.3"}) is None
    clock.now += 1.5
    assert watch.check({"10.0.0.2"}) is None  # 10.0.0.3 missing for 1.5 s: within the grace
    clock.now += 1.0
    assert watch.check({"10.0.0.2", "10.0.0.3"}) is None  # back: its clock starts again
    clock.now += 1.9
    assert watch.check({"10.0.0.3"}) is None
    clock.now += 0.2
    cause = watch.check({"10.0.0.3"})
    assert cause is not None and cause.startswith("its follower 10.0.0.2 has had no connection to it for 2 s")
    assert watch.check(set()) is None  # told once


def test_head_watch_waits_for_the_join_then_tells_once_the_store_connection_is_gone():
    clock = Clock()
    watch = HeadWatch(("10.0.0.1", 29500), grace_s=2.0, clock=clock)
    clock.now += 600
    assert watch.check([]) is None  # not joined yet: the head may still be starting
    assert watch.check([("10.0.0.1", 40000)]) is None  # another port of the head is not its store
    assert not watch.joined
    assert watch.check([("10.0.0.1", 29500), ("10.0.0.9", 1)]) is None
    assert watch.joined
    clock.now += 1.9
    assert watch.check([("10.0.0.1", 40000)]) is None
    clock.now += 0.1
    cause = watch.check([])
    assert cause is not None and "10.0.0.1:29500 has had no connection to this follower's workers for 2 s" in cause
    assert watch.check([]) is None


@pytest.mark.parametrize("name, value", [
    ("followers", "10.0.0.2,node-b.example"),
    ("followers", ""),
    ("host_ip", "10.0.0.1"),
    ("host_ip", "fd00::1"),
])
def test_addresses_are_taken(name: str, value: str):
    config = parse_model_config({"model": "/m", "llmhost": {name: value}})
    assert getattr(config.settings, name) == value


@pytest.mark.parametrize("name, value", [
    ("followers", "10.0.0.2, 10.0.0.3"),
    ("followers", "10.0.0.2;rm -rf"),
    ("followers", ["10.0.0.2"]),
    ("host_ip", 10),
])
def test_bad_addresses_are_refused_naming_the_setting(name: str, value: object):
    with pytest.raises(ConfigError, match=f"llmhost.{name} must be host names or addresses separated by commas"):
        parse_model_config({"model": "/m", "llmhost": {name: value}})


def test_follower_grace_is_a_number_of_seconds():
    assert parse_model_config({"model": "/m", "llmhost": {"follower_grace_s": 5}}).settings.follower_grace_s == 5.0
    with pytest.raises(ConfigError, match=re.escape("llmhost.follower_grace_s must be >= 0")):
        parse_model_config({"model": "/m", "llmhost": {"follower_grace_s": -1}})


def test_followers_resolve_to_addresses_and_an_unknown_name_is_a_config_error():
    assert resolve_followers("127.0.0.2, localhost") == ["127.0.0.2", socket.gethostbyname("localhost")]
    assert resolve_followers("") == []
    with pytest.raises(ConfigError, match=re.escape("llmhost.followers: cannot resolve 'no-such-host.invalid'")):
        resolve_followers("no-such-host.invalid")


HEAD = {"model": "/m", "pipeline_parallel_size": 2, "nnodes": 2, "master_addr": "10.0.0.1", "master_port": 29500}


def test_follower_engine_args_are_the_heads_with_its_rank():
    assert follower_engine_args(HEAD, 1) == {**HEAD, "node_rank": 1}


@pytest.mark.parametrize("change, rank, message", [
    ({"nnodes": 1}, 1, "nnodes must be an integer >= 2"),
    ({"nnodes": "2"}, 1, "nnodes must be an integer >= 2"),
    ({}, 0, "--node-rank must be 1..1"),
    ({}, 2, "--node-rank must be 1..1"),
    ({"master_addr": ""}, 1, "master_addr"),
    ({"master_port": None}, 1, "master_port"),
    ({"data_parallel_size": 2}, 1, "data_parallel_size > 1"),
])
def test_follower_refuses_what_is_no_multinode_layout(change: dict[str, object], rank: int, message: str):
    with pytest.raises(ConfigError, match=re.escape(message)):
        follower_engine_args({**HEAD, **change}, rank)


def test_follow_names_a_bad_model_json_and_exits_2(tmp_path: Path):
    model_json = tmp_path / "model.json"
    model_json.write_text('{"model": "/m", "nnodes": 1}')
    llmhost = str(Path(sys.executable).parent / "llmhost")
    done = subprocess.run([llmhost, "follow", "--model-json", str(model_json), "--node-rank", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "llmhost follow: model.json: nnodes must be an integer >= 2" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("family, listen, connect, seen", [
    ("AF_INET", "127.0.0.1", "127.0.0.1", "127.0.0.1"),
    ("AF_INET6", "::1", "::1", "::1"),
    ("AF_INET6", "127.0.0.1", "::ffff:127.0.0.1", "127.0.0.1"),  # IPv4-mapped in /proc/net/tcp6
])
def test_connections_of_this_process_tree_are_seen_with_their_peers(family: str, listen: str, connect: str,
                                                                     seen: str):
    # Only descendants count: this process's own connections (its end of the child's,
    # one to another listener) are not theirs.
    try:
        listener = socket.create_server((listen, 0), family=socket.AF_INET6 if ":" in listen else socket.AF_INET)
    except OSError as exc:
        pytest.skip(f"no {listen} here: {exc}")
    other = socket.create_server(("127.0.0.1", 0))
    mine = socket.create_connection(other.getsockname())
    port = listener.getsockname()[1]
    code = (f"import socket, time; s = socket.socket(socket.{family}); s.connect(({connect!r}, {port})); "
            "time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        conn, _ = listener.accept()
        deadline = time.monotonic() + 10
        while (seen, port) not in connected_endpoints(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert connected_endpoints(os.getpid()) == {(seen, port)}
        assert connected_peers(os.getpid()) == {seen}
        assert connected_endpoints(child.pid) == set()  # no descendants
        conn.close()
    finally:
        child.kill()
        child.wait()
        listener.close()
        mine.close()
        other.close()
    assert connected_endpoints(os.getpid()) == set()


def test_connected_endpoints_of_a_process_that_is_gone_are_none():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert connected_endpoints(child.pid) == set()


STOP_WORKERS = """
import json, subprocess, sys
from multiprocessing import shared_memory
import psutil
from llmhost.multinode.follower import _stop_workers
from llmhost.server.reaping import is_resource_tracker

shm = shared_memory.SharedMemory(create=True, size=4096)  # as vLLM's executor's queues: starts our tracker
worker = psutil.Process(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).pid)
_stop_workers(grace_s=5)
print(json.dumps({"shm": shm.name, "worker_running": worker.is_running(),
                  "trackers": [p.pid for p in psutil.Process().children() if is_resource_tracker(p)]}))
"""


def test_the_follower_ends_its_workers_and_leaves_its_tracker_to_unlink_its_shared_memory():
    done = subprocess.run([sys.executable, "-c", STOP_WORKERS], capture_output=True, text=True, timeout=60,
                          check=True)
    result = json.loads(done.stdout)
    assert not result["worker_running"]
    assert len(result["trackers"]) == 1  # still running when the workers were ended
    # The follower exited: its tracker unlinks what it left and ends.
    deadline = time.monotonic() + 10
    while (Path("/dev/shm") / result["shm"]).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (Path("/dev/shm") / result["shm"]).exists()


def test_the_follower_ends_its_workers_with_the_servers_reaping(monkeypatch: pytest.MonkeyPatch):
    from llmhost.multinode import follower

    ended: list[tuple[list[int], float]] = []
    monkeypatch.setattr(follower, "end_processes", lambda procs, grace_s: ended.append(([p.pid for p in procs],
                                                                                           grace_s)))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        follower._stop_workers(grace_s=3)
    finally:
        child.kill()
        child.wait()
    assert len(ended) == 1 and child.pid in ended[0][0] and ended[0][1] == 3


# -- nodecheck: what the hosts must agree on ------------------------------------------

def _facts(**change: object) -> dict[str, object]:
    base: dict[str, object] = {
        "vllm": "0.20.2", "torch": "2.9.0+cu129", "model": "/opt/llmhost/weights/big/main", "model_present": True,
        "gpus": 8, "interfaces": {"ens1": ["10.0.0.1"]}, "interface": "",
        "layout": {"tensor_parallel_size": 8, "pipeline_parallel_size": 2, "nnodes": 2}}
    return {**base, **change}


def test_hosts_that_agree_have_no_problem():
    assert problems({"a": _facts(), "b": _facts(interfaces={"ens1": ["10.0.0.2"]})}) == []


@pytest.mark.parametrize("b, message", [
    (_facts(vllm="0.20.1"), "different vLLM versions on the model's hosts: a 0.20.2, b 0.20.1"),
    (_facts(torch=""), "different torch versions on the model's hosts: a 2.9.0+cu129, b none"),
    (_facts(model_present=False),
     "the model's weights are missing on b: no config.json in /opt/llmhost/weights/big/main"),
    (_facts(gpus=4), "b has 4 GPU(s); the layout needs 8 on each host (16 ranks over 2 hosts)"),
    (_facts(interfaces={"ens1": ["10.0.0.2"], "ib0": ["10.1.0.2"]}),
     "b has several interfaces (ens1, ib0): name the one the model's hosts share"),
    (_facts(interface="ib0"), "b has no interface ib0 with an address (it has: ens1)"),
    (_facts(layout={"tensor_parallel_size": 8, "pipeline_parallel_size": 1, "nnodes": 2}),
     "different layouts in the hosts' model.json"),
])
def test_each_disagreement_is_named_with_its_host(b: dict[str, object], message: str):
    found = problems({"a": _facts(), "b": b})
    assert any(message in line for line in found), found


def test_a_layout_that_does_not_fit_the_hosts_is_named():
    odd = _facts(layout={"tensor_parallel_size": 3, "pipeline_parallel_size": 1, "nnodes": 2})
    assert any("= 3 does not divide over 2 hosts" in p for p in problems({"a": odd, "b": odd}))
    three = _facts(layout={"tensor_parallel_size": 8, "pipeline_parallel_size": 2, "nnodes": 3})
    assert any("nnodes is 3 but the model has 2 hosts (a, b)" in p for p in problems({"a": three, "b": three}))


def test_cpu_hosts_are_not_counted_for_gpus():
    cpu = _facts(gpus=0, layout={"tensor_parallel_size": 1, "pipeline_parallel_size": 2, "nnodes": 2})
    assert problems({"a": cpu, "b": cpu}, profile="cpu") == []
    assert problems({"a": cpu, "b": cpu}, profile="gpu")


def test_nodecheck_gathers_this_host_and_compares_hosts(tmp_path: Path, tiny_model: Path):
    model_json = tmp_path / "model.json"
    model_json.write_text(json.dumps({"model": str(tiny_model), "pipeline_parallel_size": 2, "nnodes": 2}))
    llmhost = str(Path(sys.executable).parent / "llmhost")
    done = subprocess.run([llmhost, "nodecheck", "gather", "--model-json", str(model_json)],
                          capture_output=True, text=True, timeout=120, check=True)
    facts = json.loads(done.stdout)
    assert facts["model_present"] is True and facts["vllm"] and facts["torch"]
    assert facts["layout"] == {"tensor_parallel_size": 1, "pipeline_parallel_size": 2, "nnodes": 2}
    mine = tmp_path / "a.json"
    mine.write_text(done.stdout)
    other = tmp_path / "b.json"
    other.write_text(json.dumps({**facts, "vllm": "0.0.1", "interface": ""}))
    same = subprocess.run([llmhost, "nodecheck", "compare", "--profile", "cpu", f"a={mine}", f"b={mine}"],
                          capture_output=True, text=True, timeout=120)
    assert same.returncode == 0, same.stderr
    differ = subprocess.run([llmhost, "nodecheck", "compare", "--profile", "cpu", f"a={mine}", f"b={other}"],
                            capture_output=True, text=True, timeout=120)
    assert differ.returncode == 1
    assert f"different vLLM versions on the model's hosts: a {facts['vllm']}, b 0.0.1" in differ.stderr
    missing = subprocess.run([llmhost, "nodecheck", "compare", f"a={tmp_path / 'none.json'}"],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "a's facts in" in missing.stderr and "Traceback" not in missing.stderr


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    llmhost = str(Path(sys.executable).parent / "llmhost")
    return subprocess.run([llmhost, "nodecheck", *args], capture_output=True, text=True, timeout=timeout)


def test_a_blocked_port_is_named_with_both_hosts():
    found = problems({"a": _facts(), "b": _facts(unreachable={"a at 10.0.0.1:29500": "Connection refused"})})
    assert found == ["b cannot reach a at 10.0.0.1:29500 (Connection refused): the model's hosts need TCP between "
                     "them both ways, to the head's node_port (torch.distributed's store) and to the ports Gloo, "
                     "NCCL and vLLM's message queues pick at start"]


def test_listen_returns_at_once_and_stops_listening_once_every_host_connected():
    fixed = free_port()
    done = _run("listen", "--address", "127.0.0.1", "--port", str(fixed), "--port", "0", "--expect", "2",
                "--seconds", "60", timeout=30)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["address"] == "127.0.0.1" and seen["ports"][0] == fixed and len(seen["ports"]) == 2
    assert seen["listening"] == seen["ports"] and seen["in_use"] == []
    targets = {f"{host}:{port}": ("127.0.0.1", port) for host in ("b", "c") for port in seen["ports"]}
    assert nodecheck.reach(targets, timeout=5) == {}
    # Two connections a port came: the listener is gone and the engine may take its port.
    deadline = time.monotonic() + 10
    while nodecheck.reach({"x": ("127.0.0.1", fixed)}, timeout=1) == {} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert nodecheck.reach({"x": ("127.0.0.1", fixed)}, timeout=1) == {"x": "Connection refused"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", fixed))


def test_probes_are_answered_and_closed_by_the_prober_never_reset():
    # A loaded host may look at its connection only after the listener has accepted it:
    # it must still be open then (a listener that reset it fails the probe as
    # "Connection reset by peer"), and end when the prober closes it.
    done = _run("listen", "--address", "127.0.0.1", "--port", "0", "--expect", "101", "--seconds", "60",
                timeout=30)
    assert done.returncode == 0, done.stderr
    port = json.loads(done.stdout)["ports"][0]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
        time.sleep(0.5)
        assert slow.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        slow.settimeout(0.5)
        with pytest.raises(TimeoutError):
            slow.recv(1)
    assert nodecheck.reach({f"probe {n}": ("127.0.0.1", port) for n in range(100)}, timeout=5) == {}
    deadline = time.monotonic() + 10
    while nodecheck.reach({"x": ("127.0.0.1", port)}, timeout=1) == {} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert nodecheck.reach({"x": ("127.0.0.1", port)}, timeout=1) == {"x": "Connection refused"}


def test_a_port_in_use_is_reported_for_the_others_to_reach():
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen()
        port = store.getsockname()[1]
        done = _run("listen", "--address", "127.0.0.1", "--port", str(port), "--seconds", "5", timeout=30)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"address": "127.0.0.1", "ports": [port], "listening": [], "in_use": [port]}


def test_listen_on_an_address_this_host_does_not_have_fails_naming_it():
    done = _run("listen", "--address", "192.0.2.1", "--port", "0", timeout=30)
    assert done.returncode == 2 and "cannot listen on 192.0.2.1 port 0" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args, message", [
    (["listen", "--address", "gpu-1", "--port", "0"], "--address must be an IP address, got 'gpu-1'"),
    (["listen", "--address", "127.0.0.1"], "--port must be given"),
    (["listen", "--address", "127.0.0.1", "--port", "70000"], "--port must be given, each 0-65535 (got [70000])"),
    (["listen", "--address", "127.0.0.1", "--port", "0", "--expect", "0"], "--expect must be at least 1"),
    (["gather", "--model-json", "m.json", "--reach", "b=10.0.0.2"], "--reach: expected HOST=ADDRESS:PORT"),
    (["gather", "--model-json", "m.json", "--reach", "b=gpu-2:29500"], "with an IP address, got 'b=gpu-2:29500'"),
])
def test_bad_listen_and_reach_arguments_are_refused_naming_them(args: list[str], message: str):
    done = _run(*args, timeout=30)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_targets_parse_with_ipv4_and_ipv6_addresses():
    assert nodecheck.parse_target("b=10.0.0.2:29500") == ("b", "10.0.0.2", 29500)
    assert nodecheck.parse_target("b=[fd00::2]:29500") == ("b", "fd00::2", 29500)
    assert nodecheck.parse_target("b=fd00::2:41000") == ("b", "fd00::2", 41000)


def test_gather_names_the_ports_it_cannot_reach(tmp_path: Path, tiny_model: Path):
    model_json = tmp_path / "model.json"
    model_json.write_text(json.dumps({"model": str(tiny_model), "pipeline_parallel_size": 2, "nnodes": 2}))
    with socket.socket() as open_port:
        open_port.bind(("127.0.0.1", 0))
        open_port.listen()
        ok = open_port.getsockname()[1]
        closed = free_port()
        done = _run("gather", "--model-json", str(model_json), "--reach", f"a=127.0.0.1:{ok}",
                    "--reach", f"a=127.0.0.1:{closed}")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["unreachable"] == {f"a at 127.0.0.1:{closed}": "Connection refused"}


def test_follower_textfile_says_joined_and_when_it_last_looked(tmp_path: Path):
    from llmhost.multinode.follower import FollowerTextfile

    path = tmp_path / "follower.prom"
    textfile = FollowerTextfile(str(path), "big")
    before = time.time()
    textfile.update(False, force=True)
    assert 'llmhost_follower_joined{model="big"} 0.0' in path.read_text()
    textfile.update(True)  # a change is written at once
    text = path.read_text()
    assert 'llmhost_follower_joined{model="big"} 1.0' in text
    stamp = float(next(line for line in text.splitlines()
                       if line.startswith("llmhost_follower_last_check_timestamp_seconds")).split()[-1])
    assert before <= stamp <= time.time()
    path.unlink()
    textfile.update(True)  # no change within the refresh interval: not written again
    assert not path.exists()


def test_a_closed_follower_textfile_stays_not_joined(tmp_path: Path):
    from llmhost.multinode.follower import FollowerTextfile

    path = tmp_path / "follower.prom"
    textfile = FollowerTextfile(str(path), "big")
    textfile.update(True, force=True)
    textfile.close()
    assert 'llmhost_follower_joined{model="big"} 0.0' in path.read_text()
    textfile.update(True, force=True)  # the watch thread, a moment late
    assert 'llmhost_follower_joined{model="big"} 0.0' in path.read_text()
