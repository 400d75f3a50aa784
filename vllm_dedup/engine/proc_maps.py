"""This process's memory as the kernel lists it (proc(5)): its mappings (``/proc/self/maps``),
one parser for every reader (the oneDNN library's extension and code ranges, the private
anonymous ranges), and which pages of a range are present (``/proc/self/pagemap``).

A page of a private anonymous mapping that is neither present nor swapped out reads as zeros:
publishing in place copies only the others (`in_place`, Note [only written pages are copied]),
and a write witness does not read them (`sources.write_witness`).
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import kept_unless_passing

__all__ = ["PAGE_BYTES", "AnonymousRanges", "Mapping", "mappings", "present_runs"]

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Mapping:
    """One line of ``/proc/self/maps``: ``[start, end)`` (addresses), permissions (``rwxp`` or
    ``rwxs``: ``p`` private, ``s`` shared), offset into the file (bytes), device
    (``major:minor``, hex), inode, and path (``""`` for an anonymous mapping, ``[heap]``...)."""

    start: int
    end: int
    perms: str
    offset: int
    device: str
    inode: int
    path: str

    @property
    def private_anonymous(self) -> bool:
        """A private mapping of no file (an anonymous one, or the heap)."""
        return self.perms[3] == "p" and self.inode == 0 and self.path in ("", "[heap]")


def mappings() -> Iterator[Mapping]:
    """Each mapping of this process now, in address order.

    Raises:
        OSError: ``/proc/self/maps`` cannot be read.
    """
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            path = fields[5].rstrip("\n") if len(fields) > 5 else ""
            yield Mapping(start, end, fields[1], int(fields[2], 16), fields[3], int(fields[4]), path)


class AnonymousRanges:
    """The private anonymous mappings of this process now (`mappings`), to tell whether an
    address range reads zeros where no page is present; and, with ``holds_no_data``, whether
    one that lies elsewhere reads zeros throughout.

    Args:
        holds_no_data: ``holds_no_data(address, nbytes)`` is true where ``address`` starts a
            mapping of at least ``nbytes`` whose every byte reads zero now (a memfd of this
            load's that nothing has written: `in_place.InPlace.holds_no_data`).
    """

    def __init__(self, holds_no_data=None):
        self.holds_no_data = holds_no_data
        self.starts, self.ends = [], []
        try:
            for m in mappings():
                if not m.private_anonymous:
                    continue
                if self.ends and self.ends[-1] == m.start:  # adjacent: one range
                    self.ends[-1] = m.end
                else:
                    self.starts.append(m.start)
                    self.ends.append(m.end)
        except OSError:
            pass

    def contains(self, address: int, nbytes: int) -> bool:
        """Whether ``[address, address + nbytes)`` lies within one private anonymous range."""
        i = bisect.bisect_right(self.starts, address) - 1
        return i >= 0 and address + nbytes <= self.ends[i]

    def written_runs(self, address: int, nbytes: int) -> list[tuple[int, int]] | None:
        """`present_runs` of ``[address, address + nbytes)`` where that range lies in one
        private anonymous range, so every byte outside the runs reads as zero; no run where
        ``holds_no_data`` says the range starts a mapping of zeros; None elsewhere, or where
        pagemap cannot be read (then any byte may be written)."""
        if self.contains(address, nbytes):
            return present_runs(address, nbytes)
        if self.holds_no_data is not None and self.holds_no_data(address, nbytes):
            return []
        return None


def present_runs(address: int, nbytes: int) -> list[tuple[int, int]] | None:
    """Byte ranges (offsets from ``address``) of the pages in ``[address, address + nbytes)``
    that are present or swapped out (``/proc/self/pagemap``, bits 63 and 62); None where it
    cannot be read, or does not tell (`_pagemap_tells`).  In a private anonymous range
    (`AnonymousRanges`) every other byte reads as zero."""
    first, last = address // PAGE_BYTES, (address + nbytes - 1) // PAGE_BYTES
    raw = _pagemap(first, last - first + 1) if _pagemap_tells() else None
    if raw is None:
        return None
    present = (np.frombuffer(raw, dtype=np.uint64) >> np.uint64(62)) != 0
    edges = np.flatnonzero(np.diff(np.concatenate(([0], present.astype(np.int8), [0]))))
    return [(max(address, (first + a) * PAGE_BYTES) - address, min(address + nbytes, (first + b) * PAGE_BYTES) - address)
            for a, b in zip(edges[0::2].tolist(), edges[1::2].tolist())]


def _pagemap(first: int, count: int) -> bytes | None:
    """``count`` entries of ``/proc/self/pagemap`` from page ``first`` (8 bytes each), or None."""
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first * 8)
            raw = pagemap.read(count * 8)
    except OSError:
        return None
    return raw if len(raw) == count * 8 else None


@kept_unless_passing(lambda told: told is None)
def _pagemap_tells() -> bool | None:
    """Whether ``pagemap`` tells a present page from an absent one here: a page just written
    must read present, and one never touched absent.  A kernel whose entries say otherwise (a
    sandbox emulating ``/proc`` with zeros) would have written pages skipped as zeros, which
    would be a wrong weight: its answers are not used then (every byte is copied).  None (not
    kept: asked again next time) where the probe cannot be made or read now (out of memory,
    mappings or descriptors; or no pagemap).  Never raises."""
    try:
        probe = mmap.mmap(-1, 2 * PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    try:
        with contextlib.suppress(OSError):  # one huge page would make the untouched page present
            probe.madvise(mmap.MADV_NOHUGEPAGE)
        probe[0] = 1  # the first page written, the second never touched
        address = np.frombuffer(probe, dtype=np.uint8).ctypes.data  # the array goes at once: close() can
        raw = _pagemap(address // PAGE_BYTES, 2)
        if raw is None:
            return None
        bits = np.frombuffer(raw, dtype=np.uint64) >> np.uint64(62)
        return bool(bits[0] != 0 and bits[1] == 0)
    finally:
        probe.close()
