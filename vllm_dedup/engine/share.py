"""Swapping a loaded model's tensors for shared, segment-backed ones.

This runs once per engine, after vLLM's ``process_weights_after_loading``, so the tensors shared
are exactly those the kernels use.  The steps, in order (one method each of `_Sharing`):

1. **collect** the model's storages of at least ``min_tensor_bytes`` (`slots.collect_slots`);
2. **key** them (`content`): XXH3-128 in parallel threads on the host, a device-side
   fingerprint on a GPU (no weight is copied to the host);
3. **acquire** the keys from the registry (one round trip per 250 keys), then for every hit
   map the segment read-only, **compare** the bytes exactly, and **adopt** the shared tensor
   (swap it in, drop the private copy); a failed compare (a hash collision) keeps the tensor
   private: different bytes are never swapped in;
4. **plan** the misses: where segments come in a coarse granularity (CUDA: 2 MiB) several small
   tensors are packed into one segment (`segments.packing`), and tensors whose pack would be
   mostly padding stay private;
5. **publish**: copy each pack into a new segment, publish it, adopt the segment-backed tensors.

Steps 3 to 5 hold the registry's publish lock of the device and share group, so engines that
finish loading together map each other's tensors instead of each publishing a copy.

Failures never stop the engine (unless ``fail``): the registry failing mid-way leaves the
remaining tensors private; a segment that cannot be created or mapped (`errors.SegmentError`:
out of memory, a descriptor that is not a sealed segment, a driver refusing) leaves the tensors
it would have held private.  Either is said in one warning, with the first error.

Freed private copies go back to the operating system (``malloc_trim``): glibc otherwise keeps
large freed blocks in its heap and the process's memory would not shrink.  On a GPU they go back
to the driver (``torch.cuda.empty_cache``) every gigabyte or so while publishing: torch's
caching allocator would otherwise hold every private copy until the end, and the load would
briefly need twice the model's memory.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

from ..content.fingerprint import device_fingerprints, fingerprint_key, same_bytes
from ..content.keys import ContentKey, content_keys, tensor_key
from ..errors import RegistryUnavailable, SegmentError
from ..registry.client import BrokerClient
from ..registry.lease import Lease
from ..segments import segment_class
from ..segments.packing import plan_packs
from .slots import Slot, collect_slots, swap

__all__ = ["FORCE_COLLISIONS_ENV", "ShareResult", "share_model"]

logger = logging.getLogger("vllm.dedup.share")  # under "vllm": vLLM's handlers and format apply

# Test hook: when set, every content key's digest is zeroed, so every tensor of a given dtype
# and shape collides with every other.  The exact compare must then keep them all apart.
FORCE_COLLISIONS_ENV = "VLLM_DEDUP_TEST_FORCE_COLLISIONS"

_RETURN_EVERY = 1 << 30  # bytes of dropped private copies between two empty_cache calls


@dataclass
class ShareResult:
    """What one engine's load did, in tensors and bytes (what it reports to the registry).

    The loader fills the load's own figures: ``path`` (``full``: every module mapped from a
    recipe; ``modules``: some mapped, the others loaded; ``none``: loaded, then shared),
    ``checkpoint_bytes_read``, ``load_seconds`` (wall time of ``load_model``) and
    ``peak_bytes`` (`meter.LoadMeter.peak_bytes`).  ``placement`` (``id`` of a tensor bound in
    the model -> its content key) is for the recipe, not reported.
    """

    shared_tensors: int = 0  # mapped from another engine's segment
    shared_bytes: int = 0
    published_tensors: int = 0  # moved into a new segment of this engine's
    published_bytes: int = 0
    private_tensors: int = 0
    private_bytes: int = 0
    collisions: int = 0  # equal keys, different bytes: caught by the exact compare
    padding_bytes: int = 0  # bytes of the segments this engine created that hold no tensor
    seconds: float = 0.0  # of the sharing pass
    path: str = "none"
    checkpoint_bytes_read: int = 0
    load_seconds: float = 0.0
    peak_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    placement: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def segment_bytes(self) -> int:
        """Bytes of this engine's tensors that live in segments (read-only, seen by others)."""
        return self.shared_bytes + self.published_bytes

    def report(self) -> dict:
        """The figures the registry keeps (numbers and the load path)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, (int, float, str))}

    def summary(self) -> str:
        mb = 1e6
        return (
            f"path={self.path}, {self.checkpoint_bytes_read / mb:.1f} MB of checkpoint read, "
            f"load {self.load_seconds:.2f} s, peak +{self.peak_bytes / mb:.1f} MB; "
            f"{self.shared_tensors} tensors / {self.shared_bytes / mb:.1f} MB shared, "
            f"{self.published_tensors} / {self.published_bytes / mb:.1f} MB published, "
            f"{self.private_tensors} / {self.private_bytes / mb:.1f} MB private, "
            f"{self.collisions} collisions, {self.padding_bytes / mb:.1f} MB padding, sharing {self.seconds:.2f} s"
        )


def share_model(model, client: BrokerClient | Lease, device_type: str = "cpu", min_tensor_bytes: int = 1 << 16,
                verify: bool = True, fail: bool = False, lock_timeout_s: float = 600.0,
                device_key: str = "cpu", pack_granularity: int | None = None,
                mapped: dict[int, str] | None = None, report: bool = True) -> ShareResult:
    """Share ``model``'s tensors through the registry behind ``client`` (see the module docstring).

    Args:
        model: the loaded ``nn.Module`` (after ``process_weights_after_loading``).
        client: a connection that has said hello; it must stay open while the model lives.
        device_type: torch device type of the tensors to share (``"cpu"``, ``"cuda"``).
        min_tensor_bytes: smaller tensors stay private.
        verify: compare bytes before swapping a shared tensor in.
        fail: on a registry error, raise instead of leaving the rest private.
        lock_timeout_s: how long to wait for the publish lock of the device and share group
            (another engine is sharing); after that the tensors stay private.
        device_key: the registry's name of the device (`Segment.device_key`), as said in the
            client's ``hello``.
        pack_granularity: pack new segments to this granularity (bytes, a power of two);
            default: the backend's (`Segment.granularity`; none on the host).
        mapped: tensors already bound from segments (``id`` -> content key; a recipe mapped
            them): counted as shared, left alone.
        report: send the result to the registry (the loader reports itself, with its figures).

    Raises:
        RegistryUnavailable: the registry failed mid-way and ``fail`` is set.
        SegmentError: a segment could not be created or mapped and ``fail`` is set.
    """
    start = time.perf_counter()
    result = _Sharing(model, client, device_type, min_tensor_bytes, verify, device_key,
                      pack_granularity, fail, mapped or {}).run(lock_timeout_s)
    # The private copies replaced are freed by reference counting as they go (nothing here
    # makes a cycle with them): only the allocator's caches need giving back.
    _malloc_trim()
    _return_cached(device_type)
    result.seconds = time.perf_counter() - start
    if report:
        try:
            client.report(result.report())
        except RegistryUnavailable:
            pass
    return result


class _Sharing:
    """One model's sharing pass: the steps of the module docstring, one method each."""

    def __init__(self, model, client: BrokerClient | Lease, device_type: str, min_tensor_bytes: int, verify: bool,
                 device_key: str, pack_granularity: int | None, fail: bool, mapped: dict[int, str]):
        self.client, self.device_type, self.verify, self.device_key = client, device_type, verify, device_key
        self.fail = fail
        self.segment_failures: list[tuple[int, int, str]] = []  # (tensors, bytes, error) left private
        self.seg_cls = segment_class(device_type)
        # 1. collect (what a recipe mapped is already shared)
        slots, private_n, private_b = collect_slots(model, device_type, min_tensor_bytes, exclude=set(mapped))
        self.result = ShareResult(private_tensors=private_n, private_bytes=private_b, placement=dict(mapped))
        bound = {id(t): t for m in model.modules() for t in [*m._parameters.values(), *m._buffers.values()]
                 if t is not None and id(t) in mapped}
        self.result.shared_tensors += len(bound)
        self.result.shared_bytes += sum(t.numel() * t.element_size() for t in bound.values())
        # 2. key: content key -> the slots with that key (tied or equal tensors of this model)
        self.pending: dict[str, list[Slot]] = defaultdict(list)
        for slot, key in zip(slots, _keys([s.tensor for s in slots], device_type)):
            self.pending[key].append(slot)
        self.granularity, self.no_segments = pack_granularity, None
        if slots and not pack_granularity:
            try:
                self.granularity = self.seg_cls.granularity(slots[0].tensor.device)
            except SegmentError as e:  # the backend cannot make segments on this device at all
                self.no_segments = e
        self.freed = 0  # private bytes dropped since the allocator's cache was last emptied

    def run(self, lock_timeout_s: float) -> ShareResult:
        if self.no_segments is not None:
            self.segment_failed(list(self.pending.values()), self.no_segments)
            self.pending.clear()
            return self._finish()
        try:
            with self.client.locked(f"publish:{self.device_key}:{self.client.group}", timeout_s=lock_timeout_s):
                self.acquire_and_adopt()
                self.plan_and_publish()
        except (RegistryUnavailable, TimeoutError) as e:
            if self.fail:
                raise RegistryUnavailable(str(e)) from None
            self.result.errors.append(str(e))
            logger.warning("vllm-dedup: registry failed mid-load (%s); the remaining tensors stay private", e)
            for group in self.pending.values():
                self.keep_private(group)
            self.pending.clear()
        return self._finish()

    def _finish(self) -> ShareResult:
        if self.segment_failures:
            tensors = sum(n for n, _, _ in self.segment_failures)
            nbytes = sum(b for _, b, _ in self.segment_failures)
            first = self.segment_failures[0][2]
            self.result.errors.append(first)
            logger.warning("vllm-dedup: %d tensor(s) (%.1f MB) stay private: %d segment(s) could not be created or "
                           "mapped (first: %s)", tensors, nbytes / 1e6, len(self.segment_failures), first)
        return self.result

    def segment_failed(self, groups: list[list[Slot]], error: SegmentError) -> None:
        """A segment for ``groups`` could not be created or mapped: they stay private."""
        if self.fail:
            raise error
        for group in groups:
            self.keep_private(group)
        self.segment_failures.append((sum(len(g) for g in groups), sum(s.nbytes for g in groups for s in g),
                                      str(error)))

    # 3. acquire, compare, adopt -------------------------------------------------------------
    def acquire_and_adopt(self) -> None:
        """Map every resident key; hits in one segment (a pack) share one mapping.  A segment
        none of whose tensors was taken (refused, or every compare failed) is released, the
        others are held."""
        hits: dict[int, list] = defaultdict(list)
        fds: dict[int, list[int]] = defaultdict(list)
        for hit, fd in self.client.acquire(list(self.pending)):
            hits[hit.segment].append(hit)
            fds[hit.segment].append(fd)
        for seg_id, seg_hits in hits.items():
            for fd in fds[seg_id][1:]:
                os.close(fd)
            groups = [self.pending.pop(hit.key) for hit in seg_hits]
            try:
                seg = self.seg_cls.attach(fds[seg_id][0], max(h.offset + h.nbytes for h in seg_hits), self.device_key)
            except SegmentError as e:  # not a sealed segment, or it cannot be mapped: never use it
                self.client.release([seg_id])
                self.segment_failed(groups, SegmentError(f"resident segment {seg_id} refused: {e}"))
                continue
            before = self.result.shared_tensors
            for hit, group in zip(seg_hits, groups):
                differ = self.adopt(group, seg, hit.offset, hit.key, published=False)
                if differ:
                    self.result.collisions += len(differ)
                    logger.warning("vllm-dedup: %d tensor(s) with key %s differ from the resident copy "
                                   "(hash collision); they stay private", len(differ), hit.key)
                    self.keep_private(differ)
            seg.close_fd()
            if self.result.shared_tensors == before:  # nothing taken from it
                self.client.release([seg_id])

    def adopt(self, group: list[Slot], seg, offset: int, key: str, published: bool) -> list[Slot]:
        """Swap each slot whose bytes equal the segment's at ``offset`` (content ``key``);
        return the ones that differ.  With ``published``, the segment was copied from the
        group's first slot.  A failure of the backend while wrapping or comparing (a driver
        error, torch running out of memory, a segment smaller than its entry says) leaves the
        group's remaining slots private (`segment_failed`: one warning; raised with ``fail``)."""
        differ = []
        for i, slot in enumerate(group):
            t = slot.tensor
            source = published and i == 0
            try:
                shared = seg.tensor(offset, t.dtype, tuple(t.shape), tuple(t.stride()))
                if self.verify and not source and not same_bytes(shared, t):
                    differ.append(slot)
                    continue
            except Exception as e:  # any backend failure: never stop the engine for it
                self.segment_failed([group[i:]], SegmentError(
                    f"cannot use segment bytes for key {key} ({type(e).__name__}: {e})"))
                break
            swap(slot, shared)  # the slot held the last reference to the private copy
            for module, name, is_param in slot.refs:
                bound = module._parameters[name] if is_param else module._buffers[name]
                self.result.placement[id(bound)] = key
            self.freed += slot.nbytes
            if source:
                self.result.published_tensors += 1
                self.result.published_bytes += slot.nbytes
            else:
                self.result.shared_tensors += 1
                self.result.shared_bytes += slot.nbytes
        if self.freed >= _RETURN_EVERY:
            _return_cached(self.device_type)
            self.freed = 0
        return differ

    def keep_private(self, group: list[Slot]) -> None:
        self.result.private_tensors += len(group)
        self.result.private_bytes += sum(s.nbytes for s in group)

    # 4. plan, 5. publish -------------------------------------------------------------------
    def plan_and_publish(self) -> None:
        misses = list(self.pending)
        if self.granularity is None:
            for key in misses:
                self.publish([key], [0], self.pending[key][0].nbytes)
            return
        plan = plan_packs([self.pending[k][0].nbytes for k in misses], self.granularity,
                          max_pack_bytes=self.granularity)
        for i in plan.private:
            self.keep_private(self.pending.pop(misses[i]))
        for pack in plan.packs:
            self.publish([misses[i] for i, _ in pack.members], [off for _, off in pack.members], pack.nbytes)

    def publish(self, keys: list[str], offsets: list[int], nbytes: int) -> None:
        """One new segment holding the first tensor of each key's group at its offset."""
        parts = [(self.pending[k][0].tensor, off) for k, off in zip(keys, offsets)]
        try:
            seg = self.seg_cls.create_packed(parts, nbytes, self.device_key)
        except SegmentError as e:
            self.segment_failed([self.pending.pop(k) for k in keys], e)
            return
        try:
            seg_id = self.client.publish(seg.fileno(), seg.size,
                                         [(k, off, self.pending[k][0].nbytes) for k, off in zip(keys, offsets)])
        finally:
            seg.close_fd()
        self.result.padding_bytes += seg.size - sum(self.pending[k][0].nbytes for k in keys)
        before = self.result.published_tensors
        for key, offset in zip(keys, offsets):
            group = self.pending.pop(key)
            differ = self.adopt(group, seg, offset, key, published=True)  # same key in this model, other bytes
            self.result.collisions += len(differ)
            self.keep_private(differ)
        if self.result.published_tensors == before:  # the backend failed for every member
            self.client.release([seg_id])


def _keys(tensors, device_type: str) -> list[str]:
    """Content keys: XXH3-128 of host bytes on the CPU, device fingerprints elsewhere."""
    if device_type == "cpu":
        keys = content_keys([lambda t=t: tensor_key(t) for t in tensors])
    else:
        keys = [fingerprint_key(t, d) for t, d in zip(tensors, device_fingerprints(tensors))]
    if os.environ.get(FORCE_COLLISIONS_ENV):
        keys = [ContentKey(bytes(16), k.dtype, k.shape, k.stride) for k in keys]
    return [str(k) for k in keys]


def _return_cached(device_type: str) -> None:
    """Give the caching allocator's free blocks back to the driver (GPU only)."""
    if device_type == "cuda":
        import torch

        gc.collect()
        torch.cuda.empty_cache()


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
