"""Segments: memory that several processes map, freed when the last holder lets go.

A segment is a file descriptor plus a size.  The descriptor is what crosses processes (the
registry passes it with SCM_RIGHTS) and what keeps the memory alive: the engine that created a
segment can exit, even by SIGKILL, while the others go on using it (docs/architecture.md, "Segments").

One backend per device type, one module each, behind `Segment`:

- ``host`` (`HostSegment`): memfd + mmap, for vLLM's CPU backend and every test without a GPU;
- ``cuda`` (`CudaSegment`): CUDA virtual memory management through ``cuda-bindings``.

`segment_class` picks the backend for a torch device type.  A backend also names devices
(`Segment.device_key`: the registry keeps each device's segments apart), says its allocation
granularity (`Segment.granularity`: small tensors are packed into one segment, `packing.py`),
and holds what else differs between devices for the engine: how content keys are computed
(`Segment.content_keys`), what private memory is (`Segment.private_bytes`) and what an allocator
gives back (`Segment.return_cached`).

Every failure of the memory itself (create, fill, seal, export, import, map) raises
`errors.SegmentError`, so the engine side has one thing to catch (the tensors concerned stay
private); a caller's own mistake (a range, part or view outside the segment, a tensor that is
not contiguous) raises ``ValueError``.

A segment is made in one of two ways: `Segment.create_packed` copies tensors into a new one, or
`Segment.allocate` gives a writable one that this process fills where it lies (`Segment.member`
tensors: a load's weight loaders write there, `engine.in_place_packed`) and then makes read-only
(`Segment.freeze`).  Either way, what is published is read-only in every process.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

from ..errors import SegmentError

__all__ = ["Segment", "segment_class"]


class Segment(ABC):
    """Shareable memory holding one or more tensors' bytes.

    Attributes:
        nbytes: usable size in bytes.
        size: allocated size in bytes: ``nbytes`` rounded up to the backend's granularity.
        device: the device the memory lives on, as its key (``"cpu"``, ``"cuda:GPU-<uuid>"``).
    """

    nbytes: int
    size: int
    device: str

    @classmethod
    @abstractmethod
    def create_packed(cls, parts, nbytes: int, device: str) -> Segment:
        """A new sealed segment of ``nbytes`` usable bytes holding copies of several tensors.

        Args:
            parts: ``(tensor, offset)`` pairs: each contiguous tensor's bytes are copied to
                ``offset`` (bytes); the ranges must not overlap and must fit in ``nbytes``.
            nbytes: the segment's usable size in bytes (the backend may round it up).
            device: the segment's device key (`device_key`).
        """

    @classmethod
    @abstractmethod
    def device_key(cls, device) -> str:
        """The registry's name for a torch device: stable across processes and across
        ``CUDA_VISIBLE_DEVICES`` renumbering (``"cpu"``, ``"cuda:GPU-<uuid>"``)."""

    @classmethod
    @abstractmethod
    def granularity(cls, device) -> int | None:
        """Allocation granularity in bytes on a torch device, or None when a segment per
        tensor costs nothing worth packing for (host pages)."""

    @classmethod
    @abstractmethod
    def attach(cls, fd: int, nbytes: int, device: str) -> Segment:
        """Map a segment another process created, read-only: its first ``nbytes`` bytes (see
        `mapped_bytes`).  Takes ownership of ``fd``."""

    @classmethod
    def mapped_bytes(cls, needed: int, segment_bytes: int) -> int:
        """Bytes to `attach` of a segment of ``segment_bytes`` bytes (the registry's size) whose
        first ``needed`` bytes this process uses: only those by default, so that a pack's other
        members are not mapped."""
        return needed

    # What differs between devices on the engine side, so that the engine never branches on one.
    @classmethod
    @abstractmethod
    def content_keys(cls, tensors) -> list:
        """The content keys (`content.keys.ContentKey`) of contiguous tensors on this backend's
        device, in order: XXH3-128 of the bytes on the host, a device fingerprint on a GPU."""

    @classmethod
    @abstractmethod
    def private_bytes(cls) -> int:
        """This process's private memory on this backend's device now, in bytes (what a load
        grows: `engine.meter.LoadMeter`)."""

    @classmethod
    def return_cached(cls, collect: bool = True) -> None:
        """Give memory an allocator keeps cached for this process back to the device (after
        tensors were swapped for segments); with ``collect``, after a garbage collection (tensors
        in reference cycles).  Nothing to give back by default."""

    # Publishing in place (module docstring): allocate, fill through members, freeze.
    @classmethod
    def allocate(cls, nbytes: int, device: str) -> Segment:
        """A new segment of ``nbytes`` usable bytes, mapped read-write in this process for it to
        fill through `member` tensors; `freeze` it before it is published.  Its bytes are zeros
        on the host (a new memfd's); on CUDA they are whatever ``cuMemCreate`` gives, which its
        documentation leaves unsaid, so only the host's in-place load may rely on zeros
        (`engine.in_place.InPlace.holds_no_data`).

        Raises:
            SegmentError: this backend cannot, or not now (the message says why).
        """
        raise SegmentError(f"the {cls.__name__} backend cannot publish in place")

    def member(self, offset: int, nbytes: int):
        """A 1-d ``uint8`` tensor over ``[offset, offset + nbytes)`` of a segment from
        `allocate`, with a storage of its own (exactly those bytes: to the engine it is one
        storage, as a tensor vLLM allocated is), writable until `freeze`.  It keeps the mapping
        alive."""
        raise NotImplementedError(f"{type(self).__name__} has no writable members")

    def _check_member(self, offset: int, nbytes: int) -> None:
        """Raise ValueError unless ``[offset, offset + nbytes)`` is at least one byte and lies
        within the usable bytes (torch makes no tensor over an empty buffer range)."""
        if nbytes < 1 or not 0 <= offset < offset + nbytes <= self.nbytes:
            raise ValueError(f"a {nbytes}-byte member at offset {offset} does not fit in {self.nbytes} bytes")

    def freeze(self) -> None:
        """Make a segment from `allocate` read-only in this process, and sealed against new
        writers where the backend can seal: from here on it is what `create_packed` would have
        made, ready to publish.  Its members read the same bytes (a write through them faults,
        where `read_only` is true after: a CUDA driver may refuse read-only access, and then
        every mapping of that device's segments is read-write, `create_packed`'s too).

        Raises:
            SegmentError: the backend could not do what it can do (a memfd could not be sealed,
                the device failed): it must not be published then.
        """
        raise NotImplementedError(f"{type(self).__name__} has no writable members")

    @property
    def read_only(self) -> bool:
        """Whether a write through this process's mapping of the segment faults: true for every
        segment but one from `allocate` not frozen yet, and a CUDA device's whose driver refuses
        read-only access (`vmm.Mapping.protect`)."""
        return True

    _fd: int  # the segment's descriptor in this process, -1 once closed

    def fileno(self) -> int:
        """The descriptor to pass to other processes (still owned by the segment)."""
        return self._fd

    @abstractmethod
    def tensor(self, offset: int, dtype, shape, stride):
        """A zero-copy torch tensor over ``[offset, offset + bytes)`` of the segment.

        The tensor keeps the mapping alive; the segment object may be dropped before it.
        """

    def close_fd(self) -> None:
        """Close the descriptor (idempotent); existing mappings and tensors stay valid.

        Once it has been passed on, close it: an open descriptor is itself a reference that
        keeps the memory alive (a memfd's pages, a CUDA allocation) beyond the mappings.
        """
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            self.close_fd()
        except Exception:  # interpreter shutdown
            pass


def segment_class(device_type: str) -> type[Segment]:
    """The segment backend for a torch device type (``"cpu"``, ``"cuda"``).

    Raises:
        NotImplementedError: no backend for that device type yet.
    """
    if device_type == "cpu":
        from .host import HostSegment

        return HostSegment
    if device_type == "cuda":
        from .cuda import CudaSegment

        return CudaSegment
    raise NotImplementedError(f"vllm-dedup has no segment backend for device type {device_type!r} yet")
