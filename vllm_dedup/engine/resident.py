"""Mapping what is resident: acquire content keys from the registry and attach each segment
found, once.  The one acquire-and-map path of the engine side, used by sharing a loaded model
(`share.py`) and by building a model from a recipe (`replay.py`).

The registry holds every segment an acquire returns until the engine releases it; a segment
that cannot be mapped is released here at once.  Each segment comes with one descriptor,
closed here once the segment is mapped (the mapping keeps the memory).  A host segment's
mapping still holds a descriptor of its own while it lives: Python's ``mmap`` keeps a
``dup`` of the one it maps (before Python 3.13's ``trackfd=False``), so an engine holds one
descriptor per host segment it maps, as many as the model has tensors above
``min_tensor_bytes``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import SegmentError
from ..registry.client import SegmentHits

__all__ = ["Mapped", "map_resident"]


@dataclass
class Mapped:
    """A segment acquired: its hits and its mapping, or why it could not be mapped.

    Attributes:
        found: the registry's answer for it (id, uid, size, hits).
        segment: the mapped segment (`segments.Segment`), or None.
        error: why it could not be mapped (then it was released already).
    """

    found: SegmentHits
    segment: object | None = None
    error: SegmentError | None = None


def map_resident(lease, seg_cls, device_key: str, keys: list[str], uids: list[str] | None = None
                 ) -> Iterator[Mapped]:
    """Acquire ``keys`` (with ``uids``: each only in the segment of that uid) and map each
    segment found, read-only: as much of it as the backend maps to cover its hits
    (`Segment.mapped_bytes`: those bytes on the host, the whole allocation on CUDA).

    Args:
        lease: the engine's registry connection.
        seg_cls: the segment backend (`segments.segment_class`).
        device_key: the device the segments must be on.
        keys, uids: what to look up.

    Yields:
        One `Mapped` per segment with hits, in the registry's order.  A caller that stops
        early (an exception, ``close``) leaves nothing held: the segments not yielded yet are
        released and their descriptors closed.

    Raises:
        RegistryUnavailable: the registry failed (nothing is held for the caller then).
    """
    acquired = list(lease.acquire(keys, uids))
    given = 0
    try:
        for found in acquired:
            given += 1
            try:  # every reply's segment has hits (`messages.AcquireReply`)
                needed = max(h.offset + h.nbytes for h in found.hits)
                segment = seg_cls.attach(found.fd, seg_cls.mapped_bytes(needed, found.nbytes), device_key)
            except Exception as e:  # not a sealed segment, or it cannot be mapped: never use it
                # (`attach` owns the descriptor: it is closed already)
                with contextlib.suppress(Exception):
                    lease.release([found.segment])
                yield Mapped(found, error=SegmentError(f"resident segment {found.segment} refused "
                                                       f"({type(e).__name__}: {e})"))
                continue
            segment.close_fd()
            yield Mapped(found, segment)
    finally:
        rest = acquired[given:]
        for found in rest:
            with contextlib.suppress(OSError):
                os.close(found.fd)
        if rest:
            with contextlib.suppress(Exception):
                lease.release([found.segment for found in rest])
