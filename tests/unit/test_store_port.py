"""The head of a model across hosts names a store port that another process holds,
before its engine starts (llmhost.backend.store_port)."""

from __future__ import annotations

import os
import socket

import pytest

from llmhost.backend.store_port import head_store_port, store_port_taken
from tests.harness.net import free_port


def _head(port: int, **more: object) -> dict[str, object]:
    return {"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": port,
            "pipeline_parallel_size": 2, **more}


@pytest.mark.parametrize(("args", "port"), [
    (_head(29500), 29500),
    (_head("29500"), 29500),  # model.json written by hand: a string
    ({"nnodes": 1, "master_port": 29500}, None),  # one host: no store across hosts
    (_head(29500, node_rank=1), None),  # a follower listens on nothing of the kind
    ({"nnodes": 2, "node_rank": 0}, None),  # no master_port named: nothing to check
    (_head(0), None),
    (_head("x"), None),  # vLLM's own validation names it
    ({}, None),
])
def test_the_store_port_is_the_heads_master_port_only(args, port):
    assert head_store_port(args) == port


def test_a_free_port_or_a_follower_is_no_problem():
    port = free_port()
    assert store_port_taken(_head(port)) is None
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert store_port_taken(_head(port, node_rank=1)) is None
        assert store_port_taken({"master_port": port}) is None


def test_a_listener_on_the_store_port_is_named_with_its_process():
    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        why = store_port_taken(_head(port))
    assert why is not None
    assert f"the port of its engine's torch.distributed store (master_port {port}) is taken on this host" in why
    assert f"pid {os.getpid()} (" in why and "listening" in why
    assert "node_port" in why and "model across 2 hosts" in why


def test_a_connections_local_port_on_the_store_port_is_named_as_such():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server_port = server.getsockname()[1]
        port = free_port()
        with socket.socket() as client:
            client.bind(("127.0.0.1", port))  # the local port of a connection, as an ephemeral one may be
            client.connect(("127.0.0.1", server_port))
            accepted, _ = server.accept()
            with accepted:
                why = store_port_taken(_head(port))
    assert why is not None and f"master_port {port}" in why
    assert f"pid {os.getpid()} (" in why and f"a connection to 127.0.0.1:{server_port}" in why


def test_a_port_left_in_time_wait_by_the_last_engine_is_free_to_the_store():
    """A head's tritonserver started again finds its last store's port in TIME_WAIT:
    the store binds it all the same (SO_REUSEADDR), so the check must not refuse it."""
    port = free_port()
    with socket.socket() as store:
        store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore (libuv) sets it
        store.bind(("0.0.0.0", port))
        store.listen()
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = store.accept()
        accepted.close()  # the store's side closes first: its port goes to TIME_WAIT
        client.recv(1)
        client.close()
    assert not _plain_bind(port), "the port should be in TIME_WAIT for this test to mean anything"
    assert store_port_taken(_head(port)) is None


def _plain_bind(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True
