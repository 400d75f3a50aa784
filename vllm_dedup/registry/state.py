"""The registry: which content is resident where, and who holds it.

Plain state and small methods, no I/O: the server (`server.py`) drives it from its socket
thread, the Ray actor (`ray_actor.py`) and the standalone daemon (`daemon.py`) host that
server, and tests call it directly.  Everything lives in one place, `Registry`:

- segments: id -> `SegmentEntry` (the registry's own descriptor, size, device, share group, the
  content keys it holds, the engines holding it);
- index: (device, share group, content key) -> (segment id, offset, bytes);
- engines: id -> `EngineEntry` (pid, uid, model, device, share group, segments held);
- locks: name -> `LockEntry` (an owner and the engines holding it for that owner).  One publish
  lock per device and share group makes engines loading at the same moment map each other's
  tensors instead of each publishing its own copy.  One start-up lock per device
  (`startup_lock_name`) serialises engines' memory profiling on a GPU; while it is held, no
  segment of that device is freed (a free would make the starting engine's profile see memory
  appear that it did not release).  Engines that are the TP ranks of one vLLM instance pass one
  owner and so share a lock instead of waiting for each other;
- recipes: (share group, load signature) -> up to `MAX_RECIPES` recipes, newest last: how an
  engine's final tensors came from its checkpoint (docs/architecture.md, "Loading only what is
  not resident").  The registry keeps each as a sealed memfd it hands to later engines, and
  knows its final content keys, from which it predicts how many of an engine's bytes are
  already resident (`expected_shared_bytes`, for vLLM's memory accounting).

An engine's references and locks live exactly as long as its connection (its lease):
`drop_engine` runs when the connection closes, however the engine ended.  A registry that
replaces one that died (`begin_reclaim`, called by the server when it finds the dead one's
socket) refuses new locks for `RECLAIM_GRACE_S` while the live engines re-register: an engine
that held a lock (started publishing, or profiling its GPU) reclaims it first, so that a
newcomer never publishes beside it a second copy of what it holds.  A segment nobody holds is freed at once,
or after ``keep_warm_s`` seconds so that a restarting engine maps instead of loading.

Keys never cross share groups or devices: a lookup only sees entries of its own pair.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import asdict, dataclass, field, fields

__all__ = ["EngineEntry", "EngineStats", "GroupStats", "Hit", "LockEntry", "RecipeEntry", "Registry", "RegistryStats",
           "SegmentEntry", "startup_lock_name"]

STARTUP_LOCK_PREFIX = "startup:"
MAX_RECIPES = 8  # per (share group, load signature): a base model and a few fine-tunes of it
# Recipes in all, over every share group and signature: each keeps a descriptor and is listed
# nowhere an engine could clean up, so peers drawing new signatures could otherwise exhaust
# the registry's descriptors.  Beyond it the oldest recipe goes (its engines load as usual).
MAX_KEPT_RECIPES = 512
# Bytes of recipes in all (their memfds; the parsed final keys of the newest of each signature
# take several times that on the heap): beyond it the oldest goes, as beyond `MAX_KEPT_RECIPES`.
# A 1.2B Llama's recipe is about 0.1 MB; 512 of the largest a recipe may be would be 32 GiB.
MAX_KEPT_RECIPE_BYTES = 256 << 20
# Content keys one engine may publish: one per tensor on the CPU (a segment each), and a key
# costs the registry about 400 bytes (segment, index and engine entries).  Nothing else bounds
# what one connection makes the registry keep.
MAX_KEYS_PER_ENGINE = 1 << 20
# Locks one engine may hold: a start-up lock per device and the publish lock are what engines
# take; each is kept while its connection lives and listed by every `stats` reply.
MAX_LOCKS_PER_ENGINE = 64
# Keys of one segment: one publish names at most `messages.MAX_ITEMS`; re-registrations of it
# (uid) name subsets of the same keys, so only a peer naming new ones could pass this.
MAX_SEGMENT_KEYS = 1 << 16
# Seconds a registry that replaced a dead one refuses new locks (reclaims are granted): live
# engines notice the death at once and re-register within about a second (their lease starts a
# daemon again if needed); ten leaves room for a machine under load.
RECLAIM_GRACE_S = 10.0


def startup_lock_name(device: str) -> str:
    """The start-up lock of a device key (``"startup:cuda:GPU-..."``)."""
    return STARTUP_LOCK_PREFIX + device


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
    deferred: bool = False  # unheld, kept because its device's start-up lock is held
    uid: str = ""  # drawn by its publisher; names it across registry restarts
    where: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)  # key -> its first (offset, bytes)

    def __post_init__(self):
        self.add_keys(self.keys, listed=True)

    def add_keys(self, keys: list[tuple[str, int, int]], listed: bool = False) -> None:
        """Record ``keys`` (in ``keys`` already when ``listed``); a key's first place wins."""
        if not listed:
            self.keys += keys
        for key, offset, nbytes in keys:
            self.where.setdefault(key, (offset, nbytes))


@dataclass
class EngineEntry:
    """A connected engine and what it holds."""

    id: int
    pid: int
    uid: int
    model: str
    device: str
    group: str
    signature: str = ""  # what determines its tensors' bytes (model, dtype, TP rank, ...)
    segments: set[int] = field(default_factory=set)
    published_keys: int = 0  # keys its publishes named (`MAX_KEYS_PER_ENGINE`)
    load: dict = field(default_factory=dict)  # its `engine.context.LoadReport`, as reported


@dataclass
class LockEntry:
    """A held lock: its owner and the engines holding it on the owner's behalf."""

    owner: str
    holders: set[int] = field(default_factory=set)


@dataclass
class RecipeEntry:
    """A recipe: ``fd`` (the registry's own descriptor of the sealed memfd holding it), its
    size in bytes, and the final content keys it names (key -> bytes; the newest recipe of a
    signature only: `expected_shared_bytes` reads no other)."""

    id: str
    fd: int
    nbytes: int
    final: dict[str, int]
    order: int = 0  # when it was kept: the oldest of all goes first beyond `MAX_KEPT_RECIPES`


@dataclass(frozen=True)
class Hit:
    """A lookup result: content ``key`` lies at ``offset`` in segment ``segment`` (``uid`` and
    ``segment_bytes`` name and size the segment, as a client learns them)."""

    key: str
    segment: int
    offset: int
    nbytes: int
    uid: str = ""
    segment_bytes: int = 0


@dataclass
class GroupStats:
    """Figures of one (device, share group).  Bytes are segment sizes (allocated bytes).

    Attributes:
        resident_bytes: bytes of the published segments (stored once).
        shared_bytes: bytes of the segments that two or more engines map.
        mapped_bytes: bytes the connected engines map, counted per engine.
        saved_bytes: bytes the connected engines mapped from others' segments instead of
            storing them again (their reported ``shared_bytes``).
        deferred_segments: unheld segments kept because a start-up on the device is running.
    """

    device: str
    share_group: str
    engines: int = 0
    segments: int = 0
    resident_bytes: int = 0
    shared_bytes: int = 0
    mapped_bytes: int = 0
    saved_bytes: int = 0
    deferred_segments: int = 0


@dataclass
class EngineStats:
    """One connected engine: who it is and what its load did (``load``: the numbers of its
    `engine.context.LoadReport`, empty until it reported)."""

    id: int
    pid: int
    model: str
    device: str
    share_group: str
    signature: str
    segments: int
    load: dict


@dataclass
class RegistryStats:
    """What `Registry.stats` returns; ``to_dict`` is what ``vllm-dedup status --json`` prints
    and what travels over the socket (`from_dict` reads it back)."""

    groups: list[GroupStats]
    engines: list[EngineStats]
    locks: dict[str, int]  # lock name -> pid of an engine holding it
    collisions: int
    keep_warm_s: float
    registry_pid: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RegistryStats:
        """Read `to_dict`'s form back; fields a newer registry adds are left out.

        Raises:
            KeyError, TypeError, ValueError: a field is missing or of the wrong kind.
        """
        def known(kind, d: dict) -> dict:
            names = {f.name for f in fields(kind)}
            return {k: v for k, v in d.items() if k in names}

        return cls(groups=[GroupStats(**known(GroupStats, g)) for g in data["groups"]],
                   engines=[EngineStats(**known(EngineStats, e)) for e in data["engines"]],
                   locks=dict(data["locks"]), collisions=data["collisions"], keep_warm_s=data["keep_warm_s"],
                   registry_pid=data["registry_pid"])

    def engine(self, pid: int) -> EngineStats | None:
        """The engine with process id ``pid``, or None."""
        return next((e for e in self.engines if e.pid == pid), None)


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
        self.locks: dict[str, LockEntry] = {}
        self.recipes: dict[tuple[str, str], list[RecipeEntry]] = {}  # (group, signature) -> oldest first
        # (device, share group, segment uid) -> id: a uid names a segment only where it lies,
        # so a peer repeating one in another pair cannot take it over.
        self._uids: dict[tuple[str, str, str], int] = {}
        self._ids = itertools.count(1)
        self.collisions = 0  # caught by engines' exact compares, over the registry's life
        self.reclaim_until = 0.0  # time.monotonic() until which only reclaimed locks are granted

    def begin_reclaim(self, seconds: float = RECLAIM_GRACE_S) -> None:
        """This registry replaces one that died: for ``seconds``, grant locks only to engines
        reclaiming what they held (`try_lock` with ``reclaim``)."""
        self.reclaim_until = time.monotonic() + seconds

    # engines ---------------------------------------------------------------------------
    def add_engine(self, pid: int, uid: int, model: str, device: str, group: str, signature: str = "") -> int:
        """Register a connected engine; returns its id.  ``signature`` names what decides its
        tensors' bytes (default: the model)."""
        engine = EngineEntry(next(self._ids), pid, uid, model, device, group, signature or model)
        self.engines[engine.id] = engine
        return engine.id

    def drop_engine(self, engine_id: int) -> None:
        """Forget an engine, release every segment and lock it held (its connection closed)."""
        engine = self.engines.pop(engine_id, None)
        if engine is None:
            return
        self._free([seg for seg_id in list(engine.segments) if (seg := self._unhold(seg_id, engine_id))])
        self.unlock(engine_id, [n for n, lock in self.locks.items() if engine_id in lock.holders])

    # lookups and publishing ------------------------------------------------------------
    def acquire(self, engine_id: int, keys: list[str], uids: list[str] | None = None) -> list[Hit]:
        """Find ``keys`` in the engine's (device, group) and hold the segments of the hits.
        With ``uids`` (one per key), a key is found only in the segment of that uid.

        The engine must `release` a hit's segment if its exact compare fails.
        """
        engine = self.engines[engine_id]
        hits = []
        for key, uid in zip(keys, uids or [None] * len(keys)):
            found = (self.index.get((engine.device, engine.group, key)) if uid is None
                     else self._in_segment(engine, key, uid))
            if found is None:
                continue
            seg_id, offset, nbytes = found
            self._hold(seg_id, engine_id)
            hits.append(Hit(key, seg_id, offset, nbytes))
        return hits

    def _in_segment(self, engine: EngineEntry, key: str, uid: str) -> tuple[int, int, int] | None:
        """(segment, offset, bytes) of ``key`` in the segment named ``uid``, if it is resident in
        the engine's (device, group) and holds that key."""
        seg = self.segments.get(self._uids.get((engine.device, engine.group, uid), -1))
        place = seg.where.get(key) if seg is not None else None
        return None if place is None else (seg.id, *place)

    def publish(self, engine_id: int, fd: int, nbytes: int, keys: list[tuple[str, int, int]], uid: str = "") -> int:
        """Record a segment (the registry now owns ``fd``) holding ``keys``; the publishing
        engine holds it.  ``keys``: (content key, offset, bytes) per tensor.  A key already
        indexed keeps its first segment.

        A segment whose ``uid`` is already known (engines holding one segment re-register it
        after a registry restart, each with the keys it knows) is not stored twice: ``fd`` is
        closed, the keys that lie within it are added to it (one past its end, from a peer
        that says another size, could only fail every acquire of that key), up to
        `MAX_SEGMENT_KEYS` in all, and the engine holds it.

        Raises:
            ValueError: the engine's publishes would name more than `MAX_KEYS_PER_ENGINE` keys
                (nothing is recorded; ``fd`` stays the caller's).
        """
        engine = self.engines[engine_id]
        if engine.published_keys + len(keys) > MAX_KEYS_PER_ENGINE:
            raise ValueError(f"an engine may publish at most {MAX_KEYS_PER_ENGINE} content keys; this one has "
                             f"published {engine.published_keys}")
        engine.published_keys += len(keys)
        seg = self.segments.get(self._uids.get((engine.device, engine.group, uid), -1)) if uid else None
        if seg is not None:
            self._close(fd)
            known = set(seg.keys)  # a set: a list scanned per key made a big re-publish quadratic
            fresh = list(dict.fromkeys(k for k in keys if k[1] + k[2] <= seg.nbytes and k not in known))
            fresh = fresh[:max(0, MAX_SEGMENT_KEYS - len(seg.keys))]  # a peer may name any keys, again and again
            seg.add_keys(fresh)
            keys = [k for k in keys if k in known] + fresh
        else:
            seg = SegmentEntry(next(self._ids), fd, nbytes, engine.device, engine.group, list(keys), uid=uid)
            self.segments[seg.id] = seg
            if uid:
                self._uids[(engine.device, engine.group, uid)] = seg.id
        for key, offset, size in keys:
            self.index.setdefault((engine.device, engine.group, key), (seg.id, offset, size))
        self._hold(seg.id, engine_id)
        return seg.id

    def release(self, engine_id: int, seg_ids: list[int]) -> None:
        """The engine no longer maps these segments (e.g. its exact compare failed)."""
        self._free([seg for seg_id in dict.fromkeys(seg_ids) if (seg := self._unhold(seg_id, engine_id))])

    def report(self, engine_id: int, load: dict) -> None:
        """Record an engine's load outcome (its `engine.context.LoadReport` numbers and load
        path; values other than numbers and strings are dropped) and the hash collisions its
        exact compares caught, which `stats` totals.  A second report of an engine replaces its
        first, in the total too."""
        engine = self.engines[engine_id]
        before = int(engine.load.get("collisions", 0))
        engine.load = {k: v for k, v in load.items() if isinstance(v, (int, float, str))}
        self.collisions += int(engine.load.get("collisions", 0)) - before

    # recipes -------------------------------------------------------------------------------
    def put_recipe(self, engine_id: int, fd: int, nbytes: int, signature: str, recipe_id: str,
                   final: dict[str, int]) -> None:
        """Keep a recipe (the registry now owns ``fd``) for the engine's share group and
        ``signature``.  A recipe with the same id replaces the older one; beyond `MAX_RECIPES`
        the oldest goes."""
        engine = self.engines[engine_id]
        kept = self.recipes.setdefault((engine.group, signature), [])
        for old in [r for r in kept if r.id == recipe_id]:
            kept.remove(old)
            self._close(old.fd)
        for older in kept:
            older.final = {}
        kept.append(RecipeEntry(recipe_id, fd, nbytes, dict(final), next(self._ids)))
        while len(kept) > MAX_RECIPES:
            self._close(kept.pop(0).fd)
        while (sum(map(len, self.recipes.values())) > MAX_KEPT_RECIPES
               or sum(r.nbytes for each in self.recipes.values() for r in each) > MAX_KEPT_RECIPE_BYTES):
            slot = min(self.recipes, key=lambda s: self.recipes[s][0].order)
            self._close(self.recipes[slot].pop(0).fd)
            if not self.recipes[slot]:
                del self.recipes[slot]

    def recipes_for(self, engine_id: int, signature: str) -> list[RecipeEntry]:
        """The recipes kept for the engine's share group and ``signature``, newest first."""
        engine = self.engines[engine_id]
        return list(reversed(self.recipes.get((engine.group, signature), [])))

    def expected_shared_bytes(self, device: str, group: str, signature: str) -> int:
        """Bytes an engine with this load signature will map from resident segments of
        ``device``: the resident bytes of the newest recipe for that signature (0 if none).

        Exact when the engine loads the checkpoint that recipe came from and nothing it names
        has been freed since; a fine-tune of it maps less (its changed modules)."""
        kept = self.recipes.get((group, signature))
        if not kept:
            return 0
        return sum(n for key, n in kept[-1].final.items() if (device, group, key) in self.index)

    # locks -------------------------------------------------------------------------------
    def try_lock(self, engine_id: int, names: str | list[str], owner: str | None = None,
                 reclaim: bool = False) -> int | None:
        """Take every lock of ``names`` for the engine, or none of them.

        All-or-nothing, so two engines each needing several locks (the TP ranks of two
        instances, each rank taking every device's start-up lock) cannot each hold a part and
        wait for the other.  A lock held for the same ``owner`` is shared (default owner: the
        engine alone).  During the reclaim period (`begin_reclaim`) only ``reclaim`` requests
        (an engine re-registering a lock it held in the registry that died) are granted.

        Returns:
            None when granted; else the pid of an engine holding one of them for another owner,
            or 0 when refused because the reclaim period is not over.
        """
        names = [names] if isinstance(names, str) else list(names)
        held = {name for name, lock in self.locks.items() if engine_id in lock.holders}
        if len(held | set(names)) > MAX_LOCKS_PER_ENGINE:
            raise ValueError(f"an engine may hold at most {MAX_LOCKS_PER_ENGINE} registry locks")
        if not reclaim and time.monotonic() < self.reclaim_until:
            return 0
        owner = owner or f"engine:{engine_id}"
        for name in names:
            lock = self.locks.get(name)
            if lock is not None and lock.owner != owner:
                return self.engines[min(lock.holders)].pid
        for name in names:
            self.locks.setdefault(name, LockEntry(owner)).holders.add(engine_id)
        return None

    def unlock(self, engine_id: int, names: str | list[str]) -> None:
        """Give locks back (a no-op for those the engine does not hold).  When a device's
        start-up lock is free again, the segments whose free it deferred are freed."""
        for name in [names] if isinstance(names, str) else names:
            lock = self.locks.get(name)
            if lock is None or engine_id not in lock.holders:
                continue
            lock.holders.discard(engine_id)
            if not lock.holders:
                del self.locks[name]
                if name.startswith(STARTUP_LOCK_PREFIX):
                    self._free_deferred(name.removeprefix(STARTUP_LOCK_PREFIX))

    # lifetime ----------------------------------------------------------------------------
    def _hold(self, seg_id: int, engine_id: int) -> None:
        seg = self.segments[seg_id]
        seg.holders.add(engine_id)
        seg.idle_since = None
        seg.deferred = False
        self.engines[engine_id].segments.add(seg_id)

    def _unhold(self, seg_id: int, engine_id: int) -> SegmentEntry | None:
        """The engine no longer holds the segment; returns it where it is to be freed now (the
        caller frees it, with the others it let go of, in one `_free`)."""
        seg = self.segments.get(seg_id)
        if engine_id in self.engines:
            self.engines[engine_id].segments.discard(seg_id)
        if seg is None:
            return None
        seg.holders.discard(engine_id)
        if not seg.holders:
            if self.keep_warm_s > 0:
                seg.idle_since = time.monotonic()
            elif startup_lock_name(seg.device) in self.locks:
                seg.deferred = True
            else:
                return seg
        return None

    def _free_deferred(self, device: str) -> None:
        self._free([s for s in self.segments.values() if s.device == device and s.deferred and not s.holders])

    def expire(self, now: float | None = None) -> int:
        """Free unheld segments whose keep-warm time is over; returns how many."""
        now = time.monotonic() if now is None else now
        due = [s for s in self.segments.values() if not s.holders and s.idle_since is not None
               and now - s.idle_since >= self.keep_warm_s and startup_lock_name(s.device) not in self.locks]
        self._free(due)
        return len(due)

    def _free(self, segments: list[SegmentEntry], reindex: bool = True) -> None:
        """Forget these segments and close their descriptors; then point each key the index
        named them for at another segment that holds it (`_reindex`), once per (device, group)
        for the whole batch: an engine dropping hundreds of segments (one per tensor on the
        CPU) reindexed once per segment took time quadratic in the segments."""
        orphans: dict[tuple[str, str], set[str]] = {}
        for seg in segments:
            del self.segments[seg.id]
            self._uids.pop((seg.device, seg.group, seg.uid), None)
            for key in seg.where:
                if self.index.get((seg.device, seg.group, key), (None,))[0] == seg.id:
                    del self.index[(seg.device, seg.group, key)]
                    orphans.setdefault((seg.device, seg.group), set()).add(key)
            self._close(seg.fd)
        if reindex:
            for (device, group), keys in orphans.items():
                self._reindex(device, group, keys)

    def _reindex(self, device: str, group: str, keys: set[str]) -> None:
        """Point ``keys`` at another resident segment of (``device``, ``group``) that holds them.

        Two engines that missed a key at the same moment may each publish it; the index names
        the first segment, and when that one goes the second still holds the bytes.  One pass
        over the pair's segments, oldest first, so the index keeps naming the oldest copy; each
        segment costs the smaller of its keys and those left (many orphans against many small
        segments cost their product: 15.7 s for 65,536 against 4,000, a client's publishes)."""
        for other in sorted((s for s in self.segments.values() if (s.device, s.group) == (device, group)),
                            key=lambda s: s.id):
            small, large = (keys, other.where) if len(keys) <= len(other.where) else (other.where, keys)
            for key in [key for key in small if key in large]:
                self.index[(device, group, key)] = (other.id, *other.where[key])
                keys.discard(key)
            if not keys:
                return

    def close(self) -> None:
        """Free everything (the registry is shutting down)."""
        self._free(list(self.segments.values()), reindex=False)
        for kept in self.recipes.values():
            for recipe in kept:
                self._close(recipe.fd)
        self.recipes.clear()
        self.engines.clear()

    # reporting ---------------------------------------------------------------------------
    def stats(self) -> RegistryStats:
        """Engines, segments and bytes per (device, share group) (see `GroupStats`)."""
        groups: dict[tuple[str, str], GroupStats] = {}

        def group(device: str, share_group: str) -> GroupStats:
            return groups.setdefault((device, share_group), GroupStats(device, share_group))

        for seg in self.segments.values():
            g = group(seg.device, seg.group)
            g.segments += 1
            g.resident_bytes += seg.nbytes
            g.deferred_segments += seg.deferred
            g.mapped_bytes += seg.nbytes * len(seg.holders)
            if len(seg.holders) >= 2:
                g.shared_bytes += seg.nbytes
        for engine in self.engines.values():
            g = group(engine.device, engine.group)
            g.engines += 1
            g.saved_bytes += engine.load.get("shared_bytes", 0)
        return RegistryStats(
            groups=[groups[k] for k in sorted(groups)],
            engines=[EngineStats(e.id, e.pid, e.model, e.device, e.group, e.signature, len(e.segments), e.load)
                     for e in self.engines.values()],
            locks={name: self.engines[min(lock.holders)].pid for name, lock in self.locks.items()},
            collisions=self.collisions,
            keep_warm_s=self.keep_warm_s,
            registry_pid=os.getpid(),
        )
