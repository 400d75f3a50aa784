"""The registry as a Ray actor: a named, detached actor per node, pinned to its node.

Its process serves the registry socket (`server.BrokerServer`) for the engines of that node,
because Ray cannot carry file descriptors.  Engines talk to the socket only: they need Ray just
to create the actor the first time (`ensure_actor`, called by `discovery.connect_registry`).
The actor also exports the registry's figures as Ray metrics (`metrics.RegistryMetrics`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path

from ..errors import RegistryUnavailable
from .metrics import RegistryMetrics
from .server import BrokerServer
from .state import Registry

__all__ = ["RegistryActor", "actor_name", "ensure_actor", "probe_ray_address"]

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
        # A registry stopped through its socket (`client.shutdown_registry`) takes its actor
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
        """`Registry.stats` as a dict (the same figures the Ray metrics carry)."""
        return self.server.stats().to_dict()

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
        probe_ray_address(address)
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


def probe_ray_address(address: str | None, timeout_s: float = 3.0) -> None:
    """Fail fast on a ``host:port`` where nothing listens: ray.init would wait a minute."""
    if not address or address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise RegistryUnavailable(f"no Ray cluster answers at {address}: {e}") from None
