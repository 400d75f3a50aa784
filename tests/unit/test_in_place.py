"""Publish in place (`vllm_dedup.engine.in_place`): tensors loaded into writable memfds of the
engine's own, sealed and published where they lie.  Real memfds, a real registry daemon, real
page tables (``/proc/self/pagemap``); the model is a small ``nn.Module`` standing in for vLLM's."""

from __future__ import annotations

import ctypes
import errno
import faulthandler
import fcntl
import gc
import mmap
import os
import signal
import time

import pytest
import torch
from torch import nn

from vllm_dedup.config import DedupConfig
from vllm_dedup.engine import in_place as in_place_module
from vllm_dedup.engine import share as share_module
from vllm_dedup.engine.context import LoadContext
from vllm_dedup.engine.in_place import InPlace
from vllm_dedup.engine.proc_maps import AnonymousRanges, present_runs
from vllm_dedup.engine.share import share_model
from vllm_dedup.registry.client import RegistryClient, registry_stats
from vllm_dedup.engine.slots import collect_slots
from vllm_dedup.errors import RegistryUnavailable
from vllm_dedup.registry.lease import Lease
from vllm_dedup.segments.host import F_SEAL_FUTURE_WRITE, check_sealed_memfd

MB = 1 << 20


class _Model(nn.Module):
    """Two linear weights (one tied into a second module), a buffer computed at construction, and
    a norm too small to move."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(512, 1024, bias=False)
        self.down = nn.Linear(1024, 512, bias=False)
        self.head = nn.Linear(512, 1024, bias=False)
        self.head.weight = self.up.weight  # tied: one storage, two places
        self.register_buffer("cache", torch.arange(1 << 16, dtype=torch.float32))  # bytes before loading
        self.norm = nn.Parameter(torch.ones(16))
        for p in self.parameters():
            p.requires_grad_(False)

    def load(self, seed: int) -> dict[str, torch.Tensor]:
        """Write weights the way vLLM's weight loaders do (``param.data.copy_``); returns them."""
        g = torch.Generator().manual_seed(seed)
        weights = {"up": torch.randn(1024, 512, generator=g), "down": torch.randn(512, 1024, generator=g)}
        self.up.weight.data.copy_(weights["up"])
        self.down.weight.data.copy_(weights["down"])
        return weights


def _mapping(t: torch.Tensor) -> str:
    """The ``/proc/self/maps`` line of the mapping ``t``'s first byte lies in."""
    address = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line
    return ""


def _memfd(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are in a mapping of one of this process's memfds."""
    return "/memfd:vllm-dedup" in _mapping(t)


def _memfd_descriptors() -> int:
    """How many of this process's descriptors are segment memfds."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:vllm-dedup")
        except OSError:
            continue  # the listing's own descriptor, closed by now
    return n


def _placed_and_loaded(model, seed: int) -> tuple[InPlace, dict[str, torch.Tensor]]:
    """``model``'s storages moved into memfds of their own (`InPlace`), then its weights loaded
    from ``seed``: (the `InPlace`, what each weight holds)."""
    placed = InPlace(min_bytes=4096)
    placed.place(model)
    return placed, model.load(seed)


def _read_only(model) -> list[torch.Tensor]:
    """Those of ``model``'s tensors that read a read-only mapping now."""
    return [t for t in (model.up.weight, model.down.weight, model.cache) if _mapping(t).split()[1][:2] == "r-"]


def _context(sock, name: str, on_registry_error: str = "fail") -> LoadContext:
    lease = Lease(RegistryClient(sock), name, "cpu", "default", "in-place-test")
    return LoadContext(DedupConfig(min_tensor_bytes=4096, on_registry_error=on_registry_error), lease,
                       torch.device("cpu"), "cpu")


def test_place_moves_what_the_sharing_pass_takes_and_keeps_bytes_set_at_construction():
    model = _Model()
    cache = model.cache.clone()
    placed = InPlace(min_bytes=4096)
    placed.place(model)
    assert _memfd(model.up.weight) and _memfd(model.down.weight) and _memfd(model.cache)
    assert not _memfd(model.norm)  # 64 bytes: private, as the sharing pass leaves it
    assert model.head.weight is model.up.weight  # the tie holds: one parameter, rebound once
    assert torch.equal(model.cache, cache)  # written before loading: copied
    assert placed.placed_bytes == 2 * 1024 * 512 * 4 + (1 << 16) * 4
    weights = model.load(0)
    assert torch.equal(model.up.weight, weights["up"]) and torch.equal(model.down.weight, weights["down"])
    placed.release()


def test_a_replay_places_only_its_loaded_modules_and_a_declined_one_is_discarded():
    """`replay.Replay` places the modules it loads from the checkpoint; the others are mapped.
    A tensor with a place outside them (``up``, tied into ``head``) stays where it is."""
    model = _Model()
    placed = InPlace(min_bytes=4096)
    placed.place(model, [model.down, model.up])
    assert _memfd(model.down.weight) and not _memfd(model.up.weight) and not _memfd(model.cache)
    assert placed.placed_bytes == 1024 * 512 * 4
    weights = model.load(4)
    placed.discard()  # the replay declined: the usual load that follows starts afresh
    assert placed.placed_bytes == 0 and placed.held_bytes == 0
    assert torch.equal(model.down.weight, weights["down"])  # the model given up still reads its bytes
    placed.place(model, [model.up, model.head])
    assert _memfd(model.up.weight) and model.head.weight is model.up.weight
    assert torch.equal(model.up.weight, weights["up"])  # bytes written before placing are copied
    placed.release()


def test_only_written_pages_are_copied_and_the_rest_reads_zeros():
    import mmap
    import warnings

    pages = mmap.mmap(-1, 16 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # fresh: nothing written
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(pages, dtype=torch.uint8)
    t[5 * 4096 + 7] = 3
    t[-1] = 9
    runs = present_runs(t.data_ptr(), t.numel())
    assert runs is not None and sum(hi - lo for lo, hi in runs) < 16 * 4096  # a few pages, not 16 MiB
    dst = torch.zeros_like(t)
    in_place_module._copy_written(t, dst, AnonymousRanges())
    assert torch.equal(dst, t)  # unwritten pages of t read zeros too


def test_a_pagemap_that_does_not_tell_present_pages_is_not_believed(monkeypatch):
    """A kernel (or sandbox) whose pagemap reads zeros for every page would have the written
    pages skipped as zeros: a wrong weight.  A probe finds it out, and every byte is copied."""
    import mmap
    import warnings

    from vllm_dedup.engine import proc_maps

    pages = mmap.mmap(-1, 4 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(pages, dtype=torch.uint8)
    t[3 * 4096 + 1] = 5
    monkeypatch.setattr(proc_maps, "_pagemap", lambda first, count: bytes(8 * count))  # "nothing present"
    proc_maps._pagemap_tells.cache_clear()
    try:
        assert present_runs(t.data_ptr(), t.numel()) is None
        dst = torch.zeros_like(t)
        in_place_module._copy_written(t, dst, AnonymousRanges())
        assert torch.equal(dst, t) and int(dst[3 * 4096 + 1]) == 5
    finally:
        monkeypatch.undo()
        proc_maps._pagemap_tells.cache_clear()
    assert present_runs(t.data_ptr(), t.numel()) is not None  # this kernel's pagemap tells


def test_a_witness_reads_no_page_of_a_segment_that_holds_no_data():
    """Before loading, a placed memfd nothing was copied into holds no data: the write witness
    says what reading its zeros would, without reading (which would allocate its pages)."""
    import warnings

    from vllm_dedup.engine.sources import write_witness

    fresh = mmap.mmap(-1, 4 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as torch.empty's pages
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        weight = torch.frombuffer(fresh, dtype=torch.float32).view(1024, 1024)
    module = nn.Module()
    module.weight = nn.Parameter(weight, requires_grad=False)
    module.register_buffer("cache", torch.ones(1 << 16))  # written at construction: copied
    del weight
    placed = InPlace(min_bytes=4096)
    placed.place(module)
    address = module.weight.data_ptr()
    assert _memfd(module.weight) and _memfd(module.cache)
    assert placed.holds_no_data(address, 4 * MB) and not placed.holds_no_data(module.cache.data_ptr())
    assert not placed.holds_no_data(address + 4096)  # not the first byte of a segment
    assert not placed.holds_no_data(address, 4 * MB + 1)  # a range past the segment's end
    ranges = AnonymousRanges(placed.holds_no_data)
    assert ranges.written_runs(address, 4 * MB) == [] and ranges.written_runs(module.cache.data_ptr(), 4) is None
    witness = write_witness(module.weight, unwritten=ranges)
    assert placed.holds_no_data(address)  # nothing was read
    assert witness == write_witness(module.weight)  # what reading the zeros says
    assert not placed.holds_no_data(address)  # which allocated pages: data now
    placed.release()


def test_a_storage_held_outside_the_models_places_is_not_moved():
    model = _Model()
    model.kept = model.down.weight.data  # another tensor object over the same bytes, in an attribute
    elsewhere = {"cache": model.cache.view(-1)}  # ... and in a dict nobody walks
    placed = InPlace(min_bytes=4096)
    placed.place(model)
    assert _memfd(model.up.weight) and not _memfd(model.down.weight) and not _memfd(model.cache)
    assert len(placed.failures) == 2 and "holds its storage" in placed.failures[0]
    weights = model.load(3)
    assert torch.equal(model.kept, weights["down"])  # the loader wrote where the other tensor reads
    assert elsewhere["cache"].data_ptr() == model.cache.data_ptr()
    placed.release()


def test_a_replaced_tensor_frees_its_memfd_at_once():
    model = _Model()
    placed = InPlace(min_bytes=4096)
    placed.place(model)
    fds = _memfd_descriptors()
    held = placed.held_bytes
    model.down.weight = nn.Parameter(torch.zeros(512, 1024), requires_grad=False)  # as post-processing replaces one
    gc.collect()
    assert _memfd_descriptors() < fds  # its descriptor closed with its mapping: the pages are gone
    assert placed.held_bytes == held - 1024 * 512 * 4
    placed.release()


# Both ways of sealing where it lies: the writable mapping kept and made read-only
# (F_SEAL_FUTURE_WRITE, this kernel's), and the bridge (F_SEAL_WRITE, before Linux 5.1).
SEALING = pytest.mark.parametrize("where_it_lies", [True, False], ids=["future-write", "bridge"])


@SEALING
def test_the_sharing_pass_seals_in_place_and_a_second_engine_maps_it(registry_server, where_it_lies):
    first, second = _Model(), _Model()
    a, b = _context(registry_server.path, "first"), _context(registry_server.path, "second")
    try:
        placed = InPlace(min_bytes=4096)
        placed.seals_where_it_lies = where_it_lies
        placed.place(first)
        first.load(0)
        report = share_model(first, a, in_place=placed)
        assert (report.published_tensors, report.created_bytes) == (3, 0), placed.failures  # up (tied), down, cache: no copy
        assert placed.sealed_bytes == placed.placed_bytes
        for t in (first.up.weight, first.down.weight, first.cache):
            perms = _mapping(t).split()[1]
            assert "/memfd:vllm-dedup" in _mapping(t) and perms[:2] == "r-", _mapping(t)  # a write faults
        assert first.head.weight is first.up.weight
        (group,) = registry_stats(registry_server.path).groups
        assert group.resident_bytes == placed.placed_bytes
        placed.release()

        # A second model loaded privately with the same bytes maps the first's segments: they
        # pass the receiver's check that a memfd is sealed read-only (`host.check_sealed_memfd`).
        want = second.load(0)
        report = share_model(second, b)
        assert report.shared_tensors == 3 and report.published_tensors == 0
        assert torch.equal(second.down.weight, want["down"]) and torch.equal(second.up.weight, want["up"])
        assert torch.equal(first.down.weight, want["down"]) and torch.equal(first.cache, second.cache)
    finally:
        a.lease.close()
        b.lease.close()


@SEALING
def test_a_storage_something_else_still_views_is_published_by_a_copy(registry_server, where_it_lies):
    model = _Model()
    ctx = _context(registry_server.path, "viewer")
    try:
        placed = InPlace(min_bytes=4096)
        placed.seals_where_it_lies = where_it_lies
        placed.place(model)
        model.load(1)
        viewer = model.down.weight.data.view(-1)  # outside the model: the writable mapping stays
        report = share_model(model, ctx, in_place=placed)
        assert report.published_tensors == 3 and report.created_bytes == 512 * 1024 * 4  # down: copied
        assert "cannot be sealed" in placed.failures[0]
        assert _mapping(model.down.weight).split()[1][:2] == "r-"
        assert torch.equal(viewer, model.down.weight.view(-1))
    finally:
        ctx.lease.close()


@pytest.mark.parametrize("error", [RegistryUnavailable("the registry failed for the test"),
                                   OSError(errno.EMFILE, "Too many open files (failed for the test)")])
def test_a_registry_failing_mid_publish_leaves_the_rest_private_and_reading_their_bytes(registry_server, error):
    """Note [one publish in flight] in `share.py`: a publish fails while the next segment is
    sealed; the segments sealed but not published stay this engine's, and nothing is lost.  An
    error other than the registry's (no descriptor left for ``Lease.publish``'s ``dup``) is
    handled alike: the engine goes on."""
    model = _Model()
    ctx = _context(registry_server.path, f"mid-publish-{type(error).__name__}", on_registry_error="fallback")
    lease = ctx.lease
    calls, publish = [], lease.publish

    def failing_after_one(*args, **kwargs):
        calls.append(args[1])
        if len(calls) > 1:
            raise error
        return publish(*args, **kwargs)

    lease.publish = failing_after_one
    try:
        placed, weights = _placed_and_loaded(model, 3)
        cache = model.cache.clone()
        report = share_model(model, ctx, in_place=placed)
        assert report.published_tensors == 1 and report.private_tensors >= 2, report
        assert any("failed for the test" in e for e in report.errors)
        assert len(calls) >= 2  # the second was sent while the first was adopted
        assert torch.equal(model.up.weight, weights["up"]) and torch.equal(model.down.weight, weights["down"])
        assert torch.equal(model.cache, cache) and model.head.weight is model.up.weight
        (group,) = registry_stats(registry_server.path).groups
        assert group.resident_bytes == calls[0]  # only the first segment was published
        # The second was sealed, so its tensor is read-only: the engine must refuse to write
        # its weights (worker_hooks) as where they are shared, instead of faulting.
        read_only = _read_only(model)
        assert len(read_only) >= 2 and report.unpublished_bytes > 0
        assert report.segment_bytes == sum(t.nbytes for t in read_only)
    finally:
        lease.close()


def test_a_segment_published_where_it_lies_whose_bytes_cannot_be_wrapped_counts_as_read_only(registry_server,
                                                                                               monkeypatch):
    """The publish succeeds, but the backend cannot wrap the segment's bytes for its source
    tensor (a driver error): the tensor stays private, yet over the sealed bytes, read-only.
    The report must count it in ``unpublished_bytes``, so that the engine refuses to write its
    weights (worker_hooks) instead of faulting."""
    from vllm_dedup.segments.host import HostSegment

    def refuse(self, *args, **kwargs):
        raise RuntimeError("cannot wrap the segment (a test)")

    model = _Model()
    ctx = _context(registry_server.path, "unwrapped", on_registry_error="fallback")
    try:
        placed, weights = _placed_and_loaded(model, 3)
        monkeypatch.setattr(HostSegment, "tensor", refuse)
        report = share_model(model, ctx, in_place=placed)
        assert report.published_tensors == 0 and report.private_tensors >= 2, report
        assert torch.equal(model.up.weight, weights["up"]) and torch.equal(model.down.weight, weights["down"])
        read_only = _read_only(model)
        assert read_only and report.unpublished_bytes == sum(t.nbytes for t in read_only), report
    finally:
        ctx.lease.close()


def test_a_handler_left_reading_bytes_nobody_owns_stops_the_load_even_under_fallback(registry_server, monkeypatch):
    """The sharing pass keeps tensors private on any failure of its own under
    ``on_registry_error="fallback"``, except a SharedWeightsError: a oneDNN handler that may read
    bytes nobody owns (`onednn.install`) has no private copy left to go on with."""
    from vllm_dedup.engine.share import SharingPass
    from vllm_dedup.errors import SharedWeightsError

    def broken(self):
        raise SharedWeightsError("oneDNN took a handle but reads another (a test)")

    monkeypatch.setattr(SharingPass, "acquire_and_adopt", broken)
    model = _Model()
    ctx = _context(registry_server.path, "handler-lost", on_registry_error="fallback")
    try:
        model.load(3)
        with pytest.raises(SharedWeightsError, match="reads another"):
            share_model(model, ctx)
    finally:
        ctx.lease.close()


def test_a_segment_sealed_where_it_lies_can_be_written_by_nobody():
    """The kernel's side of Note [sealing where it lies] (memfd_create(2), mprotect(2)): after
    `InPlace.seal`, no new writable mapping, no write(2), no receiver's mprotect to writable,
    and a write through the engine's own mapping faults."""
    model = _Model()
    placed = InPlace(min_bytes=4096)
    assert placed.seals_where_it_lies  # Linux 5.1 or later: every machine this project runs on
    placed.place(model)
    weights = model.load(2)
    slots, _, _ = collect_slots(model, "cpu", 4096)
    (slot,) = [s for s in slots if s.tensor.data_ptr() == model.down.weight.data_ptr()]
    seg = placed.seal([slot], [0])
    assert seg is not None, placed.failures
    fd = seg.fileno()
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE
        check_sealed_memfd(fd, seg.nbytes)  # what the registry and every receiver check
        assert torch.equal(model.down.weight, weights["down"]) and _mapping(model.down.weight).split()[1][:2] == "r-"
        with pytest.raises(PermissionError):
            mmap.mmap(fd, seg.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with mmap.mmap(fd, seg.nbytes, mmap.MAP_SHARED, mmap.PROT_READ) as received:
            address = torch.frombuffer(received, dtype=torch.uint8).data_ptr()
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            assert libc.mprotect(address, seg.nbytes, mmap.PROT_READ | mmap.PROT_WRITE) == -1  # EACCES
        pid = os.fork()
        if pid == 0:  # a child shares the mapping: writing through it must kill it
            faulthandler.disable()  # pytest's, inherited: the fault is expected, no traceback
            model.down.weight.data.view(-1)[0] = 1.0
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, status
        assert torch.equal(model.down.weight, weights["down"])
    finally:
        seg.close_fd()
        placed.release()


def test_near_the_descriptor_limit_the_rest_loads_into_private_memory(monkeypatch):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 1024 + 2, hard))  # room for one writable segment
    try:
        model = _Model()
        placed = InPlace(min_bytes=4096)
        placed.place(model)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert sum(_memfd(t) for t in (model.up.weight, model.down.weight, model.cache)) == 1
    assert "descriptor limit" in placed.failures[0]
    weights = model.load(2)
    assert torch.equal(model.down.weight, weights["down"])
    placed.release()


def test_the_option_is_a_boolean_and_on_by_default():
    import pytest

    assert DedupConfig().in_place is True
    assert DedupConfig.from_extra_config({"in_place": False}).in_place is False
    with pytest.raises(ValueError, match="in_place must be true or false"):
        DedupConfig.from_extra_config({"in_place": "no"})


def test_huge_pages_is_a_boolean_and_off_by_default():
    assert DedupConfig().huge_pages is False
    assert DedupConfig.from_extra_config({"huge_pages": True}).huge_pages is True
    with pytest.raises(ValueError, match="huge_pages must be true or false"):
        DedupConfig.from_extra_config({"huge_pages": "yes"})


def test_a_load_that_fails_closes_the_descriptors_of_what_it_placed(registry_server, monkeypatch):
    """`DedupModelLoader.load_model`: a load that raises (a checkpoint vLLM cannot read) lets go
    of its segments at once, though its model lives on (a traceback kept by the caller holds
    it): their descriptors close, and the pages go with the model's mappings.  Its registry
    connection is closed too (an engine retried in the same process kept one per try)."""
    from vllm.config.load import LoadConfig

    from vllm_dedup.engine.loader import DedupModelLoader

    loader = DedupModelLoader(LoadConfig(load_format="dedup"))
    lease = Lease(RegistryClient(registry_server.path), "failing", "cpu", "default", "in-place-test")

    def connected() -> bool:  # as the registry sees it
        with RegistryClient(registry_server.path) as client:
            return any(e.model == "failing" for e in client.stats().engines)

    assert lease.stats() and connected()  # said hello
    ctx = LoadContext(DedupConfig(min_tensor_bytes=4096), lease, torch.device("cpu"), "cpu", share_packed=True)
    monkeypatch.setattr(loader, "_context", lambda *args: ctx)
    kept = []

    def load(ctx, report, staging, in_place):
        model = _Model()
        in_place.place(model)
        kept.append(model)
        assert _memfd_descriptors() == before + 2 * 3  # up, down, cache: each its own and its mapping's
        raise ValueError("a checkpoint tensor of the wrong shape")

    def load_privately(*args):  # vLLM's own error fails the load without sharing too
        raise ValueError("a checkpoint tensor of the wrong shape")

    monkeypatch.setattr(loader, "_load", load)
    monkeypatch.setattr(loader, "_load_as_usual", load_privately)
    gc.collect()  # segments of earlier tests that only a collection frees
    before = _memfd_descriptors()
    from vllm.config import VllmConfig

    with pytest.raises(ValueError, match="wrong shape"):
        loader.load_model(VllmConfig(), None)
    assert _memfd(kept[0].up.weight)  # still read by the model
    assert _memfd_descriptors() == before + 3  # the mappings' own (Note [descriptors])
    deadline = time.monotonic() + 5
    while connected() and time.monotonic() < deadline:  # the registry notices the closed connection
        time.sleep(0.02)
    assert not connected()
    kept.clear()
    gc.collect()
    assert _memfd_descriptors() == before


def test_content_keys_that_cannot_be_computed_leave_every_tensor_private_unless_failures_stop_it(
        registry_server, monkeypatch):
    """Keying fails (on a GPU: the device out of memory for a fingerprint's temporaries): under
    ``fallback`` every tensor stays private and the load goes on; under ``fail`` the engine
    stops with a `SegmentError` (never the raw error, which vLLM would not explain)."""
    from vllm_dedup.errors import SegmentError
    from vllm_dedup.segments.host import HostSegment

    def out_of_memory(tensors):
        raise RuntimeError("out of memory for the fingerprints (the test's)")

    monkeypatch.setattr(HostSegment, "content_keys", classmethod(lambda cls, tensors: out_of_memory(tensors)))
    for on_error in ("fallback", "fail"):
        model = _Model()
        weights = model.load(5)
        ctx = _context(registry_server.path, f"unkeyed-{on_error}", on_registry_error=on_error)
        try:
            if on_error == "fail":
                with pytest.raises(SegmentError, match="content keys could not be computed"):
                    share_model(model, ctx)
                continue
            report = share_model(model, ctx)
            assert report.published_tensors == report.shared_tensors == 0 and report.private_tensors >= 3
            assert any("out of memory for the fingerprints" in e for e in report.errors)
            assert torch.equal(model.up.weight, weights["up"]) and torch.equal(model.down.weight, weights["down"])
        finally:
            ctx.lease.close()
    assert registry_stats(registry_server.path).groups == []


def _vm_flags(address: int) -> set[str]:
    """The ``VmFlags`` of the mapping of this process holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise LookupError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"), reason="a kernel without THP")
@pytest.mark.parametrize("nbytes, huge, advised", [(4 * MB, True, True), (MB, True, False), (4 * MB, False, False)])
def test_a_segment_of_2_mib_or_more_asks_for_huge_pages_when_told(nbytes, huge, advised):
    """Note [huge pages for segments]: with ``huge_pages`` the writable mapping is madvised
    ``MADV_HUGEPAGE`` (``hg`` in its VmFlags), whatever the machine's shmem setting makes of it."""
    import numpy as np

    from vllm_dedup.segments.host import writable_memfd

    fd, mapping = writable_memfd(nbytes, huge=huge)
    try:
        view = np.frombuffer(mapping, dtype=np.uint8)
        address = view.ctypes.data
        del view  # a live view would keep the mapping from closing
        assert ("hg" in _vm_flags(address)) == advised
    finally:
        mapping.close()
        os.close(fd)


def test_no_thread_to_publish_with_leaves_every_tensor_private_and_writable(registry_server, monkeypatch):
    """The publish thread starts before anything is sealed: where none can start (a pids limit:
    ``RuntimeError: can't start new thread``), every tensor stays private, writable, with its
    bytes, and the engine goes on."""
    from vllm_dedup.engine import share as share_module

    class NoThreads(share_module.ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(share_module, "ThreadPoolExecutor", NoThreads)
    model = _Model()
    ctx = _context(registry_server.path, "no-thread", on_registry_error="fallback")
    try:
        placed, weights = _placed_and_loaded(model, 4)
        report = share_model(model, ctx, in_place=placed)
        assert report.published_tensors == 0 and report.segment_bytes == 0, report
        assert any("can't start new thread" in e for e in report.errors), report.errors
        assert torch.equal(model.up.weight, weights["up"]) and torch.equal(model.down.weight, weights["down"])
        # none sealed: nothing read-only that the engine's weight updates would not know of
        assert all(_mapping(t).split()[1][:2] == "rw" for t in (model.up.weight, model.down.weight, model.cache))
        placed.release()
    finally:
        ctx.lease.close()


@pytest.mark.parametrize("failure", ["outside view", "seal refused", "segment refused"])
def test_a_storage_the_bridge_cannot_seal_stays_writable_when_its_copy_fails_too(registry_server, monkeypatch,
                                                                                 failure):
    """Kernels before Linux 5.1 seal under a read-only private "bridge" mapping (Note [sealing
    under a tensor]).  Where sealing fails there (a view kept outside the model, the seal
    refused, the segment refused) and the copy the sharing pass makes instead fails too, the
    tensor stays private: it must be writable then, with its bytes, or vLLM's writes to weights
    the engine counts private would fault."""
    from vllm_dedup.errors import SegmentError
    from vllm_dedup.segments.host import HostSegment

    def no_copy(*args, **kwargs):
        raise SegmentError("no memory for the copy (failed for the test)")

    monkeypatch.setattr(HostSegment, "create_packed", classmethod(no_copy))
    if failure == "seal refused":
        def refused(fd):
            raise OSError(errno.EPERM, "sealing refused for the test")
        monkeypatch.setattr(in_place_module, "seal", refused)
    elif failure == "segment refused":
        class Refused(HostSegment):
            def __init__(self, fd, nbytes, *args, **kwargs):
                os.close(fd)  # as HostSegment does when it fails
                raise SegmentError("segment refused for the test")
        monkeypatch.setattr(in_place_module, "HostSegment", Refused)
    model = _Model()
    ctx = _context(registry_server.path, f"bridge-{failure}", on_registry_error="fallback")
    try:
        placed = InPlace(min_bytes=4096)
        placed.seals_where_it_lies = False
        placed.place(model)
        weights = model.load(5)
        cache = model.cache.clone()
        viewer = model.down.weight.data.view(-1) if failure == "outside view" else None
        report = share_model(model, ctx, in_place=placed)
        assert placed.failures and any("failed for the test" in e for e in report.errors), (placed.failures, report)
        assert torch.equal(model.up.weight, weights["up"]) and torch.equal(model.down.weight, weights["down"])
        assert torch.equal(model.cache, cache)
        # The one viewed from outside fails alone; a refused seal or segment fails every one.
        assert report.published_tensors == (2 if failure == "outside view" else 0), report
        assert _mapping(model.down.weight).split()[1][:2] == "rw"
        # What is read-only is what the engine counts in segments (its writers refused there).
        read_only = _read_only(model)
        assert report.segment_bytes == sum(t.nbytes for t in read_only)
        if viewer is not None:
            assert torch.equal(viewer, model.down.weight.view(-1))
        placed.release()
    finally:
        ctx.lease.close()


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "mkldnn"])
def test_a_tensor_without_a_plain_storage_stays_private_and_the_rest_is_shared(registry_server, layout):
    """A sparse buffer, or one in oneDNN's own layout, has no plain storage (torch refuses its
    ``data_ptr``): it stays private where it is, and the model's other tensors are placed,
    sealed and published as usual."""
    model = _Model()
    dense = torch.eye(64)
    buffer = {"sparse_coo": dense.to_sparse, "sparse_csr": dense.to_sparse_csr, "mkldnn": dense.to_mkldnn}[layout]()
    model.register_buffer("mask", buffer)
    placed = InPlace(min_bytes=4096)
    placed.place(model)
    assert not placed.failures and placed.placed_bytes == 2 * 1024 * 512 * 4 + (1 << 16) * 4
    weights = model.load(6)
    ctx = _context(registry_server.path, f"{layout}")
    try:
        report = share_model(model, ctx, in_place=placed)
        assert report.published_tensors == 3 and not report.errors, report  # up (tied), down, cache
        assert model.mask is buffer and torch.equal(model.mask.to_dense(), dense)
        assert torch.equal(model.up.weight, weights["up"]) and torch.equal(model.down.weight, weights["down"])
    finally:
        placed.release()
        ctx.lease.close()


def test_a_model_whose_storages_cannot_be_walked_loads_privately_unless_failures_stop_it(registry_server, monkeypatch):
    """Should walking the model's storages fail all the same, `InPlace.place` moves nothing (it
    never raises) and the sharing pass leaves every tensor private under ``fallback``; under
    ``fail`` its error stops the load, as that option asks.  The walk's failure is injected."""
    def refuse(*args, **kwargs):
        raise RuntimeError("injected: this model's storages cannot be walked")

    model = _Model()
    monkeypatch.setattr(in_place_module, "collect_slots", refuse)
    monkeypatch.setattr(share_module, "collect_slots", refuse)
    placed = InPlace(min_bytes=4096)
    placed.place(model)
    assert placed.failures and placed.placed_bytes == 0
    weights = model.load(6)
    ctx = _context(registry_server.path, "unwalkable", on_registry_error="fallback")
    try:
        report = share_model(model, ctx, in_place=placed)
        assert report.published_tensors == 0 and report.errors, report
        assert torch.equal(model.up.weight, weights["up"]) and torch.equal(model.down.weight, weights["down"])
    finally:
        ctx.lease.close()
    ctx = _context(registry_server.path, "unwalkable-fail")
    try:
        with pytest.raises(RuntimeError, match="injected"):
            share_model(model, ctx)
    finally:
        ctx.lease.close()


def test_an_error_while_adopting_a_resident_segment_leaves_it_unheld(registry_server, monkeypatch):
    """A failure of the sharing pass itself while it swaps in a resident segment's tensors
    (injected here) leaves them private under ``fallback``, and the segment nothing maps is
    given back, not held for the engine's life."""
    first, second = _Model(), _Model()
    a, b = _context(registry_server.path, "holds-first"), _context(registry_server.path, "holds-second", "fallback")
    try:
        first.load(3)
        assert share_model(first, a).published_tensors == 3
        want = second.load(3)

        def broken(self, *args, **kwargs):
            raise RuntimeError("injected: adopting failed")

        monkeypatch.setattr(share_module.SharingPass, "adopt", broken)
        report = share_model(second, b)
        assert report.shared_tensors == 0 and report.errors, report
        held = {e.model: e.segments for e in registry_stats(registry_server.path).engines}
        assert held == {"holds-first": 3, "holds-second": 0}, held
        assert torch.equal(second.up.weight, want["up"]) and torch.equal(second.down.weight, want["down"])
    finally:
        a.lease.close()
        b.lease.close()


def test_a_pagemap_probe_that_cannot_be_made_now_is_asked_again_and_never_raises(monkeypatch):
    """Out of memory or mappings for the probe: no pagemap answer is used this time (every
    byte is copied), nothing is raised into the load, and the next call probes again."""
    import mmap

    from vllm_dedup.engine import proc_maps

    class NoMemory:
        def __init__(self, *args, **kwargs):
            raise OSError(12, "Cannot allocate memory")

    t = torch.ones(4096)
    proc_maps._pagemap_tells.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(proc_maps.mmap, "mmap", NoMemory)
            assert present_runs(t.data_ptr(), t.numel() * 4) is None
        assert proc_maps.mmap.mmap is mmap.mmap
        assert present_runs(t.data_ptr(), t.numel() * 4) is not None  # probed again, and it tells
    finally:
        proc_maps._pagemap_tells.cache_clear()
