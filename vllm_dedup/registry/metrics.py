"""The registry's figures as Ray metrics (Prometheus format, through Ray's metrics agent).

The registry actor (`ray_actor.RegistryActor`) runs a `RegistryMetrics` exporter: every
``interval_s`` seconds it reads `Registry.stats` (a `state.RegistryStats`) and sets one gauge per figure and per (device,
share group).  Every gauge carries the registry's Ray node id as tag ``node``: each node has its
own registry (`nodes.py`), and several nodes may share one IP address.  Ray prefixes the names
with ``ray_`` on its Prometheus endpoint (the node's ``metrics_export_port``), e.g.::

    ray_vllm_dedup_saved_bytes{node="5bc7...",device="cpu",share_group="default",...} 2.7e+08

``vllm-dedup status`` prints the same figures from the same `Registry.stats`.  The standalone
daemon (no Ray) exports nothing: it has no metrics agent to talk to.
"""

from __future__ import annotations

import threading
from typing import Callable

from ..log import init_logger
from .state import RegistryStats

__all__ = ["GAUGES", "RegistryMetrics"]

logger = init_logger(__name__)

# `state.GroupStats` field -> (gauge name, description)
GAUGES = {
    "engines": ("vllm_dedup_engines", "Engines connected to the weight registry."),
    "segments": ("vllm_dedup_segments", "Published weight segments (each stored once)."),
    "resident_bytes": ("vllm_dedup_resident_bytes", "Bytes of published segments, stored once (bytes)."),
    "shared_bytes": ("vllm_dedup_shared_bytes", "Bytes of segments mapped by two or more engines (bytes)."),
    "mapped_bytes": ("vllm_dedup_mapped_bytes", "Bytes of segments mapped, counted once per engine (bytes)."),
    "saved_bytes": ("vllm_dedup_saved_bytes", "Weight bytes engines mapped instead of storing again (bytes)."),
}
TAG_KEYS = ("node", "device", "share_group")


class RegistryMetrics:
    """Exports ``stats()`` as Ray gauges from a daemon thread.

    Args:
        stats: returns the current `Registry.stats` (thread-safe: `RegistryServer.stats`).
        node: the Ray node id of the registry, the ``node`` tag of every gauge.
        interval_s: seconds between updates (Ray's agent itself reports every few seconds).

    Raises:
        ImportError: Ray is not installed.
    """

    def __init__(self, stats: Callable[[], RegistryStats], node: str, interval_s: float = 2.0):
        from ray.util.metrics import Gauge

        self._stats = stats
        self._node = node
        self._interval_s = interval_s
        self._gauges = {field: Gauge(name, description=desc, tag_keys=TAG_KEYS)
                        for field, (name, desc) in GAUGES.items()}
        self._collisions = Gauge("vllm_dedup_hash_collisions",
                                 description="Hash collisions caught by engines' exact compares.",
                                 tag_keys=("node",))
        self._seen: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vllm-dedup-metrics", daemon=True)

    def start(self) -> RegistryMetrics:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def update(self) -> None:
        """Set every gauge from the current stats.  A (device, group) that went away is set to 0
        once and then forgotten: Ray keeps exporting a gauge's last value, and a long-lived
        registry that saw many groups come and go would otherwise set them all on every update."""
        stats = self._stats()
        now = set()
        for group in stats.groups:
            tags = {"node": self._node, "device": group.device, "share_group": group.share_group}
            now.add((group.device, group.share_group))
            for field, gauge in self._gauges.items():
                gauge.set(getattr(group, field), tags=tags)
        for device, share_group in self._seen - now:
            for gauge in self._gauges.values():
                gauge.set(0, tags={"node": self._node, "device": device, "share_group": share_group})
        self._seen = now
        self._collisions.set(stats.collisions, tags={"node": self._node})

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.update()
            except Exception:  # metrics must never take the registry down
                logger.exception("metrics update failed")
