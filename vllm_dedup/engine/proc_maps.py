"""This process's memory mappings as the kernel lists them (``/proc/self/maps``, proc(5)): one
parser for every reader (the oneDNN library's extension and code ranges, in place's private
anonymous ranges)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Mapping", "mappings"]


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
