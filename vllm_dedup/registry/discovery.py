"""How an engine finds its node's registry, or starts one (`open_registry`, `connect_registry`).

In this order:

1. a registry already answers on this node's socket for the namespace: use it (on a Ray node
   other than the head, the socket lives in that node's own directory: `nodes.py`);
2. ``registry_address="local"``: start the standalone daemon (`daemon.py`, no Ray);
3. a Ray cluster is reachable (``registry_address``, ``RAY_ADDRESS``, this process already in
   Ray, or a cluster running on this machine): get or create the node's actor (`ray_actor.py`);
4. otherwise start the standalone daemon, which outlives the engine that started it.

Nobody starts a registry by hand (docs/architecture.md, "Registry").
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import RegistryUnavailable
from ..log import init_logger
from .client import RegistryClient
from .daemon import DaemonLaunch, launch_daemon
from .nodes import NODE_ID_ENV, node_socket_path
from .ray_actor import ensure_actor, probe_ray_address
from .wire import socket_address, socket_path

__all__ = ["connect_registry", "open_registry"]

logger = init_logger(__name__)


def _ray_cluster_hint(address: str | None) -> bool:
    # NODE_ID_ENV: the process that started this engine was on a Ray node (`nodes.export_node`).
    if address or os.environ.get("RAY_ADDRESS") or os.environ.get(NODE_ID_ENV):
        return True
    try:
        import ray
    except ImportError:
        return False
    if ray.is_initialized():
        return True
    # A cluster started on this machine leaves its GCS address here (Ray's own convention); a
    # head that was killed leaves it behind, and ray.init("auto") would retry that address
    # without end: a cluster counts only where something answers there.
    try:
        current = (Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return False
    if ":" not in current or "://" in current:  # not the host:port Ray writes there
        return False
    try:
        probe_ray_address(current, timeout_s=1.0)
    except RegistryUnavailable as e:
        logger.info("no Ray cluster: %s (a stale ray_current_cluster file); starting the standalone registry", e)
        return False
    return True


def connect_registry(namespace: str, address: str | None = None, keep_warm_s: float = 0.0,
                     timeout_s: float = 60.0, reply_timeout_s: float = 30.0) -> RegistryClient:
    """A connection to this node's registry for ``namespace``, starting one if needed and
    waiting until it answers (`open_registry`, then `daemon.DaemonLaunch.wait`).

    Args:
        namespace, address, keep_warm_s, reply_timeout_s: as `open_registry`.
        timeout_s: seconds to wait for a registry this call starts to answer.

    Raises:
        RegistryUnavailable: no registry could be reached or started.
    """
    found = open_registry(namespace, address, keep_warm_s, timeout_s, reply_timeout_s, awaits_hello=False)
    if isinstance(found, RegistryClient):
        return found
    found.wait(timeout_s)
    return _connect_within(found.path, timeout_s, reply_timeout_s)


def open_registry(namespace: str, address: str | None = None, keep_warm_s: float = 0.0,
                  timeout_s: float = 60.0, reply_timeout_s: float = 30.0, awaits_hello: bool = True
                  ) -> RegistryClient | DaemonLaunch:
    """A connection to this node's registry for ``namespace``; or, where none answers and the
    standalone daemon is the one to start, that daemon's launch, not waited for (an engine's
    lease connects when it first needs the registry: Note [a lease on a registry still
    starting] in `lease.py`).

    Args:
        namespace: the registry namespace (one registry, one socket per namespace and node).
        address: ``None`` (decide as the module docstring says), ``"local"`` (standalone
            daemon, no Ray) or a Ray address (``"auto"``, ``"host:port"``).
        keep_warm_s: for a registry this call starts: seconds an unheld segment stays.
        timeout_s: seconds to wait for a Ray actor this call creates to answer.
        reply_timeout_s: the connection's timeout for any one reply (`RegistryClient`).
        awaits_hello: this process will say hello to a daemon it starts, however long that
            takes: the daemon is not idle before (Note [the engine a daemon waits for] in
            `daemon.py`).

    Raises:
        RegistryUnavailable: no registry could be reached, or an actor created.
        OSError: the daemon's launcher cannot be started.
    """
    socket_path(namespace)  # a bad namespace is the caller's error (ValueError), not a missing registry
    try:
        path = node_socket_path(namespace)
    except Exception as e:  # Ray's node table unreachable: no registry, not a failed engine
        raise RegistryUnavailable(f"cannot tell which Ray node this process is on: {e}") from None
    socket_address(path)  # a path no socket can have: said now, not after starting a daemon there
    try:
        return RegistryClient(path, reply_timeout_s)
    except RegistryUnavailable:
        pass
    if address != "local" and _ray_cluster_hint(address):  # an explicit Ray address always lands here
        # An actor that already exists serves the path its creator chose (its environment may
        # differ from ours, e.g. another VLLM_DEDUP_RUNTIME_DIR): connect there.
        return _connect_within(Path(ensure_actor(namespace, keep_warm_s, address)), timeout_s, reply_timeout_s)
    return launch_daemon(path, keep_warm_s=keep_warm_s, reply_timeout_s=reply_timeout_s,
                         awaited_pid=os.getpid() if awaits_hello else None)


def _connect_within(path: Path, timeout_s: float, reply_timeout_s: float) -> RegistryClient:
    """A connection to the registry at ``path``, trying for ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return RegistryClient(path, reply_timeout_s)
        except RegistryUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
