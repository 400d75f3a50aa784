"""Swapping a loaded model's tensors for shared, segment-backed ones.

This runs once per engine, after vLLM's ``process_weights_after_loading``, so the tensors shared
are exactly those the kernels use.  The steps, in order (one method each of `SharingPass`):

1. **collect** the model's storages of at least ``min_tensor_bytes`` (`slots.collect_slots`),
   leaving out what a recipe mapped already, and on the CPU backend with ``cpu_linear="packed"``
   the packed weights of vLLM's oneDNN handlers (`packed.collect_packed`), which take the same
   steps and are adopted by `onednn.install` instead of a swap;
2. **key** them (`content`): XXH3-128 in parallel threads on the host, a device-side
   fingerprint on a GPU (no weight is copied to the host);
3. **acquire** the keys and map the segments found (`resident.map_resident`), **compare** the
   bytes exactly, and **adopt** the shared tensor (swap it in, drop the private copy); a failed
   compare (a hash collision, crafted or not) keeps the tensor private: different bytes are
   never swapped in;
4. **plan** the misses: where segments come in a coarse granularity (CUDA: 2 MiB) tensors are
   packed into segments of up to 64 MiB (`segments.packing`), and tensors whose pack would be
   mostly padding stay private;
5. **publish**: copy each pack into a new segment, publish it, adopt the segment-backed tensors.
   A packed weight staged while loading (`staging.py`), or a tensor loaded in place
   (`in_place.py`), is in a segment of this engine's already: that segment is sealed and
   published as it is, with no copy.

Steps 3 to 5 hold the registry's publish lock of the device and share group, so engines that
finish loading together map each other's tensors instead of each publishing a copy.

Note [one publish in flight]
    Publishing a segment is a round trip to the registry (about 1 ms: it checks the memfd's
    seals), and sealing one where it lies costs a few milliseconds of page-table work.  One
    thread sends each segment's publish while this one seals the next, so the round trips
    overlap the sealing.  The segment is adopted once its publish has returned.  A segment
    that must be copied is made only after the one in flight is adopted, so the private
    copies it replaces are freed first: a load holds no more memory at once than before.

Failures never stop the engine (unless ``on_registry_error="fail"``): the registry failing
mid-way leaves the remaining tensors private; a segment that cannot be created, mapped or read
(`errors.SegmentError`, a CUDA driver error, torch running out of memory while wrapping or
comparing) leaves the tensors it would have held private.  Either is said in one warning, with
the first error.

Freed private copies go back to the operating system (``malloc_trim``) every 32 MiB or so
while publishing: glibc keeps freed blocks below its mmap threshold (up to 32 MiB: most linear
weights) in its heap, and a load whose weights are copied into segments (nothing packed: AVX2,
``cpu_linear="plain"``) would briefly need its private copies and its segments at once.  On a
GPU they go back to the driver (``torch.cuda.empty_cache``) every gigabyte or so: torch's
caching allocator would otherwise hold every private copy until the end.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from ..content.fingerprint import same_bytes
from ..content.keys import ContentKey
from ..errors import PackedWeightError, RegistryUnavailable, SegmentError, SharedWeightsError
from ..log import init_logger
from ..segments import segment_class
from ..segments.packing import plan_packs
from .context import LoadContext, LoadReport, Placement
from .heap import trim
from .onednn import ModelHandlers
from .packed import PackedSlot, collect_packed, packed_keys
from .resident import map_resident
from .slots import Slot, collect_slots, has_storage, swap

__all__ = ["FORCE_COLLISIONS_ENV", "SharingPass", "colliding", "share_model"]

logger = init_logger(__name__)

# Test hook: when set, every content key's digest is zeroed, so every tensor of a given dtype
# and shape collides with every other.  The exact compare must then keep them all apart.
FORCE_COLLISIONS_ENV = "VLLM_DEDUP_TEST_FORCE_COLLISIONS"

PUBLISH_LOCK_TIMEOUT_S = 600.0  # another engine of the device and share group is sharing
_RETURN_EVERY = 1 << 30  # bytes of dropped private copies between two empty_cache calls
_TRIM_EVERY = 32 << 20  # ... between two malloc_trim calls (about 2 ms each)


def share_model(model, ctx: LoadContext, report: LoadReport | None = None,
                mapped: dict[int, Placement] | None = None, pack_granularity: int | None = None,
                staging=None, in_place=None) -> LoadReport:
    """Share ``model``'s tensors through the registry behind ``ctx.lease`` (module docstring).

    Args:
        model: the loaded ``nn.Module`` (after ``process_weights_after_loading``).
        ctx: the load (its lease must stay open while the model lives; ``config`` gives
            ``min_tensor_bytes``, ``verify`` and ``on_registry_error``).
        report: the load's report, filled in here (a new one by default).
        mapped: tensors a recipe bound from segments already (``id`` -> `Placement`): counted
            as shared, left alone.
        pack_granularity: pack new segments to this granularity (bytes, a power of two);
            default: the backend's (`Segment.granularity`; none on the host).
        staging: the packed weights this load already moved into segments of its own
            (`staging.Staging`, host backend): keyed already, published without a copy when no
            other engine holds their bytes; let go of at the end.
        in_place: the tensors this load loaded into writable segments of its own
            (`in_place.InPlace`, host backend): sealed and published where they lie when no
            other engine holds their bytes; the rest let go of at the end.

    Raises:
        RegistryUnavailable: the registry failed mid-way and ``on_registry_error`` is ``fail``.
        SegmentError: a segment could not be created or mapped and ``on_registry_error`` is ``fail``.
        Exception: any other error of the pass, as it is, only where ``on_registry_error`` is
            ``fail`` (else the tensors not shared yet stay private and it is logged).
    """
    start = time.perf_counter()
    report = report if report is not None else LoadReport()
    try:
        try:
            sharing = SharingPass(model, ctx, report, mapped or {}, pack_granularity, staging, in_place)
        except Exception as e:  # the model's walk failed: nothing shared yet
            if ctx.failures_stop_the_engine:
                raise
            if staging is not None:  # staged weights stay read-only in their segments: say so
                n, nbytes = staging.read_only()
                report.private_tensors += n
                report.private_bytes += nbytes
                report.unpublished_bytes += nbytes
            report.errors.append(f"{type(e).__name__}: {e}")
            logger.warning("the model's tensors could not be collected for sharing (%s: %s); they stay private",
                           type(e).__name__, e)
        else:
            sharing.run()
    finally:
        if staging is not None:
            staging.release()
        if in_place is not None:
            in_place.release()
    # The private copies replaced are freed by reference counting as they go (nothing here
    # makes a cycle with them): only the allocator's caches need giving back.
    trim()
    segment_class(ctx.device_type).return_cached()
    report.share_seconds = time.perf_counter() - start
    return report


class SharingPass:
    """One model's sharing pass: the steps of the module docstring, one method each."""

    def __init__(self, model, ctx: LoadContext, report: LoadReport, mapped: dict[int, Placement],
                 pack_granularity: int | None, staging=None, in_place=None):
        self.ctx, self.lease, self.report = ctx, ctx.lease, report
        self.in_place = in_place
        self.verify = ctx.config.verify
        self.segment_failures: list[tuple[int, int, str]] = []  # (tensors, bytes, error) left private
        self.seg_cls = segment_class(ctx.device_type)
        # 1. collect (what a recipe mapped is already shared)
        self.on_host = ctx.device_type == "cpu"
        handlers = ModelHandlers(model) if self.on_host or ctx.share_packed else None  # Note [one walk per pass]
        pinned = _pinned(model, handlers, ctx) if self.on_host else []  # read by oneDNN through raw pointers
        slots, private_n, private_b = collect_slots(model, ctx.device_type, ctx.config.min_tensor_bytes,
                                                    exclude=set(mapped) | {id(t) for t in pinned})
        report.private_tensors += len(pinned)
        report.private_bytes += sum(t.numel() * t.element_size() for t in pinned)
        report.private_tensors += private_n
        report.private_bytes += private_b
        report.placement.update(mapped)
        bound = {id(t): t for m in model.modules() for t in [*m._parameters.values(), *m._buffers.values()]
                 if t is not None and id(t) in mapped}
        report.shared_tensors += len(bound)
        report.shared_bytes += sum(t.numel() * t.element_size() for t in bound.values())
        unkeyed = None  # why no content key could be computed (then every tensor stays private)
        try:
            keys = self._keys(slots, handlers, mapped, staging)
        except Exception as e:  # e.g. the device out of memory for a fingerprint's temporaries
            unkeyed = SegmentError(f"content keys could not be computed ({type(e).__name__}: {e})")
            keys = [f"unkeyed:{i}" for i in range(len(slots))]
        # 2. key: content key -> the slots with that key (tied or equal tensors of this model)
        self.pending: dict[str, list[Slot | PackedSlot]] = defaultdict(list)
        for slot, key in zip(slots, keys):
            self.pending[key].append(slot)
        self.granularity, self.no_segments = pack_granularity, unkeyed
        if slots and not pack_granularity and unkeyed is None:
            try:
                self.granularity = self.seg_cls.granularity(slots[0].tensor.device)
            except SegmentError as e:  # the backend cannot make segments on this device at all
                self.no_segments = e
        self.freed = 0  # private bytes dropped since the allocator's cache was last emptied
        self.untrimmed = 0  # ... since glibc's heap was last trimmed

    def _keys(self, slots: list, handlers, mapped: dict, staging) -> list[str]:
        """The content key of each of ``slots``; with packed weights shared, the staged and
        the other packed weights are added to ``slots`` (and counted in the report) and keyed."""
        ctx, report = self.ctx, self.report
        plain, staged, census_slots = list(slots), [], []
        if ctx.share_packed:
            if staging is not None:  # a copy in flight would free the buffer the census finds
                staging.finish()
            census = collect_packed(handlers, ctx.config.min_tensor_bytes, mapped)
            if census.declined:
                report.private_linears = f"{len(census.declined)} private packed copies ({census.declined[0][:200]})"
            report.shared_tensors += len(census.installed)  # by a recipe
            report.shared_bytes += sum(p.nbytes for p in census.installed)
            report.packed_tensors += len(census.installed)
            report.private_tensors += census.private_n
            report.private_bytes += census.private_bytes
            staged = staging.slots() if staging is not None else []  # keyed already; each segment's owner first
            census_slots = census.slots
            # In ``slots`` before anything is hashed: keys that cannot be computed leave every
            # slot private and counted, the staged ones read-only (`keep_private`).
            slots += [slot for slot, _ in staged] + census_slots
        keys = [str(k) for k in colliding(self.seg_cls.content_keys([s.tensor for s in plain]))]
        return keys + [key for _, key in staged] + [str(k) for k in colliding(packed_keys(census_slots))]

    def run(self) -> None:
        if self.no_segments is not None:
            self.segment_failed(list(self.pending.values()), self.no_segments)
            self.pending.clear()
            return self._finish()
        try:
            with self.lease.locked(f"publish:{self.ctx.device_key}:{self.lease.group}",
                                   timeout_s=PUBLISH_LOCK_TIMEOUT_S):
                self.acquire_and_adopt()
                self.plan_and_publish()
        except (RegistryUnavailable, TimeoutError) as e:
            if self.ctx.failures_stop_the_engine:
                raise RegistryUnavailable(str(e)) from None
            self._stop_publishing(str(e), "registry failed mid-load")
        except SharedWeightsError:  # a handler left reading bytes nobody owns: this model cannot go on (`load_model`)
            raise
        except Exception as e:  # no thread or descriptor left (EMFILE, a pids limit), a surprise:
            if self.ctx.failures_stop_the_engine:  # never an engine stopped that could load privately
                raise  # as it is: a SegmentError says what to do, anything else what went wrong
            self._stop_publishing(f"{type(e).__name__}: {e}", "sharing failed mid-load")
        self._finish()

    def _stop_publishing(self, error: str, what: str) -> None:
        """Keep every tensor not adopted yet private, and say why once."""
        self.report.errors.append(error)
        logger.warning("%s (%s); the remaining tensors stay private", what, error)
        for group in self.pending.values():
            self.keep_private(group)
        self.pending.clear()

    def _finish(self) -> None:
        if self.segment_failures:
            tensors = sum(n for n, _, _ in self.segment_failures)
            nbytes = sum(b for _, b, _ in self.segment_failures)
            first = self.segment_failures[0][2]
            self.report.errors.append(first)
            logger.warning("%d tensor(s) (%.1f MB) stay private: %d segment(s) could not be created, "
                           "mapped or read (first: %s)", tensors, nbytes / 1e6, len(self.segment_failures), first)

    def segment_failed(self, groups: list[list[Slot]], error: BaseException) -> None:
        """A segment for ``groups`` could not be created, mapped or read: they stay private."""
        if self.ctx.failures_stop_the_engine:
            raise error if isinstance(error, SegmentError) else SegmentError(str(error))
        for group in groups:
            self.keep_private(group)
        self.segment_failures.append((sum(len(g) for g in groups), sum(s.nbytes for g in groups for s in g),
                                      f"{type(error).__name__}: {error}"))

    # 3. acquire, compare, adopt -------------------------------------------------------------
    def acquire_and_adopt(self) -> None:
        """Map every resident key; hits in one segment (a pack) share one mapping.  A segment
        none of whose tensors was taken (refused, or every compare failed) is released, the
        others are held."""
        for got in map_resident(self.lease, self.seg_cls, self.ctx.device_key, list(self.pending)):
            hits = got.found.hits
            groups = [self.pending.pop(hit.key) for hit in hits]
            if got.error is not None:
                self.segment_failed(groups, got.error)
                continue
            taken = 0
            try:
                for hit, group in zip(hits, groups):
                    took, differ = self.adopt(group, got.segment, hit.offset, Placement(hit.key, got.found.uid),
                                              published=False)
                    taken += took
                    if differ:
                        self.report.collisions += len(differ)
                        logger.warning("%d tensor(s) with key %s differ from the resident copy "
                                       "(hash collision); they stay private", len(differ), hit.key)
                        self.keep_private(differ)
            except BaseException:  # an error of the pass itself: a segment nothing maps is not held for good
                if not taken:
                    with contextlib.suppress(Exception):
                        self.lease.release([got.found.segment])
                raise
            if not taken:
                self.lease.release([got.found.segment])

    def adopt(self, group: list[Slot], seg, offset: int, where: Placement, published: bool
              ) -> tuple[int, list[Slot]]:
        """Swap each slot whose bytes equal the segment's at ``offset``; with ``published``, the
        segment was copied from the group's first slot.  Returns (slots swapped, slots whose
        bytes differ).  When the shared memory cannot be wrapped or read, the slots not swapped
        yet stay private (counted here, not returned)."""
        differ, taken = [], 0
        for i, slot in enumerate(group):
            t = slot.tensor
            source = published and i == 0
            try:
                shared = seg.tensor(offset, t.dtype, tuple(t.shape), tuple(t.stride()))
                equal = source or not self.verify or same_bytes(shared, t)
            except Exception as e:  # any backend failure (driver, torch out of memory): never stop the engine
                self.segment_failed([group[i:]], SegmentError(
                    f"cannot use segment bytes for key {where.key} ({type(e).__name__}: {e})"))
                break
            if not equal:
                differ.append(slot)
                continue
            if isinstance(slot, PackedSlot):
                try:
                    if not (source and slot.staged is not None):  # a staged segment is installed already
                        slot.install(shared)  # oneDNN frees the private copy (or the staged segment goes)
                except PackedWeightError as e:
                    self.segment_failed([group[i:]], SegmentError(f"cannot install key {where.key}: {e}"))
                    break
                self.report.packed_tensors += 1
                self.report.placement[id(slot.packed.handler)] = where
            else:
                swap(slot, shared)  # the slot held the last reference to the private copy
            for module, name, is_param in slot.refs:
                bound = module._parameters[name] if is_param else module._buffers[name]
                self.report.placement[id(bound)] = where
            self.freed += slot.nbytes
            self.untrimmed += slot.nbytes
            taken += 1
            if source:
                self.report.published_tensors += 1
                self.report.published_bytes += slot.nbytes
            else:
                self.report.shared_tensors += 1
                self.report.shared_bytes += slot.nbytes
        if self.on_host and self.untrimmed >= _TRIM_EVERY:  # a GPU's private copies are not in glibc's heap
            trim()
            self.untrimmed = 0
        if self.freed >= _RETURN_EVERY:
            self.seg_cls.return_cached()
            self.freed = 0
        return taken, differ

    def keep_private(self, group: list[Slot]) -> None:
        """Count ``group`` private.  A packed weight staged while loading stays in its sealed
        segment, read-only: counted in ``unpublished_bytes`` too (`adopt_published`)."""
        self.report.private_tensors += len(group)
        self.report.private_bytes += sum(s.nbytes for s in group)
        self.report.unpublished_bytes += sum(s.nbytes for s in group if _staged(s) is not None)

    # 4. plan, 5. publish -------------------------------------------------------------------
    def plan_and_publish(self) -> None:
        """Publish every miss, one segment per pack (Note [one publish in flight])."""
        own, regroup = self.in_place.packs(self.pending) if self.in_place is not None else ([], [])
        laid_out = {key for keys, _, _ in own for key in keys} | {key for group in regroup for key in group}
        packs = own  # published where they lie (`in_place_packed.py`)
        for group in [*regroup, [key for key in self.pending if key not in laid_out]]:
            packs += self.planned(group)
        with ThreadPoolExecutor(1, thread_name_prefix="vllm-dedup-publish") as rpc:
            # Its one thread starts now, before anything is sealed: where none can start (a
            # pids limit), nothing is read-only yet and every tensor stays private as it is.
            rpc.submit(lambda: None).result()
            in_flight = None
            try:
                for keys, offsets, nbytes in packs:
                    seg = self.segment_in_place(keys, offsets)
                    sealed = seg is not None  # its tensors read it already, read-only
                    if seg is None:  # a copy: the private copies of the one in flight go first
                        in_flight, done = None, in_flight
                        self.adopt_published(done)
                        seg = self.copied_segment(keys, offsets, nbytes)
                        if seg is None:
                            continue
                    held = [(k, off, self.pending[k][0].nbytes) for k, off in zip(keys, offsets)]
                    in_flight, done = (rpc.submit(self.register, seg, held), seg, keys, offsets, sealed), in_flight
                    self.adopt_published(done)
                in_flight, done = None, in_flight
                self.adopt_published(done)
            except BaseException:
                if in_flight is not None:  # published or not, its descriptor is closed by `register`
                    try:
                        self.adopt_published(in_flight)
                    except Exception:
                        pass  # the first error is the one raised
                raise

    def planned(self, misses: list[str]) -> list[tuple[list[str], list[int], int]]:
        """``misses`` laid out in packs to copy, ``(keys, offsets, nbytes)`` each: one per key
        where segments have no granularity, else `plan_packs`'s (those it leaves out stay
        private now)."""
        if self.granularity is None:
            return [([key], [0], self.pending[key][0].nbytes) for key in misses]
        plan = plan_packs([self.pending[k][0].nbytes for k in misses], self.granularity)
        for i in plan.private:
            self.keep_private(self.pending.pop(misses[i]))
        return [([misses[i] for i, _ in pack.members], [off for _, off in pack.members], pack.nbytes)
                for pack in plan.packs]

    def segment_in_place(self, keys: list[str], offsets: list[int]):
        """The segment holding a pack already, sealed (none: None): a packed weight staged while
        loading (`staging.py`), or tensors loaded in place (`in_place.py`, `in_place_packed.py`)."""
        first = self.pending[keys[0]][0]
        if len(keys) == 1 and _staged(first) is not None:
            return first.staged  # published as it is, no copy
        slots = [self.pending[key][0] for key in keys]
        if self.in_place is not None and all(isinstance(s, Slot) for s in slots):
            return self.in_place.seal(slots, offsets)  # sealed where it lies, no copy
        return None

    def copied_segment(self, keys: list[str], offsets: list[int], nbytes: int):
        """A new segment with the first tensor of each key's group copied in at its offset, or
        None where it cannot be made (those groups stay private)."""
        parts = [(self.pending[k][0].tensor, off) for k, off in zip(keys, offsets)]
        try:
            seg = self.seg_cls.create_packed(parts, nbytes, self.ctx.device_key)
        except (SegmentError, RuntimeError, MemoryError) as e:  # torch's out-of-memory is a RuntimeError
            self.segment_failed([self.pending.pop(k) for k in keys], e)
            return None
        self.report.created_bytes += seg.size
        return seg

    def register(self, seg, held: list[tuple[str, int, int]]) -> int:
        """Publish ``seg``, holding ``(content key, offset, bytes)`` tensors, to the registry;
        return this lease's id of it.  Its descriptor is closed either way (the lease keeps a
        duplicate).  Runs in the publish thread, so it reads nothing the sharing pass changes."""
        try:
            return self.lease.publish(seg.fileno(), seg.size, held)
        finally:
            seg.close_fd()

    def adopt_published(self, in_flight) -> None:
        """Wait for ``in_flight``'s publish (``(future, segment, keys, offsets, sealed)``; None:
        nothing) and swap its tensors for the segment's.  A segment ``sealed`` where it lies
        that could not be published leaves its tensors private but read-only: counted in the
        report's ``unpublished_bytes``, so that the engine refuses to write its weights as
        where they are shared (`worker_hooks`), instead of faulting.

        Raises:
            RegistryUnavailable: the publish failed (its groups are still pending).
        """
        if in_flight is None:
            return
        future, seg, keys, offsets, sealed = in_flight
        try:
            seg_id = future.result()
        except BaseException:
            if sealed:
                self.report.unpublished_bytes += sum(_sealed_private(self.pending[k][0]) for k in keys)
            raise
        uid = self.lease.uid_of(seg_id)
        self.report.padding_bytes += seg.size - sum(self.pending[k][0].nbytes for k in keys)
        taken = 0
        for key, offset in zip(keys, offsets):
            group = self.pending.pop(key)
            took, differ = self.adopt(group, seg, offset, Placement(key, uid), published=True)
            if sealed and not took:  # the backend failed for its source: private, over the sealed bytes still
                self.report.unpublished_bytes += _sealed_private(group[0])
            taken += took
            self.report.collisions += len(differ)  # same key in this model, other bytes
            self.keep_private(differ)
        if not taken:  # the backend failed for every member
            self.lease.release([seg_id])


def _sealed_private(source) -> int:
    """Bytes to count in ``unpublished_bytes`` for the first slot of a key whose segment was
    sealed where it lies but is not adopted: all of them, but for a staged packed weight's,
    which `keep_private` counts as it keeps it private."""
    return source.nbytes if _staged(source) is None else 0


def _staged(slot):
    """The segment of this engine's that a slot's packed weight was staged into while loading
    (`PackedSlot.staged`), or None (not staged, or a plain tensor's `Slot`)."""
    return getattr(slot, "staged", None)


def _pinned(model, handlers: ModelHandlers, ctx: LoadContext) -> list:
    """The tensors oneDNN handlers read through raw pointers, which must stay where they are:
    those recorded where the handlers were made (`handlers.recorded_handlers`, exact), and those
    of every module the search finds holding such a handler (``handlers``, the model's
    `onednn.ModelHandlers`, for a model made outside a recorded load)."""
    out = {id(t): t for t in handlers.pinned_tensors()}
    storages = ctx.handlers.pinned()
    if storages:
        for module in model.modules():
            for t in [*module._parameters.values(), *module._buffers.values()]:
                if t is not None and has_storage(t) and t.untyped_storage().data_ptr() in storages:
                    out.setdefault(id(t), t)
    return list(out.values())


def colliding(keys: list[ContentKey]) -> list[ContentKey]:
    """The keys, or with `FORCE_COLLISIONS_ENV` set, the keys with their digests zeroed."""
    if os.environ.get(FORCE_COLLISIONS_ENV):
        return [ContentKey(bytes(16), k.dtype, k.shape, k.stride) for k in keys]
    return keys
