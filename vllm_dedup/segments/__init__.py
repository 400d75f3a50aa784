"""Segments: memory that several processes map, freed when the last holder lets go.

A segment is a file descriptor plus a size.  The descriptor is what crosses processes (the
broker passes it with SCM_RIGHTS) and what keeps the memory alive: the engine that created a
segment can exit, even by SIGKILL, while the others go on using it (DESIGN.md, "Segments").

One backend per device type, one module each, behind `Segment`:

- ``host`` (`HostSegment`): memfd + mmap, for vLLM's CPU backend and every test without a GPU;
- ``cuda``: CUDA virtual memory management (a later stage of the project).

`segment_class` picks the backend for a torch device type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["Segment", "segment_class"]


class Segment(ABC):
    """Shareable memory holding one or more tensors' bytes.

    Attributes:
        nbytes: usable size in bytes (the backend may round the allocation up).
        device: the device the memory lives on, as a string (``"cpu"``, ``"cuda:<uuid>"``).
    """

    nbytes: int
    device: str

    @classmethod
    @abstractmethod
    def create(cls, data, device: str) -> Segment:
        """A new segment holding a copy of ``data`` (a contiguous torch tensor), sealed."""

    @classmethod
    @abstractmethod
    def attach(cls, fd: int, nbytes: int, device: str) -> Segment:
        """Map a segment another process created, read-only.  Takes ownership of ``fd``."""

    @abstractmethod
    def fileno(self) -> int:
        """The descriptor to pass to other processes (still owned by the segment)."""

    @abstractmethod
    def tensor(self, offset: int, dtype, shape, stride):
        """A zero-copy torch tensor over ``[offset, offset + bytes)`` of the segment.

        The tensor keeps the mapping alive; the segment object may be dropped before it.
        """

    @abstractmethod
    def close_fd(self) -> None:
        """Close the descriptor; existing mappings and tensors stay valid."""


def segment_class(device_type: str) -> type[Segment]:
    """The segment backend for a torch device type (``"cpu"``, ``"cuda"``).

    Raises:
        NotImplementedError: no backend for that device type yet.
    """
    if device_type == "cpu":
        from .host import HostSegment

        return HostSegment
    raise NotImplementedError(f"vllm-dedup has no segment backend for device type {device_type!r} yet")
