"""Host segments where the kernel refuses a shared mapping of a write-sealed memfd, or a seal.

This machine's kernel maps such a memfd read-only and shared; older ones (Ubuntu 22.04's 5.15)
refuse every ``MAP_SHARED`` mapping of a memfd sealed with ``F_SEAL_WRITE``, read-only ones too,
with EPERM (Note [a read-only mapping of a write-sealed memfd] in ``vllm_dedup/segments/host.py``).
`_old_kernel_mmap` is a model of that rule over the real ``mmap``: it refuses where such a
kernel does, and maps for real otherwise; the memfds, seals and pages are real.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

import pytest
import torch

from test_in_place import _mapping
from vllm_dedup.segments.host import HostSegment, map_read_only, writable_memfd

MB = 1 << 20


def _old_kernel_mmap(real, refuse_every_shared: bool = False):
    """``mmap.mmap`` as a kernel before the ``VM_MAYWRITE`` check behaves (a model): EPERM for a
    shared mapping of a memfd sealed with ``F_SEAL_WRITE`` (of any file, with
    ``refuse_every_shared``)."""

    def model(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, *args, **kwargs):
        if fd >= 0 and flags & mmap.MAP_SHARED and (
                refuse_every_shared or fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE):
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real(fd, length, flags, prot, *args, **kwargs)

    return model


def _kernel_maps_write_sealed_memfds_shared() -> bool:
    """Whether this machine's kernel maps a memfd sealed with ``F_SEAL_WRITE`` read-only and
    shared (asked of the real kernel, not of the model)."""
    fd = os.memfd_create("probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ).close()
        return True
    except PermissionError:
        return False
    finally:
        os.close(fd)


def _rss_anon() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def test_a_write_sealed_segment_maps_privately_where_the_kernel_refuses_a_shared_mapping(monkeypatch):
    data = torch.arange(64 * MB // 4, dtype=torch.int32)
    monkeypatch.setattr(mmap, "mmap", _old_kernel_mmap(mmap.mmap))
    made = HostSegment.create_packed([(data, 0)], data.numel() * 4)  # copied, sealed F_SEAL_WRITE, mapped
    anon_before = _rss_anon()
    received = HostSegment.attach(os.dup(made._fd), made.nbytes)  # another engine's view of it
    try:
        for seg in (made, received):
            t = seg.tensor(0, torch.int32, tuple(data.shape), (1,))
            assert torch.equal(t, data)
            line = _mapping(t)
            assert line.split()[1] == "r--p" and "/memfd:vllm-dedup" in line, line
        # The private mapping reads the memfd's own pages: reading all of them made no copy.
        assert _rss_anon() - anon_before < 8 * MB
        with pytest.raises(TypeError):  # and it cannot be written through
            received._map[0] = 1
    finally:
        received.close_fd()
        made.close_fd()


def test_the_kernel_that_allows_it_maps_shared_and_other_refusals_are_not_hidden(monkeypatch):
    data = torch.arange(1024, dtype=torch.int64)
    seg = HostSegment.create_packed([(data, 0)], data.numel() * 8)
    try:
        line = _mapping(seg.tensor(0, torch.int64, (1024,), (1,)))
        # This machine's own kernel: shared where it allows it (Linux 6.18 here), else private.
        assert line.split()[1] == ("r--s" if _kernel_maps_write_sealed_memfds_shared() else "r--p"), line
    finally:
        seg.close_fd()

    fd, mapping = writable_memfd(MB)  # not sealed: an EPERM here is not the seal's, and is raised
    mapping.close()
    monkeypatch.setattr(mmap, "mmap", _old_kernel_mmap(mmap.mmap, refuse_every_shared=True))
    try:
        with pytest.raises(PermissionError):
            map_read_only(fd, MB)
    finally:
        os.close(fd)


def test_a_memfd_that_cannot_be_sealed_where_it_lies_stays_writable():
    """Where the seal fails (here: the memfd already carries ``F_SEAL_SEAL``, so the kernel
    refuses every new seal with EPERM), the tensors over the writable mapping stay writable:
    the engine keeps them private and may still write them.  Made read-only first, they
    would fault on their first write."""
    fd, mapping = writable_memfd(MB)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
        t = torch.frombuffer(mapping, dtype=torch.uint8)
        with pytest.raises(PermissionError):
            HostSegment.sealed_where_it_lies(fd, MB, mapping)
        assert _mapping(t).split()[1] == "rw-s", _mapping(t)
        t[:4] = 7  # a write through the mapping, as a weight loader may still make
        assert bytes(mapping[:4]) == b"\x07" * 4
        del t
    finally:
        mapping.close()
        os.close(fd)


_SEAL_OUT_OF_DESCRIPTORS = """
import os, resource
from vllm_dedup.errors import SegmentError
from vllm_dedup.segments.host import HostSegment, seals_future_writes
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(map(int, os.listdir("/proc/self/fd"))), hard))  # no descriptor left
starved = seals_future_writes()
try:
    HostSegment.allocate(4096)
    refusal = None
except SegmentError as e:
    refusal = str(e)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print(repr((starved, refusal, seals_future_writes(), HostSegment.allocate(4096).read_only)))
"""


def test_a_seal_try_that_failed_for_want_of_descriptors_is_tried_again():
    """`seals_future_writes` tries the seal on a memfd of its own.  A process out of
    descriptors (a real ``RLIMIT_NOFILE`` in a child) cannot make that memfd: the answer is no,
    and a writable segment is refused with that reason, not with the kernel blamed; with
    descriptors again, the next call tries again and this kernel's answer (Linux 5.1+) holds."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", _SEAL_OUT_OF_DESCRIPTORS], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    starved, refusal, then, read_only = eval(child.stdout.splitlines()[-1])  # noqa: S307  (our child's repr)
    assert starved is False
    assert "Too many open files" in refusal and "kernel" not in refusal, refusal
    assert then is True, "the failed try was kept"
    assert read_only is False  # a writable segment, made now


def test_an_answer_kept_unless_it_may_pass_is_asked_again_only_then():
    """`errors.kept_unless_passing`, the rule of the seal try, the oneDNN probe and vllm_packs:
    an answer is kept per arguments (given by position or by name) unless the failure behind
    it may pass."""
    import errno

    from vllm_dedup.errors import kept_unless_passing, out_of_descriptors_or_memory

    asked = []

    @kept_unless_passing(lambda answer: answer[1])
    def ask(name: str = "a", fail: bool = False):
        asked.append(name)
        error = OSError(errno.EMFILE, "Too many open files") if fail else None
        return name, out_of_descriptors_or_memory(error)

    assert ask("a") == ("a", False) and ask("a") == ("a", False) and asked == ["a"]
    assert ask(name="b") == ask(name="b") and asked == ["a", "b"]
    assert ask("c", fail=True) == ("c", True) and ask("c", fail=True) == ("c", True)
    assert asked == ["a", "b", "c", "c"]  # a passing answer is asked again (and forgets the others)
