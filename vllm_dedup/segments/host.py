"""Host segments: ``memfd_create`` + ``mmap``, read-only for everyone once sealed.

The creator copies the tensor's bytes into a fresh memfd and then seals it
(``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``).  After that the kernel refuses
any writable shared mapping and any ``write`` to it, in every process, the creator's included:
a stray in-place write into a shared weight faults instead of silently changing another
engine's model.  All processes map it ``PROT_READ``, ``MAP_SHARED`` (``MAP_PRIVATE`` where an
older kernel refuses that: Note [a read-only mapping of a write-sealed memfd]), so its pages exist
once and are counted once across processes (PSS splits them).

A segment sealed where it was loaded (`engine.in_place`) is sealed with ``F_SEAL_FUTURE_WRITE``
instead of ``F_SEAL_WRITE`` (`seal_future_writes`; Note [sealing where it lies] there): the
kernel refuses every new writable mapping and every ``write``, and the creator's own writable
mapping, which it keeps, is made read-only (`protect_read_only`).  Receivers accept either seal
(`check_sealed_memfd`): nobody but the creator can write, and the creator's mapping faults on
a write as a read-only one does.

Note [huge pages for segments]
    A memfd's pages are shmem pages, 4 KiB unless the machine enables transparent huge pages
    for shmem (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``; most distributions ship
    ``never``).  With ``advise``, a writable mapping madvised ``MADV_HUGEPAGE`` faults in 2 MiB
    pages (`writable_memfd` with ``huge``, for a segment of 2 MiB or more; the kernel keeps a
    segment's tail in 4 KiB pages, so nothing is allocated past its size), and every process
    that maps the segment then maps those pages whole: a later engine's ``MAP_POPULATE`` fills
    one entry per 2 MiB instead of 512, and its kernels take fewer TLB misses.  Measured on
    1 GiB (Linux 6.18): ``MAP_POPULATE`` of a reader 0.065 s in 4 KiB pages, 0.001 s in 2 MiB
    ones.  The writer pays: on this project's VM (free page reporting to the host) a 1.2B
    model's first engine took 5.88 s filling huge pages against 2.32 s in small ones (README,
    "Huge pages"), so it is the user's choice (`config.DedupConfig.huge_pages`, off by
    default).  With ``within_size`` or ``always`` the kernel uses huge pages without being
    asked, for segments written with ``pwrite`` too (staged packed weights: `sealed_memfd`),
    which ``advise`` leaves in 4 KiB pages.  With ``never`` the advice does nothing.

Note [a read-only mapping of a write-sealed memfd]
    Older kernels refuse every ``MAP_SHARED`` mapping of a memfd sealed with ``F_SEAL_WRITE``,
    read-only ones too (EPERM): ``mmap_region`` calls ``mapping_map_writable`` for any shared
    mapping, and the seal has denied it.  Ubuntu 22.04's 5.15 does (iree-org/iree#23776);
    later kernels check only mappings that may be written (``VM_MAYWRITE``), as the seal's
    documentation says.  There every segment made by copying (`HostSegment.create_packed`:
    packed weights, copied tensors) and every recipe (`HostSegment.from_bytes`) would fail to
    map, and the engine would silently share little and replay nothing.  So `map_read_only`
    maps ``MAP_PRIVATE`` where ``MAP_SHARED`` is refused: a private mapping of a shmem file
    reads the memfd's own pages (a page is copied only when written, and ``PROT_READ`` never
    writes), so the pages still exist once and PSS splits them as before.  What changes is
    only what an ``mprotect`` of this process could do: make its own mapping writable and get
    private copies on write, which no other engine ever sees.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import mmap
import os
import stat
import warnings

from ..content.views import tensor_bytes, typed_view
from ..errors import SegmentError, kept_unless_passing, out_of_descriptors_or_memory
from .base import Segment

__all__ = ["MESSAGE_MEMFD_NAME", "RECIPE_MEMFD_NAME", "SEGMENT_MEMFD_NAME", "HostSegment", "check_sealed_memfd",
           "future_write_seal_failure", "map_read_only", "protect_read_only", "seal", "seal_future_writes",
           "seal_where_it_lies", "sealed_memfd", "seals_future_writes", "writable_memfd", "write_all"]

HUGE_PAGE_BYTES = 2 << 20  # a PMD-mapped page on x86-64: Note [huge pages for segments]

# The memfd names (shown as ``/memfd:NAME`` in /proc/PID/fd): distinct, so a process's segments
# and recipes can be told apart when counting what is left behind.
SEGMENT_MEMFD_NAME = "vllm-dedup"
RECIPE_MEMFD_NAME = "vllm-dedup-recipe"
MESSAGE_MEMFD_NAME = "vllm-dedup-message"  # a registry message too large for a datagram

F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1, <linux/fcntl.h>; Python 3.11's fcntl does not name it
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_FUTURE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
_WRITE_SEALS = fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE  # either keeps every receiver from writing
_SEAL_NAMES = [(_WRITE_SEALS, "F_SEAL_WRITE (or F_SEAL_FUTURE_WRITE)"), (fcntl.F_SEAL_SHRINK, "F_SEAL_SHRINK"),
               (fcntl.F_SEAL_GROW, "F_SEAL_GROW"), (fcntl.F_SEAL_SEAL, "F_SEAL_SEAL")]
_KINDS = [(stat.S_ISFIFO, "a pipe"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")]


def sealed_memfd(parts, nbytes: int, name: str = SEGMENT_MEMFD_NAME) -> int:
    """A new memfd of ``nbytes`` bytes holding each ``(buffer, offset)`` of ``parts``, then
    sealed read-only (``F_SEAL_WRITE|SHRINK|GROW|SEAL``).  The caller owns the descriptor.

    Raises:
        OSError: memfd_create, write or sealing failed (e.g. out of memory or descriptors).
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, max(nbytes, 1))  # mmap of length 0 is an error: an empty segment maps 1 byte
        for view, offset in parts:
            write_all(fd, view, offset)
        seal(fd)
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_all(fd: int, data, offset: int) -> None:
    """Write every byte of ``data`` (a buffer) at ``offset`` of ``fd`` (``pwrite`` until done).

    Raises:
        OSError: the write failed (e.g. out of memory).
    """
    view, done = memoryview(data).cast("B"), 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def map_read_only(fd: int, nbytes: int) -> mmap.mmap:
    """A read-only mapping of ``nbytes`` of the sealed memfd ``fd``, its page tables filled
    (``MAP_POPULATE``): ``MAP_SHARED``, or ``MAP_PRIVATE`` where the kernel refuses a shared
    mapping of a memfd sealed with ``F_SEAL_WRITE`` (Note [a read-only mapping of a
    write-sealed memfd]).

    Raises:
        OSError: the kernel refused both (or refused for another reason than that seal).
        ValueError: the memfd is shorter than ``nbytes``.
    """
    try:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)
    except PermissionError as e:
        if e.errno != errno.EPERM or not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE:
            raise
    return mmap.mmap(fd, nbytes, mmap.MAP_PRIVATE | mmap.MAP_POPULATE, mmap.PROT_READ)


def seal(fd: int) -> None:
    """Seal the memfd ``fd`` read-only for everyone (``F_SEAL_WRITE|SHRINK|GROW|SEAL``).

    Raises:
        OSError: the memfd was not made with ``MFD_ALLOW_SEALING``, or a writable mapping of it exists.
    """
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)


def writable_memfd(nbytes: int, name: str = SEGMENT_MEMFD_NAME, huge: bool = False) -> tuple[int, mmap.mmap]:
    """A new memfd of ``nbytes`` bytes (sealable, zeros) and a writable shared mapping of it:
    ``(descriptor, mapping)``, both the caller's.  With ``huge``, a mapping of 2 MiB or more
    asks for huge pages (Note [huge pages for segments]).

    Raises:
        OSError: memfd_create, ftruncate or mmap failed (out of memory or descriptors).
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        mapping = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    if huge and nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)  # Note [huge pages for segments]
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as before
            pass
    return fd, mapping


def seals_future_writes() -> bool:
    """Whether this kernel seals a memfd with ``F_SEAL_FUTURE_WRITE`` while a writable mapping
    of it, made read-only, stays (Linux 5.1): tried on a page of a memfd of its own, once,
    unless the try failed for want of descriptors or memory (then again next time; the reason
    is `future_write_seal_failure`)."""
    return future_write_seal_failure() is None


def future_write_seal_failure() -> str | None:
    """Why `seals_future_writes` is false (the try's error, one line), or None where it is true."""
    return _future_write_seal()[0]


@kept_unless_passing(lambda answer: answer[1])
def _future_write_seal() -> tuple[str | None, bool]:
    """The try: ``(None, False)`` where it sealed; else ``(reason, the failure may pass)``."""
    try:
        fd, page = writable_memfd(mmap.PAGESIZE)
    except OSError as e:
        return f"a memfd for the try could not be made: {e}", out_of_descriptors_or_memory(e)
    try:
        seal_where_it_lies(fd, page, mmap.PAGESIZE)
        return None, False
    except OSError as e:
        if e.errno == errno.EINVAL:
            return "this kernel does not know F_SEAL_FUTURE_WRITE (Linux 5.1)", False
        return f"sealing a memfd that stays mapped failed: {e}", out_of_descriptors_or_memory(e)
    finally:
        page.close()
        os.close(fd)


def _address(mapping: mmap.mmap) -> int:
    """The address of a writable mapping's first byte (the buffer export is let go at once)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


def seal_where_it_lies(fd: int, mapping: mmap.mmap, nbytes: int) -> None:
    """Seal the memfd ``fd`` against every new writer (`seal_future_writes`) and make this
    process's writable ``mapping`` of it read-only over ``nbytes`` (`protect_read_only`): the
    pages stay where they are (Linux 5.1).

    The seal comes first: where it fails nothing has changed, and the caller's tensors over
    ``mapping`` stay writable (made read-only first, a tensor kept private after a failed seal
    would fault on its first write).  The seal leaves existing writable mappings alone, so the
    mprotect that follows still may; where it fails the memfd is sealed but this process can
    still write it, and the caller must not publish it.

    Raises:
        OSError: sealing failed (nothing changed) or mprotect failed (the mapping stays
            writable); either way the caller still owns ``fd`` and must keep it private.
    """
    seal_future_writes(fd)
    protect_read_only(_address(mapping), nbytes)


def seal_future_writes(fd: int) -> None:
    """Seal the memfd ``fd`` against every write but through the writable mappings that exist
    already (``F_SEAL_FUTURE_WRITE|SHRINK|GROW|SEAL``, Linux 5.1): no process can map it
    writable or ``write`` it from now on (memfd_create(2)).  The caller makes its own writable
    mapping read-only (`protect_read_only`).

    Raises:
        OSError: EINVAL where the kernel does not know the seal; as `seal` otherwise.
    """
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _FUTURE_SEALS)


def protect_read_only(address: int, nbytes: int) -> None:
    """Make the pages of ``[address, address + nbytes)`` of this process read-only
    (``mprotect(PROT_READ)``; ``address`` page-aligned, as a mapping's first byte is): a write
    through them faults from now on.  The page tables stay: nothing is mapped again.

    Raises:
        OSError: mprotect failed (the range is not mapped, or not page-aligned).
    """
    if _mprotect()(address, nbytes, mmap.PROT_READ) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mprotect(PROT_READ) of {nbytes} bytes at {address:#x}: {os.strerror(err)}")


@functools.cache
def _mprotect():
    mprotect = ctypes.CDLL(None, use_errno=True).mprotect  # the C library this process runs on
    mprotect.argtypes, mprotect.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return mprotect


def check_sealed_memfd(fd: int, nbytes: int) -> None:
    """Check that ``fd`` is a memfd sealed read-only holding at least ``nbytes`` bytes: what a
    peer may hand over as a host segment, since nobody can change its bytes after the check
    (``F_SEAL_FUTURE_WRITE`` in place of ``F_SEAL_WRITE``: nobody but its creator, whose own
    mapping is read-only; module docstring).  The descriptor stays open either way.

    Raises:
        SegmentError: it is not (the message says what it is instead, or what is missing).
    """
    try:
        info = os.fstat(fd)
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as e:
        raise SegmentError(f"the descriptor cannot be inspected ({e})") from None
    if not target.startswith("/memfd:"):
        kind = next((what for test, what in _KINDS if test(info.st_mode)), target)
        raise SegmentError(f"the descriptor is {kind}, not a memfd")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        missing = [name for flag, name in _SEAL_NAMES if not seals & flag]
        if not missing:
            info = os.fstat(fd)  # its size again, now that it cannot shrink: it could before the seals
    except OSError as e:  # a SegmentError, so that `attach` closes the descriptor
        raise SegmentError(f"the memfd's seals or size cannot be read ({e})") from None
    if missing:
        raise SegmentError(f"the memfd is not sealed read-only (missing {', '.join(missing)})")
    if info.st_size < nbytes:
        raise SegmentError(f"the memfd holds {info.st_size} bytes, fewer than the {nbytes} expected")


class HostSegment(Segment):
    """A sealed memfd and one read-only mapping of it in this process.

    Args:
        fd: the memfd (the segment owns it until `close_fd`).
        nbytes: its usable bytes.
        mapping: a mapping of ``fd`` this process has already, read-only by now (a segment
            sealed where it was loaded, `engine.in_place`); default: a new read-only one.

    Raises:
        SegmentError: ``fd`` cannot be mapped (the descriptor is closed then).
    """

    _writable = False  # made by `allocate` and not frozen yet

    def __init__(self, fd: int, nbytes: int, device: str = "cpu", mapping: mmap.mmap | None = None):
        self._fd = fd
        self.nbytes = self.size = nbytes  # pages are not counted as padding
        self.device = device
        if mapping is not None:
            self._map = mapping
            return
        # MAP_POPULATE fills the page tables now: no page faults in the first forward passes,
        # and the pages show in this process's PSS like a private copy's would.  Python's mmap
        # holds the GIL meanwhile.  Filling them instead in a thread beside a replay's build
        # (madvise(MADV_POPULATE_READ) through ctypes, the GIL released) gained 0.015-0.035 s
        # of a 1.2B second engine's 0.4-1.0 s, medians of six side by side: the thread waits
        # for the GIL between segments while the build runs Python.  Not worth a thread.  An
        # empty tensor still needs a (1-byte) mapping: mmap of length 0 is an error.
        try:
            self._map = map_read_only(fd, max(nbytes, 1))
        except (OSError, ValueError) as e:  # ValueError: the memfd is shorter than that (an empty one)
            self.close_fd()
            raise SegmentError(f"cannot map a {nbytes}-byte memfd segment: {e}") from None

    @classmethod
    def sealed_where_it_lies(cls, fd: int, nbytes: int, mapping: mmap.mmap, device: str = "cpu") -> HostSegment:
        """Seal the memfd ``fd`` through the writable ``mapping`` of it this process wrote: the
        mapping is made read-only (`protect_read_only`), the memfd sealed against every new
        writer (`seal_future_writes`), and the segment reads through that same mapping, so no
        page is mapped again (module docstring).  Where `seals_future_writes` is false, use
        `seal` with the writable mapping closed instead.

        Raises:
            OSError: sealing or mprotect failed (`seal_where_it_lies`): the mapping stays
                writable, and the caller still owns ``fd``.
        """
        seal_where_it_lies(fd, mapping, nbytes)
        return cls(fd, nbytes, device, mapping=mapping)

    @classmethod
    def allocate(cls, nbytes: int, device: str = "cpu") -> HostSegment:
        """A writable memfd segment (`Segment.allocate`), frozen where it lies by `freeze`.

        Raises:
            SegmentError: a memfd that stays mapped cannot be sealed here (before Linux 5.1, or
                out of descriptors: `seals_future_writes`; the message says which), or
                memfd_create, ftruncate or mmap failed.
        """
        if (failure := future_write_seal_failure()) is not None:
            raise SegmentError(f"cannot make a writable segment to seal where it lies: {failure}")
        try:
            fd, mapping = writable_memfd(nbytes)
        except OSError as e:
            raise SegmentError(f"cannot make a {nbytes}-byte writable memfd segment: {e}") from None
        seg = cls(fd, nbytes, device, mapping=mapping)
        seg._writable = True
        return seg

    @property
    def read_only(self) -> bool:
        return not self._writable

    def member(self, offset: int, nbytes: int):
        import torch

        self._check_member(offset, nbytes)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)

    def freeze(self) -> None:
        """`Segment.freeze`: the writable mapping is made read-only where it is and the memfd
        sealed against every new writer (`sealed_where_it_lies`); a no-op once done."""
        if not self._writable:
            return
        try:
            seal_where_it_lies(self._fd, self._map, max(self.nbytes, 1))
        except OSError as e:
            raise SegmentError(f"cannot seal a {self.nbytes}-byte memfd segment where it lies: {e}") from None
        self._writable = False

    @classmethod
    def create_packed(cls, parts, nbytes: int, device: str = "cpu", name: str = SEGMENT_MEMFD_NAME) -> HostSegment:
        """Copy each ``(tensor, offset)`` of ``parts`` (contiguous CPU tensors) into a new sealed
        memfd of ``nbytes`` bytes.

        Raises:
            ValueError: a part does not fit in ``nbytes``.
            SegmentError: memfd_create, write, sealing or mapping failed (out of memory, a file
                size limit, too many open descriptors); the message says which.
        """
        views = [(tensor_bytes(t), offset) for t, offset in parts]
        for view, offset in views:
            if offset < 0 or offset + view.nbytes > nbytes:
                raise ValueError(f"a {view.nbytes}-byte part at offset {offset} does not fit in {nbytes} bytes")
        return cls._sealed(views, nbytes, device, name)

    @classmethod
    def from_bytes(cls, data: bytes, name: str = RECIPE_MEMFD_NAME) -> HostSegment:
        """A new sealed memfd holding ``data`` (e.g. a recipe's JSON).

        Raises:
            SegmentError: as `create_packed`.
        """
        return cls._sealed([(data, 0)], len(data), "cpu", name)

    @classmethod
    def _sealed(cls, parts, nbytes: int, device: str, name: str) -> HostSegment:
        try:
            fd = sealed_memfd(parts, nbytes, name)
        except OSError as e:
            raise SegmentError(f"cannot create a {nbytes}-byte memfd segment: {e}") from None
        return cls(fd, nbytes, device)  # closes the descriptor if it cannot be mapped

    def view(self) -> memoryview:
        """The segment's ``nbytes`` bytes, zero-copy and read-only (a frozen segment's mapping
        was writable once: the view says read-only all the same)."""
        return memoryview(self._map)[: self.nbytes].toreadonly()

    def read(self) -> bytes:
        """A copy of the segment's ``nbytes`` bytes."""
        return bytes(self.view())

    @classmethod
    def device_key(cls, device="cpu") -> str:
        return "cpu"

    @classmethod
    def granularity(cls, device="cpu") -> None:
        return None  # one memfd per tensor wastes less than a page: nothing to pack

    @classmethod
    def content_keys(cls, tensors) -> list:
        """XXH3-128 of each tensor's bytes, read in place, hashed in parallel (`content.keys`)."""
        from ..content.keys import content_keys, tensor_key

        return content_keys([lambda t=t: tensor_key(t) for t in tensors])

    @classmethod
    def private_bytes(cls) -> int:
        """``RssAnon`` of ``/proc/self/status`` in bytes: anonymous private memory (a memfd's
        pages are shared memory, not counted)."""
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    @classmethod
    def attach(cls, fd: int, nbytes: int, device: str = "cpu") -> HostSegment:
        """Map a received memfd read-only.

        Raises:
            SegmentError: the descriptor is not a fully sealed memfd of at least ``nbytes``
                (a peer could otherwise change the bytes under us after the compare), or it
                cannot be mapped.  The descriptor is closed.
        """
        try:
            check_sealed_memfd(fd, nbytes)
        except SegmentError:
            os.close(fd)
            raise
        return cls(fd, nbytes, device)

    def tensor(self, offset: int, dtype, shape, stride):
        import torch

        with warnings.catch_warnings():
            # torch warns that the buffer is read-only: that is the point.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(self._map, dtype=torch.uint8)
        return typed_view(raw[: self.nbytes], offset, dtype, shape, stride)
