"""The registry as a Ray actor, and how an engine finds (or starts) its registry.

On a Ray cluster the registry is a named, detached actor, one per node, pinned to its node; its
process serves the broker socket (`broker.BrokerServer`) for the engines of that node, because
Ray cannot carry file descriptors.  Engines talk to the socket only: they need Ray just to
create the actor the first time.  The actor also exports the registry's figures as Ray metrics
(`metrics.RegistryMetrics`).

`connect_registry` decides where the registry is, in this order:

1. a broker already answers on this node's socket for the namespace: use it;
2. ``registry_address="local"``: start the standalone daemon (no Ray);
3. a Ray cluster is reachable (``registry_address``, ``RAY_ADDRESS``, this process already in
   Ray, or a cluster running on this machine): get or create the node's actor;
4. otherwise start the standalone daemon, which outlives the engine that started it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

from .broker import BrokerClient, BrokerServer, RegistryUnavailable, socket_path, start_daemon
from .metrics import RegistryMetrics
from .registry import Registry

__all__ = ["RegistryActor", "actor_name", "connect_registry", "ensure_actor"]

logger = logging.getLogger(__name__)


class RegistryActor:
    """The registry and its broker in a Ray actor's process.  Plain class; Ray wraps it.

    Args:
        path: the broker socket path on this node.
        keep_warm_s: see `Registry`.
    """

    def __init__(self, path: str, keep_warm_s: float = 0.0):
        self.server = BrokerServer(Registry(keep_warm_s=keep_warm_s), Path(path)).start()
        self.metrics = RegistryMetrics(self.server.stats).start()
        # A registry stopped through its socket (`broker.shutdown_registry`) takes its actor
        # with it, so that the name is free and the next engine creates a working one.
        threading.Thread(target=self._exit_when_stopped, name="vllm-dedup-actor-exit", daemon=True).start()

    def _exit_when_stopped(self) -> None:
        self.server.wait()
        self.server.stop()  # joins the server thread: the socket is gone, every fd closed
        self.metrics.stop()
        os._exit(0)

    def socket_path(self) -> str:
        """Where engines connect (also: the actor is up and serving)."""
        return str(self.server.path)

    def stats(self) -> dict:
        """`Registry.stats` (the same figures the Ray metrics carry)."""
        return self.server.stats()

    def shutdown(self) -> None:
        self.metrics.stop()
        self.server.stop()


def actor_name(node_id: str) -> str:
    """The registry actor's name on node ``node_id`` (one registry per node)."""
    return f"vllm-dedup-registry-{node_id[:16]}"


def ensure_actor(namespace: str, path: Path, keep_warm_s: float = 0.0, address: str | None = None) -> str:
    """Get or create this node's registry actor in ``namespace``; returns its socket path.

    Connects this process to Ray if it is not connected yet (and disconnects afterwards: the
    actor is detached and outlives us).

    Raises:
        RegistryUnavailable: Ray is not installed, or no cluster can be reached.
    """
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError as e:
        raise RegistryUnavailable(f"Ray is not installed ({e})") from None
    connected_here = False
    if not ray.is_initialized():
        _probe(address)
        try:
            ray.init(address=address or "auto", namespace=namespace, logging_level=logging.WARNING,
                     log_to_driver=False, include_dashboard=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RegistryUnavailable(f"no Ray cluster at {address or 'auto'}: {e}") from None
        connected_here = True
    try:
        node_id = ray.get_runtime_context().get_node_id()
        actor_cls = ray.remote(num_cpus=0, max_restarts=0)(RegistryActor)
        actor = actor_cls.options(
            name=actor_name(node_id),
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(str(path), keep_warm_s)
        return ray.get(actor.socket_path.remote(), timeout=60)
    except Exception as e:
        raise RegistryUnavailable(f"cannot start the registry actor in namespace {namespace!r}: {e}") from None
    finally:
        if connected_here:
            ray.shutdown()


def _probe(address: str | None, timeout_s: float = 3.0) -> None:
    """Fail fast on a ``host:port`` where nothing listens: ray.init would wait a minute."""
    if not address or address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise RegistryUnavailable(f"no Ray cluster answers at {address}: {e}") from None


def _ray_cluster_hint(address: str | None) -> bool:
    if address or os.environ.get("RAY_ADDRESS"):
        return True
    try:
        import ray
    except ImportError:
        return False
    if ray.is_initialized():
        return True
    # A cluster started on this machine leaves its address here (Ray's own convention).
    tmp = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    return tmp.exists()


def connect_registry(namespace: str, address: str | None = None, keep_warm_s: float = 0.0,
                     timeout_s: float = 60.0) -> BrokerClient:
    """A connection to this node's registry for ``namespace``, starting one if needed.

    Args:
        namespace: the registry namespace (one registry, one socket per namespace and node).
        address: ``None`` (decide as the module docstring says), ``"local"`` (standalone
            daemon, no Ray) or a Ray address (``"auto"``, ``"host:port"``).
        keep_warm_s: for a registry this call starts: seconds an unheld segment stays.

    Raises:
        RegistryUnavailable: no registry could be reached or started.
    """
    path = socket_path(namespace)
    try:
        return BrokerClient(path)
    except RegistryUnavailable:
        pass
    if address != "local" and _ray_cluster_hint(address):  # an explicit Ray address always lands here
        # An actor that already exists serves the path its creator chose (its environment may
        # differ from ours, e.g. another VLLM_DEDUP_RUNTIME_DIR): connect there.
        path = Path(ensure_actor(namespace, path, keep_warm_s, address))
    else:
        start_daemon(path, keep_warm_s=keep_warm_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return BrokerClient(path)
        except RegistryUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
