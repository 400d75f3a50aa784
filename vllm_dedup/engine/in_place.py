"""Publish in place: a usual load's parameters live in memfd segments of this engine's own from
before ``load_weights``, and the sharing pass publishes them where they lie (host backend).

Without it, a usual load reads the checkpoint into private memory and the sharing pass copies
each tensor into a new memfd afterwards: for a while the load holds both copies, and the copy is
a pass over the bytes.  With it:

1. right after vLLM builds the model, every storage the sharing pass would take
   (`slots.collect_slots`: contiguous, covering its storage, at least ``min_tensor_bytes``) is
   moved into a memfd of its own mapped read-write, and the model's places are rebound to it
   (`slots.swap`); the bytes it holds already (a rotary cache computed at construction, a
   norm's ones) are copied (Note [only written pages are copied]);
2. vLLM's weight loaders write the checkpoint's bytes into those pages, and post-processing
   runs on them as on any tensor;
3. the sharing pass keys them as before; one that no other engine holds is published from its
   own memfd (`InPlace.seal`): its writable mapping is made read-only where it is and the memfd
   is sealed against every new writer (Note [sealing where it lies]).  No byte is copied, and
   no page is mapped again.

A storage that post-processing replaces (vLLM packs a linear weight for oneDNN and drops it),
or that the sharing pass maps from another engine instead, frees its pages with its last
reference (Note [a descriptor that goes with its mapping]).

Nothing here stops a load: a storage that cannot be moved stays where vLLM put it; one that
cannot be sealed (something still holds its writable mapping) is published by a copy, as
before.

Note [a storage held elsewhere]
    Moving a storage rebinds the model's places (parameters, buffers, views of them).  A tensor
    of vLLM's own over the same bytes kept anywhere else (a module attribute, a closure, a
    dict) would go on reading the old storage while the weight loaders write the new one.
    torch keeps a storage's Python object alive as long as the storage is, so a weak reference
    taken before the move tells: if the old storage outlives the move, the places are bound
    back to it and it stays where it is.

Note [only written pages are copied]
    vLLM allocates parameters with ``torch.empty``: glibc maps fresh pages nobody has written.
    Copying those would read zero pages and fill the memfd's before the weight loaders do
    (about 0.1 s per GiB here).  A page of private anonymous memory that is neither present
    nor swapped out (``/proc/self/pagemap``, bits 63 and 62) reads as zeros, as a fresh memfd
    page does, so only the runs of present or swapped pages are copied.  That holds for
    private anonymous mappings only (``/proc/self/maps``); any other storage is copied whole,
    as is everything where ``pagemap`` cannot be read or does not tell a written page from an
    untouched one (a probe, `proc_maps.present_runs`).

Note [no pages allocated ahead of the weight loaders]
    Most of what writing into a fresh memfd costs is the kernel allocating and zeroing its
    pages at the write faults: 1.2 GB copied into fresh memfds took 0.81 s on one core, and
    0.07 s once ``madvise(MADV_POPULATE_WRITE)`` had faulted them in (0.68 s).  A thread that
    populated the placed segments on the other core while the weight loaders wrote (from the
    last backwards, so that the two would meet in the middle; the GIL released in ``madvise``)
    halved that test's 0.81 s, but gained nothing in an engine: the 1.2B model's first
    engine under AVX2, four alternating loads each, median 1.99 s with it against 1.98 s
    without, and its ``load_weights`` copies took 2.42 s and 5.31 s against 2.34 s and 2.95 s
    in two profiles each.  Why was not found (the threads hashing the checkpoint share that
    core, and the copies fault in the checkpoint's file pages too).  Not kept.  Nor done
    synchronously: ``posix_fallocate`` and ``MADV_POPULATE_WRITE`` of each segment as `place`
    makes it cost 0.62 s per GiB against 1.1 s faulted at the writes in a microbenchmark, but
    in the 1.2B model's first engine (AVX2 VM, 2026-11-28) it took 1.68 s and saved only 0.92 s
    of the copies (1.54 s to 0.62 s, py-spy), and three alternating loads each gave a median of
    3.60 s against 3.52 s (that day's figures; the 0.81 s above is another day's).  Why the
    engine differs from the microbenchmark (1 GiB filled again and again in one process) was
    not found either; on this VM the host takes free pages back (free page reporting), so a
    load's fresh pages may cost more than a benchmark's.

Note [sealing where it lies]
    ``F_SEAL_WRITE`` fails (EBUSY) while any shared mapping of the memfd may become writable:
    the writable mapping the weight loaders wrote through, and even a read-only shared mapping
    of a descriptor opened for writing (Linux 6.18 here).  Closing that mapping and mapping
    the pages again costs page-table work in proportion to the bytes (about 0.16 s per GB
    here, `benchmarks/seal_cost.py`), as much as a tenth of a plain load.  So `InPlace.seal`
    keeps the mapping: ``mprotect(PROT_READ)`` makes it read-only (a write through it faults,
    as through a sealed segment's mapping), and ``F_SEAL_FUTURE_WRITE`` (Linux 5.1) seals the
    memfd against every *new* writable mapping and every ``write``, in every process.  Only
    this engine could make its own mapping writable again, by calling ``mprotect`` itself; a
    peer in its share group is trusted that far already (a recipe is mapped without reading
    it: docs/architecture.md, "Trust"), and a CUDA exporter keeps its allocation writable in
    the same way.  Receivers accept either seal (`host.check_sealed_memfd`).  The seal comes
    before the mprotect, so that a seal the kernel refuses leaves the tensors writable, kept
    private (`host.seal_where_it_lies`).

Note [sealing under a tensor]
    Where the kernel does not take ``F_SEAL_FUTURE_WRITE`` (before Linux 5.1; tried once,
    `host.seals_future_writes`), the writable mapping must go before ``F_SEAL_WRITE``, and
    the tensor must read valid pages all the time, so `InPlace.seal` moves it in three steps:
    to a private read-only mapping of the memfd (the *bridge*: it reads the same pages, and a
    private mapping does not block the seal), then the writable mapping is closed and the
    memfd sealed, then the tensor goes to the segment's read-only mapping (`HostSegment`:
    shared, or private over the same pages where the kernel refuses a shared mapping of a
    write-sealed memfd, `host.map_read_only`) and the bridge goes with its last view.

Note [descriptors]
    A writable segment holds two descriptors while it is writable: its own and the one
    Python's ``mmap`` keeps (a ``dup``); a published one keeps the mapping's.  A model of
    thousands of tensors could otherwise take a process to its descriptor limit, and vLLM's own
    sockets and files would fail: `InPlace.place` moves tensors only while 1024 descriptors
    stay free under the soft limit, and loads the rest into private memory.

Note [a descriptor that goes with its mapping]
    A memfd's pages live while its descriptor or a mapping of it does.  The writable mapping is
    a Python ``mmap`` that each storage over it holds a reference to (``torch.frombuffer``
    takes one, and gives back the buffer itself at once: ``mmap.close`` would unmap pages a
    tensor still reads); a ``weakref.finalize`` on it closes the descriptor when the mapping
    goes, i.e. with the last storage over it.  `InPlace.seal` detaches the finalizer first
    (that descriptor is published) and lets the mapping go only when no storage holds it.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import warnings
import weakref
from dataclasses import dataclass

import torch

from ..content.views import typed_view
from ..errors import SegmentError
from ..log import init_logger
from ..segments.host import HostSegment, seal, seals_future_writes, writable_memfd
from .proc_maps import AnonymousRanges
from .slots import Slot, collect_slots, swap, swap_out

__all__ = ["InPlace", "placeable_slots"]

logger = init_logger(__name__)


@dataclass
class _Placed:
    """One storage moved into a writable memfd: its descriptor, size (bytes) and mapping."""

    fd: int
    nbytes: int
    mapping: weakref.ref  # the writable ``mmap``; dead once no tensor is over it
    closer: weakref.finalize  # closes ``fd`` when the mapping goes (Note [a descriptor that goes with its mapping])
    sealed: bool = False


class InPlace:
    """The writable segments of one usual load (host backend): made by `place` before
    ``load_weights``, sealed and published by the sharing pass (`seal`), the rest let go of by
    `release`.

    Args:
        min_bytes: storages smaller than this stay where vLLM put them (``min_tensor_bytes``).
        skip: ``skip(module, name)`` is true for a parameter or buffer post-processing will
            replace (a linear weight vLLM packs for oneDNN and drops): those stay in private
            memory, where the heap hands the pages of one layer's to the next (`heap.reused_heap`).
        huge_pages: ask for 2 MiB pages (`config.DedupConfig.huge_pages`).

    Attributes:
        placed_bytes: bytes moved into writable segments by `place`.
        sealed_bytes: bytes sealed where they lie by `seal` (published with no copy).
        seals_where_it_lies: whether `seal` keeps the writable mapping, made read-only (Note
            [sealing where it lies]), or goes through the bridge (Note [sealing under a
            tensor]); this kernel's answer (`host.seals_future_writes`) unless set.
        failures: why storages stayed where they were or were copied after all (first few).
    """

    granularity = None  # a memfd per storage: the sharing pass packs nothing (`in_place_packed` does)

    def __init__(self, min_bytes: int, skip=None, huge_pages: bool = False):
        self.min_bytes, self.huge_pages = min_bytes, huge_pages
        self.skip = skip or (lambda module, name: False)
        self._placed: dict[int, _Placed] = {}  # address of the mapping's first byte -> its segment
        self.seals_where_it_lies = seals_future_writes()  # else the bridge (Note [sealing under a tensor])
        self.placed_bytes = 0
        self.sealed_bytes = 0
        self.failures: list[str] = []

    @property
    def held_bytes(self) -> int:
        """Bytes of this load's in-place segments that exist now (the load meter's ``live``):
        the sealed ones and those a tensor still views."""
        return self.sealed_bytes + sum(p.nbytes for p in list(self._placed.values()) if p.mapping() is not None)

    def place(self, model: torch.nn.Module, modules: list[torch.nn.Module] | None = None) -> None:
        """Move each of ``model``'s storages the sharing pass would take into a writable memfd of
        its own (module docstring, step 1); with ``modules``, only storages whose every place is
        in one of them (a replay's modules loaded from the checkpoint: the others are mapped).
        Never raises: a storage that cannot be moved stays."""
        anonymous = AnonymousRanges()
        room = _descriptor_room()
        for slot in placeable_slots(model, "cpu", self.min_bytes, self.skip, modules, self.failures):
            if room < 2:  # Note [descriptors]
                self.failures.append("the process's descriptor limit (RLIMIT_NOFILE) is near")
                logger.info("in place: the descriptor limit is near; the other tensors load into private memory")
                break
            room -= 2
            try:
                self._move(slot, anonymous)
            except (OSError, ValueError, RuntimeError, MemoryError) as e:  # out of memory or descriptors
                self.failures.append(f"{type(e).__name__}: {e}")
                logger.info("in place: the rest of the storages stay in private memory (%s)", e)
                break

    def _move(self, slot: Slot, anonymous: AnonymousRanges) -> None:
        """Move one storage; or, where something outside the model's places still holds vLLM's
        storage (Note [a storage held elsewhere]), leave it where it is."""
        old, nbytes = slot.tensor, slot.nbytes
        fd, mapping = writable_memfd(nbytes, huge=self.huge_pages)
        closer = weakref.finalize(mapping, os.close, fd)
        dtype, shape, stride = old.dtype, tuple(old.shape), tuple(old.stride())
        new = _over(mapping, dtype, shape, stride)
        _copy_written(old, new, anonymous)
        del old
        held = swap_out(slot, new)
        if held is not None:  # Note [a storage held elsewhere]: back where it was
            swap(slot, torch.empty(0, dtype=dtype).set_(held, 0, shape, stride))
            self.failures.append("a tensor outside the model's parameters and buffers holds its storage")
            return
        self._placed[new.data_ptr()] = _Placed(fd, nbytes, weakref.ref(mapping), closer)
        self.placed_bytes += nbytes

    def holds_no_data(self, address: int, nbytes: int = 0) -> bool:
        """Whether ``address`` is the first byte of one of this load's writable segments, still
        in use and of at least ``nbytes``, whose memfd holds no data now: every byte reads zero,
        so a write witness need not read its pages (`sources.write_witness`; a read would
        allocate them).  Exact: shmem answers ``lseek(SEEK_DATA)`` from its page cache, where a
        page written, read or swapped out is data (lseek(2))."""
        placed = self._placed.get(address)
        # not ours, or its descriptor went with its mapping (Note [a descriptor that goes with its mapping])
        if placed is None or placed.mapping() is None or nbytes > placed.nbytes:
            return False
        try:
            os.lseek(placed.fd, 0, os.SEEK_DATA)
        except OSError as e:
            return e.errno == errno.ENXIO  # no data from offset 0 on: all of it a hole
        return False

    def packs(self, pending: dict) -> tuple[list, list]:
        """Packs of several tensors to publish where they lie, and groups of misses to copy
        together: none here, every segment holds one storage (`seal` takes one-key packs)."""
        return [], []

    def seal(self, slots: list[Slot], offsets: list[int]) -> HostSegment | None:
        """Publish a one-slot pack where it lies: the slot's memfd is sealed with its pages
        where they are (module docstring, step 3).

        Returns:
            The sealed segment (the caller publishes it and owns its descriptor), or None where
            the pack is not one slot at offset 0 of an in-place segment of this load, or it
            cannot be sealed (the caller copies it then; the slot reads the same bytes either way).
        """
        if len(slots) != 1 or list(offsets) != [0]:
            return None
        slot = slots[0]
        t = slot.tensor
        placed = self._placed.get(t.untyped_storage().data_ptr())
        if placed is None or placed.sealed or placed.nbytes != slot.nbytes or t.storage_offset():
            return None
        writable = placed.mapping()
        if writable is None:
            return None
        placed.closer.detach()  # from here the descriptor is closed here or handed over
        del self._placed[t.data_ptr()]
        dtype, shape, stride = t.dtype, tuple(t.shape), tuple(t.stride())
        del t
        try:
            _onto_own_storage(slot, writable, dtype, shape, stride)
        except (BufferError, ValueError) as e:  # the slot stays on the writable mapping: copied instead
            return self._not_sealed(placed.fd, e)
        if self.seals_where_it_lies:
            return self._seal_where_it_lies(placed, writable)
        handed = False  # the descriptor given to `HostSegment`, which closes it if it fails
        try:  # Note [sealing under a tensor]
            bridge = mmap.mmap(placed.fd, placed.nbytes, mmap.MAP_PRIVATE, mmap.PROT_READ)
            swap(slot, _over(bridge, dtype, shape, stride))
            del bridge
            # Each storage over the mapping holds a reference to it (torch.frombuffer): one
            # still alive may be written through.
            if sys.getrefcount(writable) > 2:  # ours and the call's
                raise BufferError("a tensor outside the model still views its writable mapping")
            del writable  # the last reference: unmapped now
            seal(placed.fd)
            handed = True
            seg = HostSegment(placed.fd, placed.nbytes)  # read-only, over the same pages
        except (BufferError, OSError, ValueError, SegmentError) as e:
            # Not on the read-only bridge: a tensor left private there would fault at the first
            # write of vLLM's that the engine lets through for private weights.
            _private_again(slot, dtype, shape, stride)
            return self._not_sealed(None if handed else placed.fd, e)
        swap(slot, seg.tensor(0, dtype, shape, stride))
        placed.sealed = True
        self.sealed_bytes += placed.nbytes
        return seg

    def _seal_where_it_lies(self, placed: _Placed, writable: mmap.mmap) -> HostSegment | None:
        """`seal` by Note [sealing where it lies]: the slot stays on its writable mapping,
        made read-only, and the memfd is sealed against every new writer."""
        try:
            seg = HostSegment.sealed_where_it_lies(placed.fd, placed.nbytes, writable)
        except (BufferError, OSError, ValueError) as e:  # the slot reads the same bytes: it is copied instead
            return self._not_sealed(placed.fd, e)
        placed.sealed = True
        self.sealed_bytes += placed.nbytes
        return seg

    def _not_sealed(self, fd: int | None, e: Exception) -> None:
        """A storage `seal` leaves to be copied: its descriptor closed (None: handed over
        already) and why said; returns None, `seal`'s answer."""
        if fd is not None:
            os.close(fd)
        self.failures.append(f"a storage cannot be sealed where it lies ({type(e).__name__}: {e})")

    def discard(self) -> None:
        """Forget what was placed so far, for a model given up (a replay that declined): the
        descriptors are closed (the pages go with the model) and count no more."""
        for placed in self._placed.values():
            placed.closer()
            self.placed_bytes -= placed.nbytes
        self._placed.clear()

    def release(self) -> None:
        """Let go of the descriptors not published: the pages of a segment no tensor views go
        now, those of one still in use (a tensor left private) with its last tensor."""
        for placed in self._placed.values():
            placed.closer()  # closes the descriptor once (a no-op if it ran already)
        self._placed.clear()

    def summary(self) -> str:
        mb = 1e6
        return (f"{self.placed_bytes / mb:.1f} MB loaded into segments of its own, "
                f"{self.sealed_bytes / mb:.1f} MB of it published where it lies")


def placeable_slots(model, device_type: str, min_bytes: int, skip, modules, failures: list[str]) -> list[Slot]:
    """The slots of ``model`` an in-place load moves (`collect_slots`), in the model's order:
    none of whose places holds a tensor post-processing replaces (``skip(module, name)``), and
    with ``modules`` (a replay's modules loaded from the checkpoint) every place in one of them.
    ``[]`` where the model's storages cannot be collected (an uninitialized parameter): the
    reason goes into ``failures`` and the log, and they load into private memory."""
    try:
        slots = collect_slots(model, device_type, min_bytes)[0]
    except (RuntimeError, ValueError, TypeError) as e:  # the walk failed: nothing moves
        failures.append(f"{type(e).__name__}: {e}")
        logger.info("in place: the model's storages cannot be collected (%s); they load into private memory", e)
        return []
    only = None if modules is None else {id(m) for m in modules}
    return [slot for slot in slots if not any(skip(module, name) for module, name, _ in slot.refs)
            and (only is None or all(id(module) in only for module, _, _ in [*slot.refs, *slot.views]))]


def _descriptor_room() -> int:
    """Descriptors this load may hold for in-place segments (Note [descriptors]): those left
    under the soft ``RLIMIT_NOFILE`` less a reserve of 1024 for everything else."""
    import resource

    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        used = len(os.listdir("/proc/self/fd"))
    except (OSError, ValueError):
        return 0
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(soft - used - 1024, 0)


def _onto_own_storage(slot: Slot, writable: mmap.mmap, dtype: torch.dtype, shape: tuple, stride: tuple) -> None:
    """Bind ``slot`` to a tensor of this module's own over ``writable`` (the same bytes), so that
    no storage the model's places held is left.

    Raises:
        BufferError: something outside the model's places still holds the old storage (a view
            of vLLM's, which may write); the slot is on the new tensor all the same.
        ValueError: the layout does not fit the mapping."""
    if swap_out(slot, _over(writable, dtype, shape, stride)) is not None:
        raise BufferError("a tensor outside the model still views its writable mapping")


def _private_again(slot: Slot, dtype: torch.dtype, shape: tuple, stride: tuple) -> None:
    """Move ``slot`` into private memory of its own, a copy of the bytes it reads now."""
    private = torch.empty_strided(shape, stride, dtype=dtype)
    private.copy_(slot.tensor)
    swap(slot, private)


def _over(buffer, dtype: torch.dtype, shape: tuple, stride: tuple) -> torch.Tensor:
    """A tensor over ``buffer`` (a mapping, read-only or not) from its first byte, made as every
    segment's tensors are (`content.views.typed_view`, which checks it fits)."""
    with warnings.catch_warnings():  # torch warns about read-only buffers: that is the point
        warnings.simplefilter("ignore", UserWarning)
        return typed_view(torch.frombuffer(buffer, dtype=torch.uint8), 0, dtype, shape, stride)


def _copy_written(src: torch.Tensor, dst: torch.Tensor, anonymous: AnonymousRanges) -> None:
    """Copy ``src`` into ``dst`` (a fresh memfd's zeros, same dtype and shape, both contiguous),
    skipping the pages of ``src`` that read as zeros (Note [only written pages are copied])."""
    address, nbytes = src.data_ptr(), src.numel() * src.element_size()
    runs = anonymous.written_runs(address, nbytes)
    if runs is None:
        dst.copy_(src)
        return
    src_bytes, dst_bytes = src.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
    for lo, hi in runs:
        dst_bytes[lo:hi].copy_(src_bytes[lo:hi])
