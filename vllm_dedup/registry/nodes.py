"""Which Ray node a process is on, and where that node's registry socket lives.

Sharing happens within a node and never across (docs/architecture.md, "Registry"): each Ray
node has its own registry actor serving its own socket.  Nodes on different machines have
different file systems, but several Ray nodes can run on one machine (``ray start`` twice,
``ray.cluster_utils.Cluster``), so the socket's directory is named after the node:

- the head node, and any process outside Ray: ``wire.runtime_dir()`` itself, exactly as
  on a single node;
- every other node: a sibling of it, ``<runtime_dir()>-node-<first 16 hex digits of its node
  id>`` (e.g. ``$XDG_RUNTIME_DIR/vllm-dedup-node-0123456789abcdef``).  A sibling, not a
  subdirectory: creating a subdirectory first would create its parent with the umask's mode,
  and the head's registry refuses a socket directory open to others.

A process learns its node from Ray when it is connected (a Ray worker, such as a Ray Serve
replica, or a driver).  vLLM's engine processes are not Ray workers: they are children of the
process that built the engine, and inherit its environment.  vLLM loads this package's plugin
in that process first (``plugin.register``), which calls `export_node`: it writes the node's
id and socket directory into the environment (`NODE_ENV`), where the engine's own processes
find them.  Nothing has to be configured.
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..log import init_logger
from .wire import runtime_dir, socket_path

__all__ = ["NODE_DIR_ENV", "NODE_ENV", "NODE_ID_ENV", "RayNode", "export_node", "local_socket_path", "node_socket_path",
           "ray_node", "registry_env", "this_node"]

logger = init_logger(__name__)

NODE_ID_ENV = "VLLM_DEDUP_RAY_NODE_ID"  # the Ray node id (hex) of the process that set it
NODE_DIR_ENV = "VLLM_DEDUP_RAY_NODE_DIR"  # that node's registry socket directory
NODE_ENV = (NODE_ID_ENV, NODE_DIR_ENV)  # node-local facts: never passed to processes on other nodes
# Ray gives the head node this resource (Ray's docs: scheduling on the head node).
HEAD_RESOURCE = "node:__internal_head__"


@dataclass(frozen=True)
class RayNode:
    """A Ray node as the registry sees it.

    Attributes:
        node_id: Ray's node id (56 hex digits).
        socket_dir: the directory of that node's registry sockets (see the module docstring).
    """

    node_id: str
    socket_dir: Path


def _socket_dir(node_id: str, head: bool) -> Path:
    base = runtime_dir()
    return base if head else base.with_name(f"{base.name}-node-{node_id[:16]}")


def ray_node(node_id: str | None = None) -> RayNode:
    """The node ``node_id`` (default: this process's node) of the Ray cluster this process is
    connected to.  Whether it is the head comes from the cluster's node table (`ray.nodes`).

    Raises:
        RuntimeError: this process is not connected to Ray.
        ValueError: no alive node has that id (the message lists the alive ones).
    """
    import ray

    if not ray.is_initialized():
        raise RuntimeError("vllm-dedup: finding a Ray node needs a Ray connection (ray.init)")
    node_id = node_id or ray.get_runtime_context().get_node_id()
    return RayNode(node_id, _socket_dir(node_id, _is_head(node_id)))


def _is_head(node_id: str) -> bool:
    # Asked each time (one GCS call per engine load): a node that died since must be refused.
    import ray

    alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    if node_id not in alive:
        raise ValueError(f"no alive Ray node has id {node_id!r}; alive nodes: {sorted(alive)}")
    return HEAD_RESOURCE in alive[node_id]["Resources"]


def _in_ray() -> bool:
    # Importing Ray costs about a second: a process that has not imported it is not in Ray.
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def this_node() -> RayNode | None:
    """This process's Ray node: from Ray when this process is connected to it, else from the
    environment `export_node` left (an engine process whose parent is in Ray); None outside Ray
    (the single-node case)."""
    if _in_ray():
        return ray_node()
    node_id, socket_dir = (os.environ.get(k) for k in NODE_ENV)
    if node_id and socket_dir:
        return RayNode(node_id, Path(socket_dir))
    return None


def export_node() -> None:
    """In a process connected to Ray, write its node (`NODE_ENV`) into ``os.environ``, so that
    the processes it starts afterwards (vLLM's engine core and workers) use this node's registry.
    Outside Ray it does nothing (and imports nothing).  Called by ``plugin.register``.

    What Ray says wins over what the environment says: a Ray worker may have inherited another
    node's values (a runtime environment copied from a driver).  Never raises: vLLM loads the
    plugin in every engine, dedup or not.  When Ray cannot say (its node table unreachable), it
    logs a warning and removes the variables.
    """
    if not _in_ray():
        return
    try:
        node = ray_node()
    except Exception as e:
        for key in NODE_ENV:
            os.environ.pop(key, None)
        logger.warning("cannot tell which Ray node this process is on (%s); its engines will "
                       "look for the registry where a single node keeps it", e)
        return
    os.environ[NODE_ID_ENV] = node.node_id
    os.environ[NODE_DIR_ENV] = str(node.socket_dir)


def registry_env() -> dict[str, str]:
    """This process's ``VLLM_DEDUP_*`` variables less the node-local ones (`NODE_ENV`): what a
    Ray process this one starts on any node (a Serve replica, a registry actor) is given in its
    ``runtime_env``, so that it computes its node's socket directory as this process would,
    from its own node's environment for the rest (``XDG_RUNTIME_DIR``, the uid)."""
    return {k: v for k, v in os.environ.items() if k.startswith("VLLM_DEDUP_") and k not in NODE_ENV}


def local_socket_path(namespace: str) -> Path:
    """The socket of ``namespace``'s registry on this machine, for a process outside Ray (the
    `vllm-dedup status` command): `node_socket_path`; where no socket is there, the socket of
    the one other Ray node's directory on this machine that holds one (a worker node's
    registry, `_socket_dir`).

    Raises:
        ValueError: a bad namespace (see ``wire.socket_path``).
    """
    path = node_socket_path(namespace)
    if path.exists():
        return path
    base = runtime_dir()
    found = sorted(base.parent.glob(f"{glob.escape(base.name)}-node-*/{path.name}"))
    return found[0] if len(found) == 1 else path


def node_socket_path(namespace: str, node: RayNode | None = None) -> Path:
    """The registry socket of ``namespace`` on ``node`` (default: `this_node`); outside Ray,
    ``wire.socket_path(namespace)``.

    Raises:
        ValueError: a bad namespace (see ``wire.socket_path``).
    """
    plain = socket_path(namespace)  # checks the namespace
    node = node or this_node()
    return plain if node is None else node.socket_dir / plain.name
