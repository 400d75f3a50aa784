"""The process's C heap during a load (glibc): freed blocks reused while post-processing, and
given back to the kernel at the end.

vLLM's CPU post-processing frees each linear layer's plain weight right after oneDNN packed
it, and a load that stages or replaces packed weights (`staging.py`, `replay.py`) frees each
packed buffer right after.  glibc serves blocks above its mmap threshold (128 KiB, raised
dynamically up to 32 MiB) with a fresh ``mmap`` and gives them back with ``munmap``: every
layer's buffer then costs a page fault and a zeroed page per 4 KiB, paid again for the next
layer.  `reused_heap` raises the threshold and the trim threshold for the duration, so the
blocks freed by one layer serve the next (Note [glibc's thresholds]); `trim` gives the free
pages back to the kernel afterwards (``malloc_trim``), so the process ends the load no larger
than a plain load leaves it.

Note [glibc's thresholds]
    ``mallopt(M_MMAP_THRESHOLD)`` accepts at most ``HEAP_MAX_SIZE / 2`` (32 MiB on 64-bit):
    larger blocks (a vocabulary embedding's) are still mapped and unmapped, unless
    ``large_blocks`` (Note [large blocks from the heap]).  Any ``mallopt``
    of these turns glibc's dynamic threshold off for the rest of the process (glibc has no way
    to turn it back on), so `reused_heap` chooses the values the process serves with after the
    load.  Where the user set any of the settings that turn the rule off (the mmap or trim
    threshold, the top pad, the mmap count, through ``GLIBC_TUNABLES``' ``glibc.malloc.*`` or
    the older ``MALLOC_*_`` variables: glibc's manual, "Memory Allocation Tunables"), the
    rule was off from the start: the thresholds go back to the user's, or to glibc's 128 KiB.
    Otherwise to where the rule takes a plain process: each ``free`` of a mapped block of at
    most 32 MiB raises the mmap threshold to that block's size and the trim threshold to
    twice it (glibc's ``free``), and a plain load frees such blocks (the plain weights it
    packs), as do its forward passes (activations): 32 MiB and 64 MiB, the rule's ceiling.
    glibc's starting 128 KiB instead, kept for good, would make every temporary of a forward
    pass between 128 KiB and 32 MiB a fresh mapping faulted in page by page: 500 of 4 MiB took
    0.88 s that way against 0.02 s from the heap.  The price: each of glibc's arenas may keep
    up to 64 MiB of freed blocks at its top for reuse, where a plain process that never freed
    a block that large keeps less (twice the largest it did free; five threads freeing a
    30 MiB temporary each kept 150 MiB here against 30 MiB).  On a C library other than glibc
    both functions do nothing.

Note [large blocks from the heap]
    A replay's packed linear layers are larger than 32 MiB from a 1B model up (a gate and up
    projection of 2048 x 16384 bf16 is 64 MiB), so each one's packing would be a fresh
    mapping, faulted in page by page, and unmapped at once.  ``mallopt(M_MMAP_MAX, 0)`` makes
    glibc serve every block from a heap instead, so the next layer's packing reuses the
    pages: oneDNN packing a 2048 x 16384 placeholder took 32 ms with a fresh mapping and 9 ms
    from the heap (`reused_heap(large_blocks=True)`).  Only the main arena can grow past
    ``HEAP_MAX_SIZE``; where its ``brk`` cannot grow, glibc maps a block all the same
    (``sysmalloc``'s fallback), and a thread's arena that cannot serve a block hands the
    request to another.  A staged load asks for it too: it gives the pages of the one large
    buffer it must not hold twice (an embedding's) back as it copies them (`staging.py`, Note
    [moving a packed weight]), and lets every other buffer's pages serve the next layer.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

from .proc_maps import PAGE_BYTES

__all__ = ["MAPPED_BLOCK_BYTES", "PAGE_BYTES", "drop_pages", "reused_heap", "trim"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # malloc.h
_DEFAULT_MMAP_MAX = 65536  # glibc's DEFAULT_MMAP_MAX
_MAX_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
_SERVING_TRIM_THRESHOLD = 2 * _MAX_MMAP_THRESHOLD  # where glibc's dynamic rule goes: Note [glibc's thresholds]
_NO_TRIM = 2**31 - 1  # mallopt takes an int
_MADV_DONTNEED = 4  # asm-generic/mman-common.h
# Blocks this large are mapped within `reused_heap()` (not with large_blocks, where none is); staging
# moves a packed weight this large chunk by chunk (staging.py, Note [moving a packed weight]).
MAPPED_BLOCK_BYTES = _MAX_MMAP_THRESHOLD
# mallopt option -> its tunable in GLIBC_TUNABLES and the older environment variable for it
_TUNABLES = {_M_TRIM_THRESHOLD: ("glibc.malloc.trim_threshold", "MALLOC_TRIM_THRESHOLD_"),
             _M_MMAP_THRESHOLD: ("glibc.malloc.mmap_threshold", "MALLOC_MMAP_THRESHOLD_"),
             _M_MMAP_MAX: ("glibc.malloc.mmap_max", "MALLOC_MMAP_MAX_")}
_DEFAULT_THRESHOLD = 128 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MIN and DEFAULT_TRIM_THRESHOLD
# Any of these given turns glibc's dynamic threshold off at start-up (do_set_* in malloc.c).
_STATIC_SETTINGS = (*_TUNABLES.values(), ("glibc.malloc.top_pad", "MALLOC_TOP_PAD_"))


@functools.cache
def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        return libc
    except (OSError, AttributeError):  # not glibc
        return None


def drop_pages(address: int, nbytes: int) -> int:
    """Give back to the kernel the whole pages inside ``[address, address + nbytes)`` of this
    process's private anonymous memory (``madvise(MADV_DONTNEED)``): they read as zeros after.
    Only the pages wholly inside the range go, so an allocator's headers on either side stay.
    For a live buffer whose bytes were copied elsewhere and are no longer read.

    Returns:
        The bytes given back (0 where the call is not available or failed).
    """
    start = -(-address // PAGE_BYTES) * PAGE_BYTES
    end = (address + nbytes) // PAGE_BYTES * PAGE_BYTES
    libc = _glibc()
    if libc is None or end <= start:
        return 0
    return end - start if libc.madvise(start, end - start, _MADV_DONTNEED) == 0 else 0


def _given(tunable: str, variable: str) -> list[str]:
    """The user's values of one malloc setting: ``GLIBC_TUNABLES``' where given (they take
    precedence, as `starting_value` says), else the older variable's."""
    given = [value for key, _, value in (item.partition("=") for item in os.environ.get("GLIBC_TUNABLES", "").split(":"))
             if key == tunable]
    return given or ([os.environ[variable]] if variable in os.environ else [])


def dynamic_threshold_at_start() -> bool:
    """Whether glibc started this process with its dynamic mmap threshold on: the user set none
    of the settings that turn it off (Note [glibc's thresholds])."""
    return not any(_given(tunable, variable) for tunable, variable in _STATIC_SETTINGS)


def starting_value(option: int, default: int) -> int:
    """The value glibc gave the mallopt ``option`` (``_M_*``) at start-up: the user's, from
    ``GLIBC_TUNABLES`` (which recent glibc reads before the ``MALLOC_*_`` variables) or the
    older variable, else ``default``.  A value that is not a number, or does not fit
    mallopt's ``int``, counts as not given."""
    given = _given(*_TUNABLES[option])
    try:
        value = int(given[-1], 0) if given else default
    except ValueError:
        return default
    return value if 0 <= value <= _NO_TRIM else default


def _restore(libc, option: int, default: int) -> None:
    """Set ``option`` to its starting value (`starting_value`), else ``default``; ``default``
    too where glibc refuses the user's (an mmap threshold over 32 MiB, which glibc ignored at
    start-up too)."""
    if libc.mallopt(option, starting_value(option, default)) != 1:
        libc.mallopt(option, default)


def trim() -> None:
    """Give the heap's free pages back to the kernel (glibc ``malloc_trim(0)``)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def reused_heap(large_blocks: bool = False):
    """Within the block, blocks up to 32 MiB come from the heap and freed ones stay there for
    the next allocation (Note [glibc's thresholds]); with ``large_blocks``, larger ones too
    (Note [large blocks from the heap]).  On exit the thresholds are the user's where set
    (`starting_value`), else where glibc's dynamic rule takes a plain process (Note [glibc's
    thresholds]), and the free pages go back to the kernel."""
    libc = _glibc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, _NO_TRIM)
    if large_blocks:
        libc.mallopt(_M_MMAP_MAX, 0)
    try:
        yield
    finally:
        if large_blocks:
            _restore(libc, _M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        dynamic = dynamic_threshold_at_start()
        _restore(libc, _M_TRIM_THRESHOLD, _SERVING_TRIM_THRESHOLD if dynamic else _DEFAULT_THRESHOLD)
        _restore(libc, _M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD if dynamic else _DEFAULT_THRESHOLD)
        libc.malloc_trim(0)
