"""Publish in place where segments come in granules (the CUDA backend): a usual load's
parameters live in packed segments of this engine's own from before ``load_weights``, and the
sharing pass publishes a pack's segment where it lies.

The host backend gives every storage a memfd of its own (`in_place.py`): a page costs nothing
to round to.  A CUDA allocation comes in granules of 2 MiB (`segments.packing`), so storages are
packed: several to an allocation, each at its offset, each a storage of its own there
(`Segment.member`), so that to vLLM and to the sharing pass the model looks as after a plain
load.

1. `PackedInPlace.place`, right after vLLM builds the model: plan the storages the sharing pass
   would take into packs of consecutive storages, allocate each pack's segment (`Segment.allocate`, read-write), copy
   what each storage holds already (a rotary cache computed at construction), rebind the
   model's places (`slots.swap_out`).  The storages vLLM allocated go back to its allocator as
   they are replaced, and the allocator gives its cache back to the device every
   ``_RETURN_EVERY`` bytes (Note [one copy at a time]).
2. vLLM's weight loaders write the checkpoint into the segments; post-processing runs on them as
   on any tensor.
3. The sharing pass keys every tensor as before, then asks `PackedInPlace.packs` which packs it
   can publish as they lie: those whose every member is still bound where it was placed and is
   the first tensor of a content key no engine holds (a *miss*).  Each is made read-only
   (`Segment.freeze`) and published: no copy.  Every other miss is planned and copied as before.

A pack some of whose members are mapped from another engine instead (a fine-tune's shared
layers) or were replaced by post-processing is published only when those are at most a granule
(Note [what a pack may hold when it is published]); otherwise its misses are copied, and its
allocation goes with the last tensor over it (Note [a pack lives while a member does]).

Nothing here stops a load: a pack that cannot be allocated leaves the rest where vLLM put them,
and a storage that cannot be moved stays (`in_place.py`, Note [a storage held elsewhere]).

Note [one copy at a time]
    Placing copies storage by storage: the new allocation, then the old storage freed.  On a
    GPU the freed storage goes to PyTorch's caching allocator, not to the device, so without
    returning the cache the device would hold the whole model twice by the end of `place`.
    The cache is returned every ``_RETURN_EVERY`` bytes (``torch.cuda.empty_cache``, no
    garbage collection: a replaced storage is freed by its reference count).  It returns only
    allocator segments with no block in use, and tensors over 1 MiB and under 10 MiB share
    20 MiB segments, smaller ones 2 MiB segments (PyTorch's ``CUDACachingAllocator``,
    ``get_allocation_size``: ``kLargeBuffer``, ``kSmallBuffer``), so storages are moved in the order
    vLLM made them, the model's order: packs hold consecutive storages (`plan_packs`'
    ``in_order``), a pack is allocated only when the one before is filled, and each allocator
    segment empties soon after it stops being used.  The excess over a plain load then stays
    near one pack (64 MiB at most, or one bigger tensor) plus ``_RETURN_EVERY``.  A pack the
    sharing pass cannot publish as it lies is copied the same way, one pack at a time: its
    misses planned apart from the others' (`packs`' ``regroup``), so that it goes as soon as
    they are copied.  Consecutive
    layers in one pack also suit a fine-tune: the packs of its retrained layers are all its own,
    published where they lie.

Note [what a pack may hold when it is published]
    Publishing a pack makes all of it read-only and keeps all of it while the registry or any
    engine holds it.  So every member must be a miss published with it, or dead: a storage
    nothing uses any more, because post-processing replaced it (vLLM repacks an MoE layer's
    experts, a quantized layer's weights) or the sharing pass mapped it from another engine.
    A member still in use but not published (its bytes collide with a resident key's) would
    turn read-only under a tensor that may be written: such a pack is copied.  A dead member's
    bytes are padding from then on, so a pack is published only while they are at most a
    granule, the padding its size already rounds up to; past that, copying the misses into a
    tight pack and letting this one go keeps less memory for good than one copy costs once.

Note [a pack lives while a member does]
    An allocation is freed when no mapping of it is left, and each member tensor holds the
    mapping.  A member kept private (its bytes collide with a resident key's, a backend error)
    keeps its pack's whole allocation: at most 64 MiB, or its own size plus a granule where it
    alone is bigger (`plan_packs`' ``max_pack_bytes``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

from ..content.views import typed_view
from ..errors import SegmentError
from ..log import init_logger
from ..segments.packing import plan_packs
from .in_place import placeable_slots
from .slots import Slot, swap, swap_out

__all__ = ["PACKED_ON_HOST_ENV", "PackedInPlace"]

logger = init_logger(__name__)

# A test hook, not for use: with it set to a granularity in bytes (a power of two), a usual load
# on the host is laid out in packs of that granularity (host segments from `Segment.allocate`)
# instead of a memfd per storage, so that this module runs with real vLLM engines on the CPU
# (`benchmarks/zoo.py` under it compares every tensor with a plain load's).
PACKED_ON_HOST_ENV = "VLLM_DEDUP_TEST_PACKED_IN_PLACE"

_RETURN_EVERY = 64 << 20  # bytes placed between two returns of the allocator's cache (Note [one copy at a time])


@dataclass
class _Member:
    """A storage moved into a pack: its offset and size (bytes), and a weak reference to it,
    dead once nothing uses it (post-processing replaced it, or it was mapped from another
    engine: Note [what a pack may hold when it is published])."""

    offset: int
    nbytes: int
    storage: weakref.ref


@dataclass
class _Pack:
    """One segment of this load and its members, by their storages' data pointers."""

    seg: object  # a `segments.base.Segment` from ``allocate``, not frozen yet; None once let go of
    members: dict[int, _Member] = field(default_factory=dict)
    payload_bytes: int = 0  # the members' bytes
    # Bytes planned for storages that are not members: one put back where it was (its copy
    # here is used by nothing), those after a move that failed.  Dead bytes as a dead member's
    # are (Note [what a pack may hold when it is published]).
    unused_bytes: int = 0


class PackedInPlace:
    """The writable packed segments of one usual load: made by `place` before ``load_weights``,
    published where they lie by the sharing pass (`packs`, `seal`), the rest let go of by
    `release`.  Same interface as `in_place.InPlace`, the host backend's.

    Args:
        seg_cls: the segment backend (`segments.cuda.CudaSegment`; any with ``allocate``).
        device_key: the device's key (`Segment.device_key`).
        device_type: the torch device type of the tensors to place (``"cuda"``).
        granularity: the backend's allocation granularity on the device (bytes).
        min_bytes: storages smaller than this stay where vLLM put them (``min_tensor_bytes``).
        skip: ``skip(module, name)`` is true for a tensor post-processing will replace.

    Attributes:
        placed_bytes: bytes of the storages moved into packs by `place`.
        sealed_bytes: bytes of the segments published where they lie (padding included).
        failures: why storages stayed where they were (first few).
    """

    def __init__(self, seg_cls, device_key: str, device_type: str, granularity: int, min_bytes: int, skip=None):
        self.seg_cls, self.device_key, self.device_type = seg_cls, device_key, device_type
        self.granularity, self.min_bytes = granularity, min_bytes
        self.skip = skip or (lambda module, name: False)
        self._packs: list[_Pack] = []  # placed, not sealed, not let go of
        self._let_go: list[tuple[int, tuple[_Member, ...]]] = []  # (segment size, its members): `_let_go_of`
        # A pack moves from `_packs` to `_let_go` while the meter's thread counts both.  Reentrant:
        # dropping a segment's last reference runs its finalizer in this thread, inside the lock.
        self._counting = threading.RLock()
        self.placed_bytes = self.sealed_bytes = 0
        self.failures: list[str] = []

    @property
    def held_bytes(self) -> int:
        """Bytes of this load's packed segments that exist now (the load meter's ``live``): the
        sealed ones, those not let go of, and those let go of that a member still keeps."""
        with self._counting:  # the meter's thread asks while the load's thread lets packs go: each counted once
            kept = sum(size for size, members in self._let_go if any(m.storage() is not None for m in members))
            return self.sealed_bytes + sum(seg.size for p in self._packs if (seg := p.seg) is not None) + kept

    def place(self, model, modules: list | None = None) -> None:
        """Move each of ``model``'s storages the sharing pass would take into a packed segment
        (module docstring, step 1); with ``modules``, only storages whose every place is in one
        of them (a replay's modules loaded from the checkpoint).  Never raises."""
        slots = placeable_slots(model, self.device_type, self.min_bytes, self.skip, modules, self.failures)
        if not slots:
            return
        plan = plan_packs([s.nbytes for s in slots], self.granularity, in_order=True)  # Note [one copy at a time]
        unreturned = 0
        for pack in plan.packs:
            try:
                placed = _Pack(self.seg_cls.allocate(pack.nbytes, self.device_key))
            except SegmentError as e:  # out of device memory: the rest stays
                self._stop(e)
                break
            moved = 0
            try:
                for i, offset in pack.members:
                    self._move(slots[i], placed, offset)
                    moved += 1
            except (SegmentError, RuntimeError, ValueError, MemoryError) as e:
                placed.unused_bytes += sum(slots[i].nbytes for i, _ in pack.members[moved:])
                self._stop(e)
                break
            finally:
                self._keep(placed)
            unreturned += pack.nbytes
            if unreturned >= _RETURN_EVERY:
                self.seg_cls.return_cached(collect=False)
                unreturned = 0
        self.seg_cls.return_cached(collect=False)

    def _stop(self, e: Exception) -> None:
        self.failures.append(f"{type(e).__name__}: {e}")
        logger.info("in place: the rest of the tensors load into private memory (%s)", e)

    def _keep(self, placed: _Pack) -> None:
        """Keep a pack that has members; one that has none (every storage stayed) is let go of."""
        if placed.members:
            self._packs.append(placed)
            self.placed_bytes += placed.payload_bytes
        else:
            placed.seg.close_fd()

    def _move(self, slot: Slot, placed: _Pack, offset: int) -> None:
        old, nbytes = slot.tensor, slot.nbytes
        dtype, shape, stride = old.dtype, tuple(old.shape), tuple(old.stride())
        new = typed_view(placed.seg.member(offset, nbytes), 0, dtype, shape, stride)
        new.copy_(old)
        del old
        held = swap_out(slot, new)
        if held is not None:  # Note [a storage held elsewhere] (in_place.py): back where it was
            import torch

            swap(slot, torch.empty(0, dtype=dtype, device=new.device).set_(held, 0, shape, stride))
            self.failures.append("a tensor outside the model's parameters and buffers holds its storage")
            placed.unused_bytes += nbytes
            return
        placed.members[new.data_ptr()] = _Member(offset, nbytes, weakref.ref(new.untyped_storage()))
        placed.payload_bytes += nbytes

    def holds_no_data(self, address: int, nbytes: int = 0) -> bool:
        """Always False: a pack's granules are not known to read zeros (`in_place.InPlace`'s
        answer for a memfd of one storage), so a write witness reads them."""
        return False

    def packs(self, pending: dict) -> tuple[list[tuple[list, list[int], int]], list[list]]:
        """How the sharing pass publishes this load's misses (module docstring, step 3).

        Args:
            pending: content key -> its group of slots, for the keys no engine holds (misses).

        Returns:
            ``(in_place, regroup)``.  ``in_place``: ``(keys, offsets, nbytes)`` of each pack to
            publish where it lies, whose members are the first slots of keys of ``pending``,
            bound where they were placed, or dead, at most a granule of them (Note [what a pack
            may hold when it is published]).  ``regroup``: the misses of each other pack, to be
            copied pack by pack, so that each such pack goes once its misses are copied rather
            than all of them at the end (Note [one copy at a time]).  Why a pack is copied is in
            `failures`.
        """
        first = {group[0].tensor.data_ptr(): key for key, group in pending.items()}
        out, regroup = [], []
        for pack in self._packs:
            keys, offsets, dead, alive = [], [], pack.unused_bytes, 0
            for ptr, member in pack.members.items():
                if ptr in first:
                    keys.append(first[ptr])
                    offsets.append(member.offset)
                elif member.storage() is None:
                    dead += member.nbytes
                else:
                    alive += member.nbytes
            mb = pack.seg.size / 1e6
            if keys and alive:
                regroup.append(keys)
                self.failures.append(f"a {mb:.1f} MB pack is copied: {alive / 1e6:.1f} MB in it stay private "
                                     "or duplicate another tensor")
            elif keys and dead > self.granularity:
                regroup.append(keys)
                self.failures.append(f"a {mb:.1f} MB pack is copied: {dead / 1e6:.1f} MB in it were replaced by "
                                     "post-processing, mapped from another engine, or never filled")
            elif keys:
                out.append((keys, offsets, pack.seg.nbytes))
                continue
            # Copied, or nothing in it to publish: let go of now, so that it goes with its last
            # member (once its misses are copied), not at the end of the pass (Note [one copy at
            # a time]).
            self._let_go_of(pack)
        self._packs = [pack for pack in self._packs if pack.seg is not None]
        return out, regroup

    def _let_go_of(self, pack: _Pack) -> None:
        """Close ``pack``'s descriptor and drop this object's reference to its segment: its
        memory goes with the last member that maps it (Note [a pack lives while a member
        does])."""
        pack.seg.close_fd()
        with self._counting:
            self._let_go.append((pack.seg.size, tuple(pack.members.values())))
            pack.seg = None

    def seal(self, slots: list[Slot], offsets: list[int]):
        """Freeze the pack ``slots`` fill at ``offsets`` (one of `packs`) and hand it over.

        Returns:
            The frozen segment (the caller publishes it and owns its descriptor), or None where
            the slots are not exactly one pack of this load or it cannot be frozen (the caller
            copies them then; they read the same bytes either way).
        """
        layout = {s.tensor.data_ptr(): off for s, off in zip(slots, offsets)}
        pack = next((p for p in self._packs if next(iter(layout)) in p.members), None)
        if pack is None or any(ptr not in pack.members or pack.members[ptr].offset != off
                               for ptr, off in layout.items()):
            return None
        others = [m for ptr, m in pack.members.items() if ptr not in layout]
        if any(m.storage() is not None for m in others):
            return None  # a member not published is still in use: it would become read-only
        if sum(m.nbytes for m in others) + pack.unused_bytes > self.granularity:
            return None  # what `packs` copies: a copy laid out as the pack is must not seal it
        try:
            pack.seg.freeze()
        except SegmentError as e:
            # Its members are copied instead: let go of now, so that it goes with the last of
            # them (counted while a member maps it), not at `release` (Note [one copy at a time]).
            self.failures.append(str(e))
            self._let_go_of(pack)  # its ``seg`` is None now
        with self._counting:
            self._packs.remove(pack)
            seg = pack.seg
            self.sealed_bytes += seg.size if seg is not None else 0
        return seg

    def discard(self) -> None:
        """Forget what was placed, for a model given up (a replay that declined): the segments
        go with the model's tensors and count no more."""
        self.placed_bytes -= sum(p.payload_bytes for p in self._packs)
        self.release()
        self._let_go.clear()

    def release(self) -> None:
        """Let go of the packs not published: each allocation goes with its last member
        (Note [a pack lives while a member does]); the descriptors are closed now."""
        for pack in self._packs:
            self._let_go_of(pack)
        self._packs.clear()

    def summary(self) -> str:
        mb = 1e6
        return (f"{self.placed_bytes / mb:.1f} MB loaded into packed segments of its own, "
                f"{self.sealed_bytes / mb:.1f} MB of segments published where they lie")
