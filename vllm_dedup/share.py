"""Swapping a loaded model's tensors for shared, segment-backed ones.

This runs once per engine, after vLLM's ``process_weights_after_loading``, so the tensors shared
are exactly those the kernels use.  For every parameter and buffer storage of at least
``min_tensor_bytes`` bytes:

1. compute its content key (`keys.py`): XXH3-128 in parallel threads on the host, a device-side
   fingerprint on a GPU (no weight is copied to the host);
2. ask the registry for the keys (one round trip per 250 keys);
3. hit: map the segment read-only, compare the bytes exactly, swap the shared tensor in, drop the
   private copy; a failed compare (a hash collision) releases the segment and keeps the tensor
   private: different bytes are never swapped in;
4. miss: copy the tensor into a new segment, publish it, swap to the segment-backed tensor.
   Where segments come in a coarse granularity (CUDA: 2 MiB), the misses are packed first
   (`packing.py`): several small tensors share one segment, and tensors whose pack would be
   mostly padding stay private.  The padding is reported.

Swapping keeps every ``nn.Parameter`` object (its class, its attributes such as
``weight_loader``, and every module that refers to it, so tied weights stay tied): only
``param.data`` is rebound.  Buffers are replaced in their modules' ``_buffers``.  A tensor that
is only a view into a larger storage stays private: swapping it would free nothing.

Freed private copies go back to the operating system (``malloc_trim``): glibc otherwise keeps
large freed blocks in its heap and the process's memory would not shrink.  On a GPU they go back
to the driver (``torch.cuda.empty_cache``) every gigabyte or so while publishing: torch's
caching allocator would otherwise hold every private copy until the end, and the load would
briefly need twice the model's memory.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

from .broker import BrokerClient, RegistryUnavailable
from .keys import ContentKey, content_keys, device_fingerprints, fingerprint_key, same_bytes, tensor_key
from .packing import plan_packs
from .segments import segment_class

__all__ = ["ShareResult", "share_model", "shared_bytes_in_process"]

logger = logging.getLogger("vllm.dedup.share")  # under "vllm", as in loader.py

# Test hook: when set, every content key's digest is zeroed, so every tensor of a given dtype
# and shape collides with every other.  The exact compare must then keep them all apart.
FORCE_COLLISIONS_ENV = "VLLM_DEDUP_TEST_FORCE_COLLISIONS"

_shared_in_process = 0


def shared_bytes_in_process() -> int:
    """Bytes of this process's tensors that live in segments, mapped from another engine or
    published by this one: both are read-only and visible to other engines (for the guards)."""
    return _shared_in_process


@dataclass
class ShareResult:
    """What one engine's load did, in tensors and bytes."""

    shared_tensors: int = 0
    shared_bytes: int = 0
    published_tensors: int = 0
    published_bytes: int = 0
    private_tensors: int = 0
    private_bytes: int = 0
    collisions: int = 0
    padding_bytes: int = 0  # bytes of the segments this engine created that hold no tensor
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        mb = 1e6
        return (
            f"{self.shared_tensors} tensors / {self.shared_bytes / mb:.1f} MB shared, "
            f"{self.published_tensors} / {self.published_bytes / mb:.1f} MB published, "
            f"{self.private_tensors} / {self.private_bytes / mb:.1f} MB private, "
            f"{self.collisions} collisions, {self.padding_bytes / mb:.1f} MB padding, {self.seconds:.2f} s"
        )


@dataclass
class _Slot:
    """One storage of the model and every place (module, attribute) that refers to it."""

    tensor: object
    refs: list[tuple[object, str, bool]]  # (module, name, is_parameter)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def _collect(model, device_type: str, min_bytes: int) -> tuple[list[_Slot], int, int]:
    """Group the model's parameters and buffers by storage.  Returns (candidates, private
    tensors, private bytes) where private ones are too small, views, or on another device."""
    slots: dict[tuple, _Slot] = {}
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if t is None:
                    continue
                ident = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if t.numel() else (id(t),)
                slot = slots.setdefault(ident, _Slot(t, []))
                slot.refs.append((module, name, is_param))
    candidates, private_n, private_b = [], 0, 0
    for slot in slots.values():
        t = slot.tensor
        ok = (
            t.device.type == device_type
            and not t.is_meta
            and t.is_contiguous()
            and slot.nbytes >= max(min_bytes, 1)
            and t.untyped_storage().nbytes() == slot.nbytes  # covers its whole storage
        )
        if ok:
            candidates.append(slot)
        else:
            private_n += 1
            private_b += slot.nbytes
    return candidates, private_n, private_b


def _swap(slot: _Slot, new) -> None:
    done = set()
    for module, name, is_param in slot.refs:
        if is_param:
            param = module._parameters[name]
            if id(param) not in done:
                param.data = new
                done.add(id(param))
        else:
            module._buffers[name] = new


def _keys(tensors, device_type: str) -> list[str]:
    """Content keys: XXH3-128 of host bytes on the CPU, device fingerprints elsewhere."""
    if device_type == "cpu":
        keys = content_keys([lambda t=t: tensor_key(t) for t in tensors])
    else:
        keys = [fingerprint_key(t, d) for t, d in zip(tensors, device_fingerprints(tensors))]
    if os.environ.get(FORCE_COLLISIONS_ENV):
        keys = [ContentKey(bytes(16), k.dtype, k.shape, k.stride) for k in keys]
    return [str(k) for k in keys]


def share_model(model, client: BrokerClient, device_type: str = "cpu", min_tensor_bytes: int = 1 << 16,
                verify: bool = True, fail: bool = False, lock_timeout_s: float = 600.0,
                device_key: str = "cpu", pack_granularity: int | None = None) -> ShareResult:
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

    Raises:
        RegistryUnavailable: the registry failed mid-way and ``fail`` is set.
    """
    start = time.perf_counter()
    result = _share(model, client, device_type, min_tensor_bytes, verify, fail, lock_timeout_s, device_key,
                    pack_granularity)
    # Only now, with every local of _share gone, are all replaced private copies unreferenced.
    gc.collect()
    _malloc_trim()
    _return_cached(device_type)
    result.seconds = time.perf_counter() - start
    try:
        client.report(dataclasses.asdict(result))
    except RegistryUnavailable:
        pass
    return result


def _share(model, client: BrokerClient, device_type: str, min_tensor_bytes: int, verify: bool,
           fail: bool, lock_timeout_s: float, device_key: str, pack_granularity: int | None) -> ShareResult:
    seg_cls = segment_class(device_type)
    slots, private_n, private_b = _collect(model, device_type, min_tensor_bytes)
    result = ShareResult(private_tensors=private_n, private_bytes=private_b)
    by_key: dict[str, list[_Slot]] = defaultdict(list)
    for slot, key in zip(slots, _keys([s.tensor for s in slots], device_type)):
        by_key[key].append(slot)
    granularity = pack_granularity or (seg_cls.granularity(slots[0].tensor.device) if slots else None)
    freed = 0  # private bytes dropped since the allocator's cache was last emptied

    def keep_private(group: list[_Slot]) -> None:
        result.private_tensors += len(group)
        result.private_bytes += sum(s.nbytes for s in group)

    def adopt(group: list[_Slot], seg, offset: int, published: bool) -> list[_Slot]:
        """Swap each slot whose bytes equal the segment's; return the ones that differ."""
        global _shared_in_process
        nonlocal freed
        differ = []
        for i, slot in enumerate(group):
            t = slot.tensor
            shared = seg.tensor(offset, t.dtype, tuple(t.shape), tuple(t.stride()))
            source = published and i == 0  # the segment was copied from this very tensor
            if verify and not source and not same_bytes(shared, t):
                differ.append(slot)
                continue
            _swap(slot, shared)
            slot.tensor = shared  # the slot held the last reference to the private copy
            freed += slot.nbytes
            _shared_in_process += slot.nbytes
            if source:
                result.published_tensors += 1
                result.published_bytes += slot.nbytes
            else:
                result.shared_tensors += 1
                result.shared_bytes += slot.nbytes
        if freed >= _RETURN_EVERY:
            _return_cached(device_type)
            freed = 0
        return differ

    def publish(keys: list[str], offsets: list[int], nbytes: int) -> None:
        """One new segment holding the first tensor of each key's group at its offset."""
        parts = [(pending[k][0].tensor, off) for k, off in zip(keys, offsets)]
        seg = seg_cls.create_packed(parts, nbytes, device_key)
        try:
            client.publish(seg.fileno(), seg.size,
                           [(k, off, pending[k][0].nbytes) for k, off in zip(keys, offsets)])
        finally:
            seg.close_fd()
        result.padding_bytes += seg.size - sum(pending[k][0].nbytes for k in keys)
        for key, offset in zip(keys, offsets):
            group = pending.pop(key)
            differ = adopt(group, seg, offset, published=True)  # same key in this model, other bytes
            result.collisions += len(differ)
            keep_private(differ)

    pending = dict(by_key)
    try:
        # One engine at a time per (device, share group) looks up and publishes: engines that
        # finish loading together would otherwise all miss and each publish its own copy.
        with client.locked(f"publish:{device_key}:{client.group}", timeout_s=lock_timeout_s):
            # Hits in one segment (a pack) share one mapping; a segment none of whose tensors
            # was taken (refused, or every compare failed) is released, the others are held.
            hits: dict[int, list] = defaultdict(list)
            fds: dict[int, list[int]] = defaultdict(list)
            for hit, fd in client.acquire(list(pending)):
                hits[hit.segment].append(hit)
                fds[hit.segment].append(fd)
            for seg_id, seg_hits in hits.items():
                for fd in fds[seg_id][1:]:
                    os.close(fd)
                groups = [pending.pop(hit.key) for hit in seg_hits]
                try:
                    seg = seg_cls.attach(fds[seg_id][0], max(h.offset + h.nbytes for h in seg_hits), device_key)
                except ValueError as e:  # not a sealed segment: never map it
                    logger.warning("vllm-dedup: resident segment %d refused (%s); its tensors stay private", seg_id, e)
                    client.release([seg_id])
                    for group in groups:
                        keep_private(group)
                    continue
                taken = 0
                for hit, group in zip(seg_hits, groups):
                    differ = adopt(group, seg, hit.offset, published=False)
                    taken += len(group) - len(differ)
                    if differ:
                        result.collisions += len(differ)
                        logger.warning("vllm-dedup: %d tensor(s) with key %s differ from the resident copy "
                                       "(hash collision); they stay private", len(differ), hit.key)
                        keep_private(differ)
                seg.close_fd()
                if not taken:
                    client.release([seg_id])
            misses = list(pending)
            if granularity is None:
                for key in misses:
                    publish([key], [0], pending[key][0].nbytes)
            else:
                plan = plan_packs([pending[k][0].nbytes for k in misses], granularity, max_pack_bytes=granularity)
                for i in plan.private:
                    keep_private(pending.pop(misses[i]))
                for pack in plan.packs:
                    publish([misses[i] for i, _ in pack.members], [off for _, off in pack.members], pack.nbytes)
    except (RegistryUnavailable, TimeoutError) as e:
        if fail:
            raise RegistryUnavailable(str(e)) from None
        result.errors.append(str(e))
        logger.warning("vllm-dedup: registry failed mid-load (%s); the remaining tensors stay private", e)
        for group in pending.values():
            keep_private(group)
    return result


_RETURN_EVERY = 1 << 30  # bytes of dropped private copies between two empty_cache calls


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
