"""`engine.heap`: glibc's heap while post-processing (Note [large blocks from the heap])."""

from __future__ import annotations

import ctypes
import resource
from pathlib import Path

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


SECOND_BLOCK_AFTER_THE_HEAP = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_heap import faults_of_second_block
from vllm_dedup.engine import heap
with heap.reused_heap(large_blocks=True):
    pass
print(faults_of_second_block(int(sys.argv[1])))
"""


def faults_after_the_heap(env: dict, nbytes: int) -> int:
    """`faults_of_second_block` (``nbytes``) in a child that left `reused_heap` first, with
    ``env`` (glibc reads its settings at start-up)."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SECOND_BLOCK_AFTER_THE_HEAP, str(nbytes)], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(heap._glibc() is None, reason="glibc's heap only")
@pytest.mark.parametrize("settings", [
    {"MALLOC_MMAP_THRESHOLD_": "262144", "MALLOC_TRIM_THRESHOLD_": "0x4000000"},
    {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=262144:glibc.malloc.trim_threshold=67108864"},
])
def test_leaving_the_reused_heap_keeps_the_users_own_thresholds(settings):
    """A user's 256 KiB mmap threshold holds after `reused_heap`: a 1 MiB block is a fresh
    mapping each time, as the user asked (the 32 MiB `reused_heap` uses, or ends with where the
    user set nothing, would serve it from the heap), while a 128 KiB one comes from the heap."""
    pages = (1 << 20) // heap.PAGE_BYTES
    assert faults_after_the_heap(settings, 1 << 20) > pages // 2
    assert faults_after_the_heap(settings, 128 << 10) < 32 // 8


@pytest.mark.skipif(heap._glibc() is None, reason="glibc's heap only")
def test_a_user_who_turned_the_dynamic_threshold_off_keeps_glibcs_starting_thresholds():
    """``MALLOC_TOP_PAD_`` alone turns glibc's dynamic threshold off at start-up (malloc.c's
    do_set_top_pad): such a process keeps 128 KiB, and so it does after `reused_heap`."""
    pages = (16 << 20) // heap.PAGE_BYTES
    assert faults_after_the_heap({"MALLOC_TOP_PAD_": "0"}, 16 << 20) > pages // 2


@pytest.mark.skipif(heap._glibc() is None, reason="glibc's heap only")
def test_leaving_the_reused_heap_serves_a_forward_passs_temporaries_from_the_heap():
    """With no setting of the user's, the thresholds end where glibc's dynamic rule takes a
    plain process that freed large blocks (Note [glibc's thresholds]): a freed 16 MiB block
    serves the next one from the heap.  glibc's starting 128 KiB, pinned for good once
    ``mallopt`` was called, would map and unmap each (4096 pages each), in every forward pass.
    A block over 32 MiB is mapped, as in any glibc process."""
    pages = (16 << 20) // heap.PAGE_BYTES
    assert faults_after_the_heap({}, 16 << 20) < pages // 8
    assert faults_after_the_heap({}, 64 << 20) > (64 << 20) // heap.PAGE_BYTES // 2


def test_the_settings_that_turn_the_dynamic_threshold_off_are_known(monkeypatch):
    for name in ("GLIBC_TUNABLES", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                 "MALLOC_MMAP_MAX_", "MALLOC_ARENA_MAX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # leaves the threshold dynamic
    assert heap.dynamic_threshold_at_start()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.top_pad=0")
    assert not heap.dynamic_threshold_at_start()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "100")
    assert not heap.dynamic_threshold_at_start()


def test_a_users_setting_is_read_as_glibc_reads_it(monkeypatch):
    for name in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_"):
        monkeypatch.delenv(name, raising=False)
    assert heap.starting_value(heap._M_MMAP_THRESHOLD, 7) == 7
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "0x100000")
    assert heap.starting_value(heap._M_MMAP_THRESHOLD, 7) == 1 << 20
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=5:glibc.malloc.mmap_threshold=262144")
    assert heap.starting_value(heap._M_MMAP_THRESHOLD, 7) == 262144  # the tunable before the variable
    assert heap.starting_value(heap._M_TRIM_THRESHOLD, 7) == 5
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "lots")
    assert heap.starting_value(heap._M_MMAP_MAX, 9) == 9  # not a number: glibc's own
    monkeypatch.setenv("MALLOC_MMAP_MAX_", str(1 << 40))
    assert heap.starting_value(heap._M_MMAP_MAX, 9) == 9  # over mallopt's int
