"""The registry: which content is resident where, and who holds it.

Plain state and small methods, no I/O: the broker (`broker.py`) drives it from its socket
thread, the Ray actor (`actor.py`) and the standalone daemon host that broker, and tests call it
directly.  Everything lives in one place, `Registry`:

- segments: id -> `SegmentEntry` (the broker's own descriptor, size, device, share group, the
  content keys it holds, the engines holding it);
- index: (device, share group, content key) -> (segment id, offset, bytes);
- engines: id -> `EngineEntry` (pid, uid, model, device, share group, segments held);
- locks: name -> the engine holding it (e.g. one publish lock per device and share group, so
  that engines loading at the same moment map each other's tensors instead of each publishing
  its own copy).

An engine's references and locks live exactly as long as its connection (its lease):
`drop_engine` runs when the connection closes, however the engine ended.  A segment nobody holds is freed at once,
or after ``keep_warm_s`` seconds so that a restarting engine maps instead of loading.

Keys never cross share groups or devices: a lookup only sees entries of its own pair.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["Registry", "SegmentEntry", "EngineEntry", "Hit"]


@dataclass
class SegmentEntry:
    """A published segment.  ``fd`` is the registry's own copy of its descriptor."""

    id: int
    fd: int
    nbytes: int
    device: str
    group: str
    keys: list[tuple[str, int, int]]  # (content key, offset, bytes) of each tensor it holds
    holders: set[int] = field(default_factory=set)
    idle_since: float | None = None


@dataclass
class EngineEntry:
    """A connected engine and what it holds."""

    id: int
    pid: int
    uid: int
    model: str
    device: str
    group: str
    segments: set[int] = field(default_factory=set)
    load: dict = field(default_factory=dict)  # its `share.ShareResult`, as reported


@dataclass(frozen=True)
class Hit:
    """A lookup result: content ``key`` lies at ``offset`` in segment ``segment``."""

    key: str
    segment: int
    offset: int
    nbytes: int


class Registry:
    """Content key -> resident segment, per (device, share group); see the module docstring.

    Args:
        keep_warm_s: seconds an unheld segment stays published before it is freed.
        close: called with a segment's descriptor when it is freed (``os.close``; tests may
            observe it).
    """

    def __init__(self, keep_warm_s: float = 0.0, close=os.close):
        self.keep_warm_s = keep_warm_s
        self._close = close
        self.segments: dict[int, SegmentEntry] = {}
        self.index: dict[tuple[str, str, str], tuple[int, int, int]] = {}
        self.engines: dict[int, EngineEntry] = {}
        self.locks: dict[str, int] = {}  # lock name -> holding engine id
        self._ids = itertools.count(1)
        self.collisions = 0  # caught by engines' exact compares, over the registry's life

    # engines ---------------------------------------------------------------------------
    def add_engine(self, pid: int, uid: int, model: str, device: str, group: str) -> int:
        """Register a connected engine; returns its id."""
        engine = EngineEntry(next(self._ids), pid, uid, model, device, group)
        self.engines[engine.id] = engine
        return engine.id

    def drop_engine(self, engine_id: int) -> None:
        """Forget an engine, release every segment and lock it held (its connection closed)."""
        engine = self.engines.pop(engine_id, None)
        if engine is None:
            return
        for name in [n for n, holder in self.locks.items() if holder == engine_id]:
            del self.locks[name]
        for seg_id in list(engine.segments):
            self._unhold(seg_id, engine_id)

    # lookups and publishing ------------------------------------------------------------
    def acquire(self, engine_id: int, keys: list[str]) -> list[Hit]:
        """Find ``keys`` in the engine's (device, group) and hold the segments of the hits.

        The engine must `release` a hit's segment if its exact compare fails.
        """
        engine = self.engines[engine_id]
        hits = []
        for key in keys:
            found = self.index.get((engine.device, engine.group, key))
            if found is None:
                continue
            seg_id, offset, nbytes = found
            self._hold(seg_id, engine_id)
            hits.append(Hit(key, seg_id, offset, nbytes))
        return hits

    def publish(self, engine_id: int, fd: int, nbytes: int, keys: list[tuple[str, int, int]]) -> int:
        """Record a new segment (the registry now owns ``fd``) holding ``keys``; the publishing
        engine holds it.  ``keys``: (content key, offset, bytes) per tensor.  A key already
        indexed keeps its first segment."""
        engine = self.engines[engine_id]
        seg = SegmentEntry(next(self._ids), fd, nbytes, engine.device, engine.group, list(keys))
        self.segments[seg.id] = seg
        for key, offset, size in keys:
            self.index.setdefault((engine.device, engine.group, key), (seg.id, offset, size))
        self._hold(seg.id, engine_id)
        return seg.id

    def release(self, engine_id: int, seg_ids: list[int]) -> None:
        """The engine no longer maps these segments (e.g. its exact compare failed)."""
        for seg_id in seg_ids:
            self._unhold(seg_id, engine_id)

    def report(self, engine_id: int, load: dict) -> None:
        """Record an engine's load outcome (tensors and bytes shared, published, private, and
        the hash collisions its exact compares caught, which `stats` totals)."""
        self.engines[engine_id].load = {k: v for k, v in load.items() if isinstance(v, (int, float))}
        self.collisions += int(load.get("collisions", 0))

    # locks -------------------------------------------------------------------------------
    def try_lock(self, engine_id: int, name: str) -> int | None:
        """Take lock ``name`` for the engine if it is free (or already the engine's).

        Returns:
            None when granted, else the pid of the engine holding it.
        """
        holder = self.locks.setdefault(name, engine_id)
        return None if holder == engine_id else self.engines[holder].pid

    def unlock(self, engine_id: int, name: str) -> None:
        """Give lock ``name`` back (a no-op unless the engine holds it)."""
        if self.locks.get(name) == engine_id:
            del self.locks[name]

    def fd_of(self, seg_id: int) -> int:
        return self.segments[seg_id].fd

    # lifetime ----------------------------------------------------------------------------
    def _hold(self, seg_id: int, engine_id: int) -> None:
        seg = self.segments[seg_id]
        seg.holders.add(engine_id)
        seg.idle_since = None
        self.engines[engine_id].segments.add(seg_id)

    def _unhold(self, seg_id: int, engine_id: int) -> None:
        seg = self.segments.get(seg_id)
        if engine_id in self.engines:
            self.engines[engine_id].segments.discard(seg_id)
        if seg is None:
            return
        seg.holders.discard(engine_id)
        if not seg.holders:
            if self.keep_warm_s > 0:
                seg.idle_since = time.monotonic()
            else:
                self._free(seg)

    def expire(self, now: float | None = None) -> int:
        """Free unheld segments whose keep-warm time is over; returns how many."""
        now = time.monotonic() if now is None else now
        due = [s for s in self.segments.values() if not s.holders and s.idle_since is not None
               and now - s.idle_since >= self.keep_warm_s]
        for seg in due:
            self._free(seg)
        return len(due)

    def _free(self, seg: SegmentEntry) -> None:
        del self.segments[seg.id]
        for key, _, _ in seg.keys:
            if self.index.get((seg.device, seg.group, key), (None,))[0] == seg.id:
                del self.index[(seg.device, seg.group, key)]
        self._close(seg.fd)

    def close(self) -> None:
        """Free everything (the registry is shutting down)."""
        for seg in list(self.segments.values()):
            self._free(seg)
        self.engines.clear()

    # reporting ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Engines, segments and bytes per (device, share group).

        ``resident_bytes``: bytes of the published segments (stored once).
        ``shared_bytes``: bytes of the segments that two or more engines map.
        ``mapped_bytes``: bytes the connected engines map, counted per engine.
        ``saved_bytes``: what the engines would hold without sharing minus what is resident,
        i.e. the bytes the engines mapped from others' segments.
        """
        groups: dict[tuple[str, str], dict] = defaultdict(
            lambda: {"engines": 0, "segments": 0, "resident_bytes": 0, "shared_bytes": 0, "mapped_bytes": 0,
                     "saved_bytes": 0}
        )
        for seg in self.segments.values():
            g = groups[(seg.device, seg.group)]
            g["segments"] += 1
            g["resident_bytes"] += seg.nbytes
            g["mapped_bytes"] += seg.nbytes * len(seg.holders)
            if len(seg.holders) >= 2:
                g["shared_bytes"] += seg.nbytes
        for engine in self.engines.values():
            g = groups[(engine.device, engine.group)]
            g["engines"] += 1
            g["saved_bytes"] += engine.load.get("shared_bytes", 0)
        return {
            "groups": [{"device": d, "share_group": grp, **v} for (d, grp), v in sorted(groups.items())],
            "engines": [
                {"id": e.id, "pid": e.pid, "model": e.model, "device": e.device, "share_group": e.group,
                 "segments": len(e.segments), "load": e.load}
                for e in self.engines.values()
            ],
            "locks": {name: self.engines[holder].pid for name, holder in self.locks.items()},
            "collisions": self.collisions,
            "keep_warm_s": self.keep_warm_s,
            "registry_pid": os.getpid(),
        }

