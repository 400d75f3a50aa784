"""The registry as a Ray actor: a named, detached actor per node, pinned to its node.

Its process serves the registry socket (`server.RegistryServer`) for the engines of that node,
because Ray cannot carry file descriptors.  Engines talk to the socket only: they need Ray just
to create the actor the first time (`ensure_actor`, called by `discovery.connect_registry`).
The socket's directory is the node's own (`nodes.py`), so several nodes on one machine never
share a registry; the actor of another node than its creator's works it out on that node
(Note [whose environment names a socket]).  The actor also exports the registry's figures as
Ray metrics, tagged with its node (`metrics.RegistryMetrics`), and `node_registries` reads
every node's registry through Ray (``vllm-dedup status --all-nodes``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import RegistryUnavailable
from ..log import init_logger
from .client import registry_answers
from .metrics import RegistryMetrics
from .nodes import HEAD_RESOURCE, node_socket_path, ray_node, registry_env, this_node
from .server import RegistryServer, raise_descriptor_limit
from .state import Registry, RegistryStats

__all__ = ["ACTOR_PREFIX", "NodeRegistry", "RegistryActor", "actor_name", "ensure_actor", "node_registries",
           "probe_ray_address"]

logger = init_logger(__name__)

ACTOR_PREFIX = "vllm-dedup-registry-"

# Note [whose environment names a socket]
#     A node's socket directory comes from an environment (`wire.runtime_dir`: the
#     ``VLLM_DEDUP_RUNTIME_DIR``, else ``XDG_RUNTIME_DIR``, else the uid).  For its own node the
#     creator of an actor names the path: its engines look there.  For another node it cannot:
#     a driver's ``XDG_RUNTIME_DIR`` (``/run/user/<uid>``, its login session) need not exist
#     there, and the replicas there compute theirs from their raylet's environment.  So that
#     actor computes the path itself, on its node, given the creator's ``VLLM_DEDUP_*``
#     variables (`nodes.registry_env`) as the replicas are (`serve.dedup_llm_config`): the
#     same inputs, the same path.


class RegistryActor:
    """The registry and its socket server in a Ray actor's process.  Plain class; Ray wraps it.

    Args:
        namespace: the registry namespace.
        keep_warm_s: see `Registry`.
        path: the registry's socket path on this node; None: `nodes.node_socket_path` of this
            node, computed here (Note [whose environment names a socket]).
    """

    def __init__(self, namespace: str, keep_warm_s: float = 0.0, path: str | None = None):
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        raise_descriptor_limit()  # a process of its own (a detached actor)
        path = Path(path) if path is not None else node_socket_path(namespace, ray_node(self.node_id))
        self.server = RegistryServer(Registry(keep_warm_s=keep_warm_s), path).start()
        self.metrics = RegistryMetrics(self.server.stats, node=self.node_id).start()
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

    def where(self) -> dict:
        """``{"node_id": <the Ray node id this actor runs on>, "socket": <its socket path>}``."""
        return {"node_id": self.node_id, "socket": str(self.server.path)}

    def stats(self) -> dict:
        """`Registry.stats` as a dict (the same figures the Ray metrics carry)."""
        return self.server.stats().to_dict()

    def shutdown(self) -> None:
        self.metrics.stop()
        self.server.stop()


def actor_name(node_id: str) -> str:
    """The registry actor's name on node ``node_id`` (one registry per node)."""
    return f"{ACTOR_PREFIX}{node_id[:16]}"


def ensure_actor(namespace: str, keep_warm_s: float = 0.0, address: str | None = None,
                 node_id: str | None = None) -> str:
    """Get or create the registry actor of node ``node_id`` in ``namespace``; returns its socket path.

    ``node_id`` defaults to this process's node (`nodes.this_node`: the node of this process's
    Ray connection, or the one its parent exported), and else to the node that ``ray.init``
    connects this process to.  A new actor serves `nodes.node_socket_path` of that node, from
    this process's environment on its own node and from the actor's on another (Note [whose
    environment names a socket]); an actor that exists already serves the path its creator
    chose.  Where no actor can be made because a registry already serves that socket (a
    standalone daemon engines started before Ray), that socket is returned: it is the node's
    registry, and ``keep_warm_s`` stays its own.

    Connects this process to Ray if it is not connected yet (and disconnects afterwards: the
    actor is detached and outlives us).

    Raises:
        RegistryUnavailable: Ray is not installed, no cluster can be reached, ``node_id`` is no
            alive node, or the actor could not be started.
    """
    try:
        import ray
    except ImportError as e:
        raise RegistryUnavailable(f"Ray is not installed ({e})") from None
    # Before connecting: an engine process knows its node from the environment, and ray.init
    # may attach it to another node of the same machine (Ray picks one by IP address).
    known = this_node()
    connected_here = False
    # ray.init sets SIGTERM to sys.exit (in the main thread: an engine's worker, or vLLM's
    # engine core) and ray.shutdown leaves it so: vLLM's own handler, which shuts the engine
    # down in order, would be gone for good.  Ours is a short connection: the handler goes back.
    sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        if not ray.is_initialized():
            # ray.init("auto") goes to $RAY_ADDRESS: a stale one is found out here, not in a minute
            probe_ray_address(address if address not in (None, "auto") else os.environ.get("RAY_ADDRESS"))
            try:
                ray.init(address=address or "auto", namespace=namespace, logging_level=logging.WARNING,
                         log_to_driver=False, include_dashboard=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise RegistryUnavailable(f"no Ray cluster at {address or 'auto'}: {e}") from None
            connected_here = True
        here = known.node_id if known else ray.get_runtime_context().get_node_id()
        return _actor_socket(ray, namespace, keep_warm_s, node_id or here, here)
    finally:
        if connected_here:
            ray.shutdown()
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)


def _actor_socket(ray, namespace: str, keep_warm_s: float, node_id: str, here: str) -> str:
    """`ensure_actor`'s work once connected to Ray: the socket path of node ``node_id``'s actor,
    asked for by a process on node ``here``.

    Raises:
        RegistryUnavailable: the actor could not be found or started.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    path = None  # known here only for this process's own node
    try:
        node = ray_node(node_id)
        if node.node_id == here:
            path = node_socket_path(namespace, node)
        actor_cls = ray.remote(num_cpus=0, max_restarts=0)(RegistryActor)
        actor = actor_cls.options(
            name=actor_name(node.node_id),
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
            runtime_env={"env_vars": registry_env()},
        ).remote(namespace, keep_warm_s, None if path is None else str(path))
        return ray.get(actor.socket_path.remote(), timeout=60)
    except Exception as e:
        # A registry that serves the node's socket already (a standalone daemon engines started
        # before Ray was there: the actor cannot take its socket) is the node's registry:
        # engines connect to whatever answers there first.  (Another node's socket cannot be
        # tried from here.)
        if path is not None and registry_answers(path):
            logger.info("a registry already serves %s; the Ray actor is not needed", path)
            return str(path)
        raise RegistryUnavailable(f"cannot start the registry actor in namespace {namespace!r}: {e}") from None



@dataclass
class NodeRegistry:
    """One node's registry actor, as `node_registries` found it.

    Attributes:
        node_id, node_ip, head: the Ray node it runs on (id from the actor, address and role
            from Ray's node table; ``node_ip`` is "" when the node is no longer alive).
        socket: the socket path engines on that node connect to.
        stats: its `RegistryStats`, or None when it did not answer.
        error: why it did not answer (None when it did).
    """

    name: str
    node_id: str
    node_ip: str
    head: bool
    socket: str
    stats: RegistryStats | None
    error: str | None = None

    def where(self) -> str:
        """``node <id16> (<ip>[, head]) <socket>``: the heading of this registry in the status."""
        role = ", head" if self.head else ""
        return f"node {self.node_id[:16]} ({self.node_ip or 'not alive'}{role}) {self.socket}"

    def to_dict(self) -> dict:
        """One item of ``vllm-dedup status --all-nodes --json``'s ``registries`` list."""
        out = {"name": self.name, "node_id": self.node_id, "node_ip": self.node_ip, "head": self.head,
               "socket": self.socket}
        if self.stats is not None:
            out["stats"] = self.stats.to_dict()
        else:
            out["error"] = self.error
        return out


def node_registries(namespace: str, timeout_s: float = 10.0) -> list[NodeRegistry]:
    """Every node's registry actor in ``namespace`` (Ray's named actors), head node first, then
    by node id; each asked for its node, socket and stats, all at once.  Needs a Ray connection.

    An actor that has not answered ``timeout_s`` seconds after all were asked (or fails) is
    listed with its ``error``; an empty list means no registry runs in that namespace.
    """
    import ray

    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == namespace and a["name"].startswith(ACTOR_PREFIX))
    handles, pending = {}, {}
    for name in names:
        try:
            handles[name] = ray.get_actor(name, namespace=namespace)
            pending[name] = (handles[name].where.remote(), handles[name].stats.remote())
        except ValueError as e:  # gone between the listing and now
            pending[name] = e
    out = []
    deadline = time.monotonic() + timeout_s  # one wait for all: hung actors' timeouts do not add up
    for name in names:
        node_id, socket_text, stats, error = name[len(ACTOR_PREFIX):], "", None, None
        try:
            if isinstance(pending[name], Exception):
                raise pending[name]
            where_ref, stats_ref = pending[name]
            where, data = ray.get([where_ref, stats_ref], timeout=max(deadline - time.monotonic(), 0.0))
            node_id, socket_text, stats = where["node_id"], where["socket"], RegistryStats.from_dict(data)
        except Exception as e:  # one registry's failure must not hide the others
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        # Without an answer only the name's 16 hex digits of the node id are known.
        node = next((n for i, n in nodes.items() if i.startswith(node_id)), {})
        out.append(NodeRegistry(name, node_id, node.get("NodeManagerAddress", ""),
                                HEAD_RESOURCE in node.get("Resources", {}), socket_text, stats, error))
    out.sort(key=lambda r: (not r.head, r.node_id))
    return out


def probe_ray_address(address: str | None, timeout_s: float = 3.0) -> None:
    """Fail fast on a ``host:port`` where nothing listens: ray.init would wait a minute."""
    if not address or address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # an IPv6 address, as Ray writes it: [::1]:6379
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise RegistryUnavailable(f"no Ray cluster answers at {address}: {e}") from None
