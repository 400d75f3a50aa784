"""Two Ray nodes on one machine, one registry actor per node: sharing within a node, never across.

A real two-node Ray cluster (`two_ray_nodes`: ``ray.cluster_utils.Cluster``, both nodes on
127.0.0.1), real registry actors, real Ray Serve replicas running real vLLM engines (CPU).
Which node a process runs on is checked from outside the code under test: a Ray worker's
environment names its node's raylet (``RAY_RAYLET_PID``), and the processes it starts inherit it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from harness.engines import openai_complete
from harness.procs import descendants, free_port, memfd_holders, serve_replica_pids
from helpers import prometheus_samples, run_cli, wait_for
from vllm_dedup.config import DedupConfig
from vllm_dedup.registry.client import registry_stats, shutdown_registry
from vllm_dedup.scan.files import scan_model
from vllm_dedup.scan.report import Report

ENGINE_KWARGS = {"dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True, "seed": 0,
                 "kv_cache_memory_bytes": 32 << 20}
NAMESPACE = "vllm-dedup"
pytestmark = pytest.mark.timeout(600)

# What an engine process does: it is not in Ray, it finds its registry from what it inherited.
ENGINE = """
import json, os, sys
from vllm_dedup.registry.discovery import connect_registry
with connect_registry("vllm-dedup", sys.argv[1]) as client:
    print(json.dumps({"socket": str(client.path), "registry_pid": client.stats().registry_pid,
                      "node": os.environ.get("VLLM_DEDUP_RAY_NODE_ID")}))
"""


EMBEDDING = 49152 * 576 * 2  # SmolLM2's, bf16

def environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with."""
    data = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in data.split("\0") if "=" in item)


def raylet_of(pid: int) -> str:
    """The pid of the raylet (one per Ray node) of the node process ``pid`` runs on."""
    return environ(pid)["RAY_RAYLET_PID"]


def cluster_pids(ray_tmp: str) -> set[int]:
    """The processes the test cluster started, and theirs (their RAY_TMPDIR is its temp dir)."""
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and environ(int(proc.name)).get("RAY_TMPDIR") == ray_tmp:
                pids.add(int(proc.name))
        except OSError:
            pass
    return pids


def alive(pids) -> list[int]:
    return [p for p in pids if os.path.exists(f"/proc/{p}")]


def registry_actors() -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and a["name"].startswith("vllm-dedup-registry-"))


@pytest.fixture
def nodes(two_nodes_address, registry) -> dict:
    """The two-node cluster, this process connected to it as a driver, and this test's registry
    sockets: ``sockets[node id]`` (the head's where a single node keeps it, the worker's in
    its own directory)."""
    import ray

    head, worker = two_nodes_address["head"], two_nodes_address["worker"]
    sockets = {head: registry.socket, worker: registry.run_dir.with_name(f"{registry.run_dir.name}-node-{worker[:16]}") / "vllm-dedup.sock"}
    ray.init(address=two_nodes_address["address"], logging_level="WARNING", log_to_driver=False)
    try:
        yield {**two_nodes_address, "sockets": sockets}
    finally:
        try:
            for path in sockets.values():
                shutdown_registry(path)
            assert wait_for(lambda: registry_actors() == [], 30), registry_actors()
        finally:
            ray.shutdown()


def test_engine_processes_use_their_own_nodes_registry_and_status_lists_every_node(nodes, registry):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from vllm_dedup.serve import dedup_llm_config, ensure_registry

    head, worker, sockets = nodes["head"], nodes["worker"], nodes["sockets"]

    # The head's registry, as `build_dedup_app` makes it: where a single node keeps it.
    assert ensure_registry(node_id=head) == registry.socket
    assert not sockets[worker].exists()

    @ray.remote(num_cpus=0)
    def replica(address: str):
        """What a Ray Serve replica does: vLLM loads the plugin, which leaves the node in the
        environment, then starts its engine processes, which inherit it and are not in Ray."""
        import subprocess
        import sys

        from vllm_dedup.registry.nodes import export_node

        export_node()
        engine = subprocess.run([sys.executable, "-c", ENGINE, address], capture_output=True, text=True,
                                timeout=120)
        return engine.returncode, engine.stdout, engine.stderr, os.environ["RAY_RAYLET_PID"]

    found = {}
    for node in (head, worker):
        # The environment Ray Serve gives a replica (`dedup_llm_config`'s runtime_env).
        task = replica.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                               runtime_env={"env_vars": {"VLLM_DEDUP_RUNTIME_DIR": str(registry.run_dir)}})
        code, out, err, raylet = ray.get(task.remote(nodes["address"]), timeout=180)
        assert code == 0, err[-3000:]
        found[node] = {**json.loads(out.strip().splitlines()[-1]), "raylet": raylet}

    # The head's engine found the head's registry; the worker's engine found none on its node
    # and started one there (through Ray), in the worker's own directory.
    assert found[head]["socket"] == str(sockets[head]) and found[worker]["socket"] == str(sockets[worker])
    assert found[head]["registry_pid"] != found[worker]["registry_pid"]
    for node in (head, worker):
        assert found[node]["node"] == node
        assert raylet_of(found[node]["registry_pid"]) == found[node]["raylet"]
    assert found[head]["raylet"] != found[worker]["raylet"]
    assert registry_actors() == sorted(f"vllm-dedup-registry-{n[:16]}" for n in (head, worker))

    # `vllm-dedup status --all-nodes`: both registries, through Ray, head first.
    status = json.loads(run_cli("status", "--all-nodes", "--json", check=True).stdout)
    assert status["namespace"] == NAMESPACE
    assert [(r["node_id"], r["head"], r["node_ip"], r["socket"]) for r in status["registries"]] == [
        (head, True, "127.0.0.1", str(sockets[head])), (worker, False, "127.0.0.1", str(sockets[worker]))]
    for r in status["registries"]:
        assert r["stats"]["registry_pid"] == found[r["node_id"]]["registry_pid"]
        assert r["stats"]["engines"] == []  # the engine processes have exited
    text = run_cli("status", "--all-nodes", check=True).stdout
    assert f"at node {head[:16]} (127.0.0.1, head) {sockets[head]}" in text
    assert f"at node {worker[:16]} (127.0.0.1) {sockets[worker]}" in text
    # Without --all-nodes: this machine's default socket, the head's registry, as on one node.
    local = json.loads(run_cli("status", "--json", check=True).stdout)
    assert local["registry_pid"] == found[head]["registry_pid"]

    # Serve placement: pinned by Ray's node-id label, which Ray honours for a placement group.
    with pytest.raises(ValueError, match="no alive Ray node"):
        dedup_llm_config("m", "/models/m", node="0" * 56)
    for node, expected in ((worker, worker), ("driver", ray.get_runtime_context().get_node_id())):
        config = dedup_llm_config("m", "/models/m", node=node)
        selector = config.deployment_config["placement_group_bundle_label_selector"]
        assert selector == [{"ray.io/node-id": expected}]
        group = ray.util.placement_group([{"CPU": 1}], bundle_label_selector=selector)
        try:
            ray.get(group.ready(), timeout=60)
            assert ray.util.placement_group_table(group)["bundles_to_node_id"] == {0: expected}
        finally:
            ray.util.remove_placement_group(group)
    assert "placement_group_bundle_label_selector" not in dedup_llm_config("m", "/m", node=None).deployment_config
    # A driver's own node never travels to the replicas (each finds its own); the rest of its
    # VLLM_DEDUP_* environment does.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_DEDUP_RAY_NODE_ID", head)
        env.setenv("VLLM_DEDUP_RAY_NODE_DIR", str(sockets[head].parent))
        passed = dedup_llm_config("m", "/m").runtime_env["env_vars"]
    assert passed["VLLM_DEDUP_RUNTIME_DIR"] == str(registry.run_dir)
    assert not {"VLLM_DEDUP_RAY_NODE_ID", "VLLM_DEDUP_RAY_NODE_DIR"} & set(passed)


def test_another_nodes_registry_actor_puts_its_socket_where_that_node_keeps_it(nodes, monkeypatch):
    """A driver makes every node's actor (`build_dedup_app`), but the socket directory of
    another node is that node's: the driver's ``XDG_RUNTIME_DIR`` (its login session) may not
    exist there.  The actor works it out from its own node's environment and the driver's
    ``VLLM_DEDUP_*`` variables, as the replicas there do."""
    from vllm_dedup.serve import ensure_registry

    worker = nodes["worker"]
    monkeypatch.delenv("VLLM_DEDUP_RUNTIME_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/proc/no-such-session")  # no directory can be made there
    path = ensure_registry(node_id=worker)
    try:
        pid = registry_stats(path).registry_pid
        actor = environ(pid)
        # `wire.runtime_dir`, in the actor's own environment (its raylet's)
        if actor.get("VLLM_DEDUP_RUNTIME_DIR"):
            base = Path(actor["VLLM_DEDUP_RUNTIME_DIR"])
        elif actor.get("XDG_RUNTIME_DIR"):
            base = Path(actor["XDG_RUNTIME_DIR"]) / "vllm-dedup"
        else:
            base = Path(f"/tmp/vllm-dedup-{os.getuid()}")
        assert path == base.with_name(f"{base.name}-node-{worker[:16]}") / f"{NAMESPACE}.sock"
        assert not str(path).startswith("/proc/")
    finally:
        shutdown_registry(path)
        assert wait_for(lambda: registry_actors() == [], 30), registry_actors()
        if path.parent.name.endswith(f"-node-{worker[:16]}"):
            shutil.rmtree(path.parent, ignore_errors=True)


def test_status_of_every_node_waits_once_for_registries_that_do_not_answer(nodes):
    """Two registry actors that never answer cost one ``timeout_s``, not one each, and are
    listed with their error."""
    import ray

    from vllm_dedup.registry.ray_actor import node_registries

    class Hung:
        def where(self):
            time.sleep(3600)

        def stats(self):
            time.sleep(3600)

    names = [f"vllm-dedup-registry-{'ab' * 7}{i:02d}" for i in range(2)]
    hung = [ray.remote(num_cpus=0)(Hung).options(name=n, namespace=NAMESPACE).remote() for n in names]
    try:
        start = time.monotonic()
        found = node_registries(NAMESPACE, timeout_s=6)
        took = time.monotonic() - start
        assert sorted(r.name for r in found) == names
        assert all(r.stats is None and "Timeout" in r.error for r in found), [r.error for r in found]
        assert took < 10, f"{took:.1f} s: each hung actor was waited for on its own (12 s)"
    finally:
        for actor in hung:
            ray.kill(actor)
        assert wait_for(lambda: registry_actors() == [], 30), registry_actors()


def test_replicas_of_one_model_on_two_nodes_hold_one_copy_per_node(smollm2, nodes, registry):
    """One deployment, two replicas, one per node (each node has room for one): two resident
    copies, one per node; not one (shared across nodes) and not four."""
    import ray
    from ray import serve

    from vllm_dedup.serve import build_dedup_app

    head, worker, sockets = nodes["head"], nodes["worker"], nodes["sockets"]
    shareable = Report([scan_model(smollm2, progress=False)], DedupConfig().min_tensor_bytes).unique_bytes
    metrics_port = {n["NodeID"]: n["MetricsExportPort"] for n in ray.nodes()}
    port = free_port()
    seen: set[int] = set()  # every replica, engine and registry process: all must be gone at the end
    start = time.monotonic()
    try:
        # One proxy: on every node, each would bind the same port of this one machine.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        app = build_dedup_app({"smollm2": smollm2}, engine_kwargs=ENGINE_KWARGS, node=None,
                              deployment_config={"num_replicas": 2})
        # build_dedup_app made both nodes' registries before any replica started.
        assert all(path.exists() for path in sockets.values())
        serve.run(app, name="mn", route_prefix="/", blocking=False)

        def loaded() -> bool:
            return all(len(s.engines) == 1 and "published_bytes" in s.engines[0].load
                       for s in map(registry_stats, sockets.values()))

        assert wait_for(loaded, 300, poll_s=1), {n: registry_stats(p) for n, p in sockets.items()}
        print(f"both replicas loaded {time.monotonic() - start:.0f} s after serve.run")
        stats = {node: registry_stats(path) for node, path in sockets.items()}
        for node, s in stats.items():
            (engine,), (group,) = s.engines, s.groups
            seen |= {s.registry_pid, engine.pid}
            # One resident copy on this node, published by its only engine, mapped by no other.
            assert group.engines == 1 and group.shared_bytes == 0 and group.saved_bytes == engine.load["shared_bytes"]
            # (with cpu_linear="packed" the engine maps its tied head's oneDNN packed copy from its
            # own segment of the embedding's, which a scan of the checkpoint cannot see)
            assert engine.load["shared_bytes"] <= EMBEDDING and engine.load["published_bytes"] == group.resident_bytes
            assert 0.98 * shareable <= group.resident_bytes <= 1.02 * shareable + EMBEDDING, \
                (group.resident_bytes, shareable)
            # The engine is on its registry's node, which it learned from its replica (the plugin).
            assert raylet_of(engine.pid) == raylet_of(s.registry_pid)
            assert environ(engine.pid)["VLLM_DEDUP_RAY_NODE_ID"] == node
            print(f"node {node[:16]}: resident {group.resident_bytes / 1e6:.1f} MB, engines {group.engines}, "
                  f"shareable {shareable / 1e6:.1f} MB")
        assert raylet_of(stats[head].registry_pid) != raylet_of(stats[worker].registry_pid)
        replicas = serve_replica_pids("mn", "LLMServer:smollm2")
        assert len(replicas) == 2
        seen |= {p for r in replicas for p in descendants(r)}

        # Query until each node's replica has answered (vLLM's own request counter, which each
        # replica reports to its node's metrics agent); every answer is the same greedy text.
        texts = []

        def served(node: str) -> float:
            return sum(v for _, _, v in prometheus_samples(metrics_port[node], "ray_vllm_request_success"))

        def both_answered() -> bool:
            reply = openai_complete(port, "smollm2", "The capital of France is", max_tokens=8)
            texts.append(reply["choices"][0]["text"])
            return all(served(node) >= 1 for node in sockets)

        assert wait_for(both_answered, 120, poll_s=0.5), {node: served(node) for node in sockets}
        assert len(set(texts)) == 1 and texts[0].strip(), texts

        # The metrics carry the node: each node's endpoint shows its own registry's figures.
        def node_gauges(node: str) -> dict[str, float]:
            return {labels["node"]: v for name, labels, v in prometheus_samples(metrics_port[node],
                                                                                 "ray_vllm_dedup_resident_bytes")}

        for node in sockets:
            assert wait_for(lambda: node_gauges(node) == {node: stats[node].groups[0].resident_bytes}, 60), \
                node_gauges(node)

        # `vllm-dedup status --all-nodes` lists both registries, one engine each.
        status = json.loads(run_cli("status", "--all-nodes", "--json", check=True).stdout)
        assert [(r["node_id"], r["socket"], len(r["stats"]["engines"])) for r in status["registries"]] == [
            (head, str(sockets[head]), 1), (worker, str(sockets[worker]), 1)]
        print(f"deployed, checked and queried in {time.monotonic() - start:.0f} s")
    finally:
        serve.shutdown()

    # Torn down: no replica, engine or registry process left, no segment held by any process of
    # this cluster (other tests on this machine may hold their own).
    assert wait_for(lambda: not serve_replica_pids("mn", "LLMServer:smollm2"), 60)
    assert wait_for(lambda: all(registry_stats(path).engines == [] for path in sockets.values()), 60)
    for path in sockets.values():
        assert shutdown_registry(path)
    assert wait_for(lambda: registry_actors() == [], 30), registry_actors()
    assert wait_for(lambda: not alive(seen), 30), alive(seen)
    assert wait_for(lambda: not set(memfd_holders()) & cluster_pids(nodes["tmp"]), 30)
