"""A model across hosts in the inventory (a model's `nodes`, the head first): which host
serves it in Triton and which follow it (filter_plugins/llmhost_nodes.py), what its
model.json adds on each of its hosts, the inventory's mistakes named, and
`llmhost nodecheck compare --stdin` as the model_repository role calls it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from filter_plugins import llmhost_nodes as nodes

MODELS = [
    {"name": "small", "source": "tiny"},
    {"name": "big", "source": "tiny", "nodes": ["gpu-1", "gpu-2", "gpu-3"], "node_port": 29600},
]
HOSTVARS = {"gpu-1": {"ansible_host": "10.0.0.1"}, "gpu-2": {"ansible_host": "gpu-2.example",
                                                            "llmhost_node_address": "10.0.0.2"},
            "gpu-3": {}}


def test_the_head_serves_the_model_and_the_others_follow_it_with_their_rank():
    assert [m["name"] for m in nodes.served(MODELS, "gpu-1")] == ["small", "big"]
    assert [m["name"] for m in nodes.served(MODELS, "gpu-2")] == ["small"]
    assert nodes.followed(MODELS, "gpu-1") == []
    assert [(m["name"], m["node_rank"]) for m in nodes.followed(MODELS, "gpu-3")] == [("big", 2)]
    # A host outside the model's nodes neither serves nor follows it.
    assert [m["name"] for m in nodes.served(MODELS, "cpu-9")] == ["small"]
    assert nodes.followed(MODELS, "cpu-9") == []


def test_every_host_renders_the_same_layout_from_the_heads_address():
    layout = nodes.node_layout(MODELS[1], HOSTVARS, 29500)
    assert layout == {
        "engine_args": {"nnodes": 3, "node_rank": 0, "master_addr": "10.0.0.1", "master_port": 29600},
        # llmhost_node_address first, then ansible_host, then the inventory name.
        "settings": {"followers": "10.0.0.2,gpu-3", "host_ip": "10.0.0.1"},
    }
    assert nodes.node_layout({**MODELS[1], "node_port": None}, HOSTVARS, 29500)["engine_args"]["master_port"] == 29500
    assert nodes.node_layout(MODELS[0], HOSTVARS, 29500) == {}


def test_the_inventorys_mistakes_are_named():
    inference = ["gpu-1", "gpu-2", "gpu-3"]
    assert nodes.node_problems(MODELS[1], inference) == []
    assert nodes.node_problems(MODELS[0], inference) == []
    assert nodes.node_problems({"nodes": "gpu-1"}, inference) == [
        "nodes must be a list of inventory host names, got 'gpu-1'"]
    assert nodes.node_problems({"nodes": ["gpu-1", "gpu-1", "cpu-9"], "node_port": 70000, "instance_count": 2,
                                "engine_args": {"master_port": 1, "tensor_parallel_size": 2}}, inference) == [
        "nodes names a host twice: ['gpu-1', 'gpu-1', 'cpu-9']",
        "nodes cpu-9 not in the inference group",
        "node_port must be a port (1-65535), got 70000",
        "instance_count must be 1 for a model across hosts (one engine spans its hosts)",
        "engine_args sets master_port: the roles set these from nodes and node_port",
    ]
    assert nodes.is_ip("10.0.0.1") and nodes.is_ip("fd00::1") and not nodes.is_ip("gpu-1.example")


def _facts(model: Path, **changed: object) -> dict[str, object]:
    return {"vllm": "0.32.0", "torch": "2.13.0", "model": str(model), "model_present": True, "gpus": 0,
            "interfaces": {"eth0": ["10.0.0.1"]}, "interface": "",
            "layout": {"tensor_parallel_size": 1, "pipeline_parallel_size": 2, "nnodes": 2}, **changed}


def _compare(stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmhost.cli", "nodecheck", "compare", "--profile", "cpu", "--stdin"],
                          input=stdin, capture_output=True, text=True, timeout=60, check=False)


def test_nodecheck_compares_facts_from_standard_input(tmp_path: Path):
    same = _compare(json.dumps({"head": _facts(tmp_path), "follower": _facts(tmp_path)}))
    assert (same.returncode, same.stderr) == (0, "")
    differ = _compare(json.dumps({"head": _facts(tmp_path), "follower": _facts(tmp_path, torch="2.12.0")}))
    assert differ.returncode == 1
    assert "different torch versions on the model's hosts: head 2.13.0, follower 2.12.0" in differ.stderr
    # A host the role has no facts from (left out by --limit, or failed before): named.
    absent = _compare(json.dumps({"head": _facts(tmp_path), "follower": {}}))
    assert absent.returncode == 1 and "no facts from follower" in absent.stderr
    for bad in ("[1, 2]", "not json"):
        refused = _compare(bad)
        assert refused.returncode == 2 and "the facts on standard input" in refused.stderr, refused.stderr
