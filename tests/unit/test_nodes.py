"""Where a node's registry socket lives, outside Ray (the single-node case must not change) and
in an engine process that inherited its node from its parent; and the ``status --all-nodes``
options' bad input.  The Ray side runs on a real two-node cluster in tests/e2e/test_multinode.py."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from harness.procs import free_port
from helpers import run_cli
from vllm_dedup.registry.nodes import NODE_DIR_ENV, NODE_ID_ENV, RayNode, node_socket_path, this_node
from vllm_dedup.registry.wire import socket_path

NODE = "ab" * 28  # a Ray node id: 56 hex digits


def test_outside_ray_the_socket_is_where_a_single_node_keeps_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(tmp_path))
    for key in (NODE_ID_ENV, NODE_DIR_ENV):
        monkeypatch.delenv(key, raising=False)
    assert this_node() is None
    assert node_socket_path("ns") == socket_path("ns") == tmp_path / "ns.sock"
    # Half a node (one variable of two) is no node.
    monkeypatch.setenv(NODE_ID_ENV, NODE)
    assert this_node() is None and node_socket_path("ns") == tmp_path / "ns.sock"


def test_an_engine_process_uses_the_node_its_parent_exported(tmp_path, monkeypatch):
    monkeypatch.setenv(NODE_ID_ENV, NODE)
    monkeypatch.setenv(NODE_DIR_ENV, str(tmp_path / f"node-{NODE[:16]}"))
    assert this_node() == RayNode(NODE, tmp_path / f"node-{NODE[:16]}")
    assert node_socket_path("ns") == tmp_path / f"node-{NODE[:16]}" / "ns.sock"
    assert node_socket_path("ns", RayNode(NODE, tmp_path)) == tmp_path / "ns.sock"


def test_export_outside_ray_changes_nothing_and_imports_no_ray(tmp_path):
    # What plugin.register does in every vLLM process: outside Ray it must cost nothing.
    code = ("import os, sys\nfrom vllm_dedup.registry.nodes import export_node\nexport_node()\n"
            f"print('ray' in sys.modules, os.environ.get({NODE_ID_ENV!r}), os.environ.get({NODE_DIR_ENV!r}))")
    env = {"PATH": "/usr/bin:/bin", NODE_DIR_ENV: str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["False", "None", str(tmp_path)]


def test_status_address_needs_all_nodes():
    proc = run_cli("status", "--address", "127.0.0.1:6379")
    assert proc.returncode == 2 and "--address needs --all-nodes" in proc.stderr, proc.stderr


@pytest.mark.parametrize("address", ["local", "LOCAL"])
def test_status_all_nodes_refuses_to_start_a_cluster_of_its_own(address):
    """``ray.init("local")`` starts a new, empty cluster: nothing to read registries from."""
    start = time.monotonic()
    proc = run_cli("status", "--all-nodes", "--address", address)
    assert proc.returncode == 2 and "would start a new, empty Ray cluster" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 30 and "Traceback" not in proc.stderr


def test_status_all_nodes_without_a_cluster_fails_fast_and_says_so():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    proc = run_cli("status", "--all-nodes", "--address", address)
    assert proc.returncode == 1 and f"no Ray cluster at {address}" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 30  # not ray.init's minute of retries
