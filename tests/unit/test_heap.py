"""`engine.heap`: glibc's heap while post-processing (Note [large blocks from the heap])."""

from __future__ import annotations

import ctypes
import resource

import pytest

from vllm_dedup.engine import heap

MiB = 1 << 20
libc = ctypes.CDLL("libc.so.6")
libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None


def faults_of_second_block(nbytes: int) -> int:
    """Minor page faults taken writing a second ``nbytes`` block, allocated after a first one
    of the same size was written and freed."""
    first = libc.malloc(nbytes)
    ctypes.memset(first, 1, nbytes)
    libc.free(first)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    second = libc.malloc(nbytes)
    ctypes.memset(second, 2, nbytes)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    libc.free(second)
    return after - before


@pytest.mark.skipif(heap._glibc() is None, reason="glibc's heap only")
def test_a_block_over_32_mib_reuses_the_pages_freed_before_it_only_when_asked():
    pages = 64 * MiB // heap.PAGE_BYTES
    with heap.reused_heap():  # 64 MiB is over the largest mmap threshold: a fresh mapping each time
        assert faults_of_second_block(64 * MiB) > pages // 2
    with heap.reused_heap(large_blocks=True):
        faults_of_second_block(64 * MiB)  # the heap grows to hold it once
        assert faults_of_second_block(64 * MiB) < pages // 20
    assert faults_of_second_block(64 * MiB) > pages // 2  # glibc's own behaviour again
