"""`vllm_dedup.engine.staging` against real vLLM oneDNN handlers and a real registry, in one
process: a packed weight staged right after its layer's post-processing is read from a sealed
segment with bit-identical results, equal packed weights of one model share one segment (after
an exact compare: a forced key collision keeps them apart), and the sharing pass publishes a
staged segment as it is (no copy) or, where another engine's copy is resident, maps that one
and frees the staged segment."""

from __future__ import annotations

import errno
import functools
import gc
import os
import threading

import pytest
import torch
from torch import nn

from vllm_dedup.config import DedupConfig
from vllm_dedup.content.keys import ContentKey
from vllm_dedup.engine import onednn
from vllm_dedup.engine.context import LoadContext
from vllm_dedup.engine.share import share_model
from vllm_dedup.engine import staging as staging_module
from vllm_dedup.engine.heap import MAPPED_BLOCK_BYTES, reused_heap
from vllm_dedup.engine.staging import Staging
from vllm_dedup.errors import PackedWeightError, SharedWeightsError
from vllm_dedup.registry.client import RegistryClient, registry_stats
from vllm_dedup.registry.lease import Lease

from helpers import onednn_matmul_dtype, require_packed_sharing

ops = pytest.importorskip("vllm._custom_ops")
N, K = 1536, 576  # SmolLM2's MLP projection: 1.8 MB packed in bfloat16
DTYPE = onednn_matmul_dtype()  # bfloat16, or float32 where oneDNN cannot pack bfloat16 (AVX2)


@pytest.fixture(scope="module", autouse=True)
def _supported():
    require_packed_sharing(DTYPE)


def _weight(seed: int) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)).to(DTYPE)


class _Layer(nn.Module):
    """A module holding one vLLM oneDNN handler, as a linear layer does after post-processing."""

    def __init__(self, seed: int):
        super().__init__()
        self.handler = ops.create_onednn_mm(_weight(seed).t(), 32)


def _model(*seeds: int, linear: bool = False) -> nn.Module:
    """One `_Layer` per seed, or with ``linear`` one vLLM linear layer (`LinearBase`: it drops the
    weight it packs, so its packing is copied in the staging worker)."""
    layer = _linear_class() if linear else _Layer
    model = nn.Module()
    for i, seed in enumerate(seeds):
        model.add_module(f"layer{i}", layer(seed))
    return model


@functools.cache
def _linear_class() -> type:
    from vllm.model_executor.layers.linear import LinearBase

    class Linear(LinearBase):  # only the class matters here; LinearBase's own state is not used
        def __init__(self, seed: int):
            nn.Module.__init__(self)
            self.handler = ops.create_onednn_mm(_weight(seed).t(), 32)

    return Linear


def _stage(model: nn.Module, staging: Staging) -> None:
    for name, module in model.named_children():  # as vLLM post-processes them, one by one
        staging.after_post_processing(name, module)


def _outputs(model: nn.Module) -> list[torch.Tensor]:
    x = torch.randn(8, K, generator=torch.Generator().manual_seed(99)).to(DTYPE)
    return [ops.onednn_mm(layer.handler, x, None) for layer in model.children()]


def _address(layer: _Layer) -> int:
    return onednn.find_packed(layer.handler).address


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_a_staged_weight_is_read_from_its_segment_with_the_same_results():
    model = _model(1, 2)
    before = _outputs(model)
    nbytes = onednn.find_packed(model.layer0.handler).nbytes
    staging = Staging(min_bytes=1)
    _stage(model, staging)
    assert [e.owner for e in staging.staged] == [True, True]
    assert staging.created_bytes == 2 * nbytes
    for layer, entry in zip(model.children(), staging.staged):
        assert _address(layer) == entry.tensor.data_ptr()  # oneDNN's buffer is gone, the segment read
        assert onednn.find_packed(layer.handler).shared
    assert all(torch.equal(a, b) for a, b in zip(before, _outputs(model)))
    with pytest.raises(OSError):  # sealed: nobody can write the bytes the kernel reads
        os.pwrite(staging.staged[0].segment.fileno(), b"x", 0)


def test_equal_packed_weights_share_one_segment():
    model = _model(1, 1, 2)  # layer1 packs the same weight as layer0 (a tied head and its embedding)
    staging = Staging(min_bytes=1)
    _stage(model, staging)
    owners = [e.owner for e in staging.staged]
    assert owners == [True, False, True]
    assert staging.staged[1].segment is staging.staged[0].segment
    assert _address(model.layer0) == _address(model.layer1)
    nbytes = onednn.find_packed(model.layer0.handler).nbytes
    assert staging.created_bytes == 2 * nbytes


def test_a_key_collision_is_caught_by_the_compare():
    def collide(keys):
        return [ContentKey(bytes(16), k.dtype, k.shape, k.stride) for k in keys]

    model = _model(1, 2)  # other bytes, same layout: one key once digests are zeroed
    before = _outputs(model)
    staging = Staging(min_bytes=1, colliding=collide)
    _stage(model, staging)
    assert staging.staged[0].key == staging.staged[1].key
    assert [e.owner for e in staging.staged] == [True, True]  # the compare refused the twin
    assert _address(model.layer0) != _address(model.layer1)
    assert all(torch.equal(a, b) for a, b in zip(before, _outputs(model)))


def test_small_packed_weights_stay_with_onednn():
    model = _model(1)
    nbytes = onednn.find_packed(model.layer0.handler).nbytes
    staging = Staging(min_bytes=nbytes + 1)
    _stage(model, staging)
    assert staging.staged == [] and staging.created_bytes == 0
    assert not onednn.find_packed(model.layer0.handler).shared


class _Big(nn.Module):
    """A vocabulary-sized packed weight (8192 x 4096: 64 MiB in bfloat16, 128 MiB in float32),
    which the staging moves in chunks (Note [moving a packed weight])."""

    def __init__(self):
        super().__init__()
        self.weight = torch.randn(8192, 4096, generator=torch.Generator().manual_seed(5)).to(DTYPE)
        self.handler = ops.create_onednn_mm(self.weight.t(), 32)

    def outputs(self) -> torch.Tensor:
        x = torch.randn(4, 4096, generator=torch.Generator().manual_seed(6)).to(DTYPE)
        return ops.onednn_mm(self.handler, x, None)


def _held() -> int:
    """This process's private memory plus the pages written into the segment memfds it holds
    open, in bytes (per process: what other processes on the machine hold never counts).

    The memfds are read before the private memory: a chunk moved between the two reads (written
    to the memfd, then dropped from the source) is then missed rather than counted twice.  Read
    the other way round, the scan of the descriptors (milliseconds) left time for a chunk to be
    counted in the source and again in the memfd, and a sample showed two chunks held.
    """
    import os

    from vllm_dedup.segments.host import SEGMENT_MEMFD_NAME, HostSegment

    blocks = {}  # inode -> its blocks: a memfd and its dup are one file
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{SEGMENT_MEMFD_NAME}"):
                st = os.fstat(int(fd))
                blocks[(st.st_dev, st.st_ino)] = st.st_blocks
        except OSError:  # closed meanwhile
            pass
    return sum(blocks.values()) * 512 + HostSegment.private_bytes()


def test_a_large_packed_weight_is_moved_chunk_by_chunk():
    # Staging asks whether a module is a linear layer: vLLM's linear module, imported in an
    # engine long before, is imported here before the memory is sampled.
    import vllm.model_executor.layers.linear  # noqa: F401

    # glibc raises its mmap threshold each time a mapped block is freed, so what earlier tests of
    # this worker freed decides whether the copy's chunks come from the heap and stay resident:
    # leaving `reused_heap` sets glibc's starting thresholds again, and trims.
    with reused_heap():
        pass
    big = _Big()
    before = big.outputs()
    packed = onednn.find_packed(big.handler)
    assert packed.nbytes >= MAPPED_BLOCK_BYTES
    peak, base, done = 0, _held(), False

    def sample():
        nonlocal peak
        while not done:
            peak = max(peak, _held() - base)

    sampler = threading.Thread(target=sample)
    sampler.start()
    staging = Staging(min_bytes=1)
    try:
        staging.after_post_processing("embed", big)
    finally:
        done = True
        sampler.join()
    assert staging.failures == [] and staging.staged[0].owner
    assert _address(big) == staging.staged[0].tensor.data_ptr()
    assert torch.equal(big.outputs(), before)
    # memory never held the weight twice: the source gave its pages back as the memfd filled (a
    # whole copy first would add packed.nbytes here)
    assert peak < packed.nbytes // 2, (peak, packed.nbytes)


def test_a_linear_layers_large_packed_weight_is_copied_whole(monkeypatch):
    """Note [moving a packed weight]: a linear layer drops the weight it packs, so its packing is
    copied whole and its buffer keeps its pages for the next layer's (no chunked move)."""
    from vllm.model_executor.layers.linear import LinearBase

    class BigLinear(LinearBase):  # only the class matters here; LinearBase's own state is not used
        outputs = _Big.outputs

        def __init__(self):
            nn.Module.__init__(self)
            big = _Big()
            self.weight, self.handler = big.weight, big.handler

    layer = BigLinear()
    before = layer.outputs()
    assert onednn.find_packed(layer.handler).nbytes >= MAPPED_BLOCK_BYTES

    def refuse(*args):
        raise AssertionError("a linear layer's packing was moved chunk by chunk")

    monkeypatch.setattr(staging_module, "_moved", refuse)
    staging = Staging(min_bytes=1)
    staging.after_post_processing("proj", layer)
    staging.finish()  # its copy ran in the staging worker (Note [one copy in flight])
    assert staging.failures == [] and staging.staged[0].owner
    assert _address(layer) == staging.staged[0].tensor.data_ptr()
    assert torch.equal(layer.outputs(), before)
    staging.release()


def test_linear_layers_copy_one_at_a_time_beside_the_next_in_order(monkeypatch):
    """Note [one copy in flight]: linear layers' copies run in the staging worker, adopted in
    layer order; a twin finds the segment of the copy before it; a copy that fails leaves its
    handler its own bytes and is named in ``failures``."""
    model = _model(1, 2, 1, 3, linear=True)
    before = _outputs(model)
    install, calls, threads = onednn.install, [], []

    def second_fails(packed, data, compare=True):
        calls.append(compare)
        threads.append(threading.current_thread().name)
        if len(calls) == 2:
            raise PackedWeightError("refused for the test")
        return install(packed, data, compare)

    monkeypatch.setattr(onednn, "install", second_fails)
    staging = Staging(min_bytes=1)
    _stage(model, staging)
    staging.finish()
    assert [(e.module, e.owner) for e in staging.staged] == [("layer0", True), ("layer2", False), ("layer3", True)]
    assert staging.failures == ["layer1: PackedWeightError: refused for the test"]
    assert calls == [False, False, True, False]  # copies, then the twin's exact compare
    assert [t.startswith("vllm-dedup-staging") for t in threads] == [True, True, False, True]
    assert _address(model.layer2) == _address(model.layer0) == staging.staged[0].tensor.data_ptr()
    assert not onednn.find_packed(model.layer1.handler).shared
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model), before))
    assert staging.created_bytes == 2 * onednn.find_packed(model.layer0.handler).nbytes
    staging.release()


def test_without_a_worker_thread_linear_layers_are_copied_in_the_loads_own(monkeypatch):
    """Where the worker's thread cannot start (a pids limit), no copy is left queued for it (it
    would run later, unseen, and install a segment nothing records): each linear layer's copy
    runs in the load's thread, adopted in order, with the same results."""
    from test_no_thread import no_thread_named

    model = _model(1, 2, 1, linear=True)
    before = _outputs(model)
    refused = no_thread_named(monkeypatch, "vllm-dedup-staging")
    install, threads = onednn.install, []

    def recorded(packed, data, compare=True):
        threads.append(threading.current_thread().name)
        return install(packed, data, compare)

    monkeypatch.setattr(onednn, "install", recorded)
    staging = Staging(min_bytes=1)
    _stage(model, staging)
    staging.finish()
    assert len(refused) == 1 and staging.failures == []
    assert [(e.module, e.owner) for e in staging.staged] == [("layer0", True), ("layer1", True), ("layer2", False)]
    assert threads == [threading.current_thread().name] * 3
    for i, layer in enumerate(model.children()):
        assert _address(layer) == staging.staged[i].tensor.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model), before))
    staging.release()


@pytest.mark.heavy
@pytest.mark.parametrize("fail", ["install", "install-bug", "seal"])
def test_a_move_that_fails_leaves_the_handler_its_bytes(monkeypatch, fail):
    """Whatever fails after the first chunk was moved (oneDNN refusing, a bug raising anything
    else, the kernel refusing a seal), every dropped page gets its bytes back."""
    big = _Big()
    before = big.outputs()
    packed = onednn.find_packed(big.handler)
    if fail.startswith("install"):
        def refuse(*args, **kwargs):
            raise PackedWeightError("refused for the test") if fail == "install" else RuntimeError("a bug")

        monkeypatch.setattr(onednn, "install", refuse)
    else:
        def no_seal(fd):
            raise OSError(errno.EPERM, "sealing refused for the test")

        monkeypatch.setattr(staging_module, "seal", no_seal)
    staging = Staging(min_bytes=1)
    staging.after_post_processing("embed", big)
    assert staging.staged == [] and staging.created_bytes == 0 and len(staging.failures) == 1
    assert _address(big) == packed.address and not onednn.find_packed(big.handler).shared
    assert torch.equal(big.outputs(), before)  # every dropped page got its bytes back
    onednn.check_packing(onednn.find_packed(big.handler), big.weight.t(), sample=None)


@pytest.mark.heavy
def test_a_move_whose_bytes_cannot_be_put_back_stops_the_load(monkeypatch):
    """The move failed and the bytes cannot be read back from the memfd: the handler would read
    zero pages, so staging raises instead of leaving it to the load (never a wrong weight)."""
    big = _Big()

    def no_seal(fd):
        raise OSError(errno.EPERM, "sealing refused for the test")

    def no_read(*args):
        raise OSError(errno.EIO, "read refused for the test")

    monkeypatch.setattr(staging_module, "seal", no_seal)
    monkeypatch.setattr(os, "preadv", no_read)
    staging = Staging(min_bytes=1)
    with pytest.raises(SharedWeightsError, match="could not be restored.*the load stops"):
        staging.after_post_processing("embed", big)


def _context(sock, name: str, on_registry_error: str = "fail") -> LoadContext:
    lease = Lease(RegistryClient(sock), name, "cpu", "default", "staging-test")
    return LoadContext(DedupConfig(min_tensor_bytes=1, on_registry_error=on_registry_error), lease,
                       torch.device("cpu"), "cpu", share_packed=True)


def test_the_sharing_pass_publishes_a_staged_segment_as_it_is_and_maps_it_elsewhere(registry_server):
    first, second = _model(1, 1, 2), _model(1, 2)
    want = _outputs(second)
    nbytes = onednn.find_packed(first.layer0.handler).nbytes
    a, b = _context(registry_server.path, "first"), _context(registry_server.path, "second")
    try:
        staged_a = Staging(min_bytes=1)
        _stage(first, staged_a)
        addresses = [_address(layer) for layer in first.children()]
        report = share_model(first, a, staging=staged_a)
        assert (report.published_tensors, report.published_bytes) == (2, 2 * nbytes)
        assert report.shared_tensors == 1  # layer1: the same segment as layer0
        assert report.created_bytes == 0  # the sharing pass made no segment: the staged ones were published
        assert [_address(layer) for layer in first.children()] == addresses  # no copy, no new mapping
        (group,) = registry_stats(registry_server.path).groups
        assert (group.segments, group.resident_bytes) == (2, 2 * nbytes)
        assert staged_a.staged == [] and staged_a.created_bytes == 2 * nbytes  # published: still memory

        staged_b = Staging(min_bytes=1)
        _stage(second, staged_b)
        assert staged_b.created_bytes == 2 * nbytes
        own = [_address(layer) for layer in second.children()]
        report = share_model(second, b, staging=staged_b)
        assert (report.shared_tensors, report.published_tensors) == (2, 0)  # the first engine's copies
        assert staged_b.created_bytes == 0  # its staged segments are freed
        assert all(_address(layer) != mine for layer, mine in zip(second.children(), own))
        assert all(torch.equal(x, y) for x, y in zip(want, _outputs(second)))
        (group,) = registry_stats(registry_server.path).groups
        assert (group.segments, group.resident_bytes) == (2, 2 * nbytes)  # nothing published twice
        gc.collect()
        assert not any(_mapped(mine) for mine in own)  # the staged segments are unmapped, hence freed
    finally:
        a.lease.close()
        b.lease.close()


@pytest.mark.parametrize("fails", ["registry", "keys", "walk"])
def test_staged_weights_the_pass_never_took_count_as_read_only(registry_server, monkeypatch, fails):
    """The staged packed weights stay this engine's, in sealed segments, when the pass cannot
    take them: the registry fails before they are published (``registry``), the plain tensors'
    keys cannot be computed (``keys``), or the model's walk fails (``walk``).  The engine then
    counts them in ``unpublished_bytes`` and refuses weight writes as where weights are shared
    (`worker_hooks`), rather than forgetting them."""
    from vllm_dedup.engine import share as share_module
    from vllm_dedup.errors import RegistryUnavailable
    from vllm_dedup.segments.host import HostSegment

    def failing(*args, **kwargs):
        raise RegistryUnavailable("the registry failed for the test") if fails == "registry" else \
            MemoryError("for the test")

    model = _model(1, 2)
    want = _outputs(model)
    nbytes = onednn.find_packed(model.layer0.handler).nbytes
    ctx = _context(registry_server.path, f"pass-fails-{fails}", on_registry_error="fallback")
    if fails == "registry":
        ctx.lease.acquire = failing
    elif fails == "keys":
        monkeypatch.setattr(HostSegment, "content_keys", staticmethod(failing))
    else:
        monkeypatch.setattr(share_module, "collect_slots", failing)
    try:
        staged = Staging(min_bytes=1)
        _stage(model, staged)
        report = share_model(model, ctx, staging=staged)
        assert report.published_tensors == report.shared_tensors == 0 and report.private_tensors == 2
        assert report.unpublished_bytes == report.segment_bytes == 2 * nbytes
        assert all(torch.equal(x, y) for x, y in zip(want, _outputs(model)))
    finally:
        ctx.lease.close()


def test_the_heap_is_trimmed_as_layers_are_staged(monkeypatch):
    """Note [the heap while staging]: every `_TRIM_EVERY_BYTES` of oneDNN buffers freed into the
    heap, its free pages go back to the kernel (else they grow by a weight per layer)."""
    trims = []
    monkeypatch.setattr(staging_module, "trim", lambda: trims.append(1))
    model = _model(1, 2, 3, 4, 5)
    nbytes = onednn.find_packed(model.layer0.handler).nbytes
    monkeypatch.setattr(staging_module, "_TRIM_EVERY_BYTES", 2 * nbytes)
    _stage(model, Staging(min_bytes=1))
    assert len(trims) == 2  # after layers 1 and 3


def test_release_closes_every_staged_descriptor_even_where_a_handler_cannot_be_read(monkeypatch):
    """`Staging.release` runs in the sharing pass's ``finally``: an unexpected error reading a
    handler must neither keep it from closing the staged descriptors nor replace the pass's
    own error; such a handler counts as still reading its segment (read-only: writes refused)."""
    from vllm_dedup.engine.staging import Staged
    from vllm_dedup.segments.host import HostSegment

    staging = Staging(4096, "cpu", lambda keys: keys)
    segments = [HostSegment.from_bytes(bytes(8192), name="vllm-dedup") for _ in range(2)]
    for i, seg in enumerate(segments):
        staging.staged.append(Staged(f"layer{i}", object(), f"k{i}", seg, seg.tensor(0, torch.uint8, (8192,), (1,)),
                                     owner=True))

    def unreadable(handler):
        raise RuntimeError("a handler this code cannot read (a test)")

    monkeypatch.setattr(onednn, "find_packed", unreadable)
    assert staging.read_only() == (2, 2 * 8192)

    def copy_failed():  # the copy in flight left a handler reading bytes nobody owns
        raise SharedWeightsError("a packed weight could not be restored (a test)")

    monkeypatch.setattr(staging, "_finish_copy", copy_failed)
    with pytest.raises(SharedWeightsError, match="could not be restored"):  # its error, not a closing one
        staging.release()
    assert all(seg.fileno() < 0 for seg in segments) and staging.staged == []
