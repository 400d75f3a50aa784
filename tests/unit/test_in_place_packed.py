"""Publish in place with packed segments (`vllm_dedup.engine.in_place_packed`), the CUDA
backend's layout, run here on the host backend's writable memfd segments with a forced 1 MiB
granularity (as `tests/integration/test_share.py` runs packing): real memfds, a real registry
daemon, real mappings; the model is a small ``nn.Module`` standing in for vLLM's.  What only a
GPU shows (torch tensors over VMM mappings, device memory) is `benchmarks/gpu_check.py`'s."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from test_in_place import _context, _mapping, _memfd_descriptors
from vllm_dedup.engine.in_place_packed import PackedInPlace
from vllm_dedup.engine.share import share_model
from vllm_dedup.registry.client import registry_stats
from vllm_dedup.segments.host import HostSegment
from vllm_dedup.segments.packing import plan_packs

GRANULARITY = 1 << 20
MIN_BYTES = 4096


class _Model(nn.Module):
    """Weights of several sizes (packs of one and of several), one tied into a second module, a
    buffer computed at construction, and a norm too small to move."""

    SHAPES = {"big": (768, 1024), "mid": (512, 512), "part": (256, 512), "small0": (128, 256), "small1": (64, 256)}

    def __init__(self):
        super().__init__()
        for name, shape in self.SHAPES.items():
            setattr(self, name, nn.Linear(shape[1], shape[0], bias=False))
        self.head = nn.Linear(512, 256, bias=False)
        self.head.weight = self.part.weight  # tied: one storage, two places
        self.register_buffer("cache", torch.arange(1 << 16, dtype=torch.float32))  # bytes before loading
        self.norm = nn.Parameter(torch.ones(16))
        for p in self.parameters():
            p.requires_grad_(False)

    def load(self, seed: int, retrained: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """Write weights as vLLM's weight loaders do (``param.data.copy_``); the ``retrained``
        ones from another seed.  Returns what each holds."""
        out = {}
        for name, shape in self.SHAPES.items():
            g = torch.Generator().manual_seed(seed + 1000 * (name in retrained) + len(name))
            out[name] = torch.randn(shape, generator=g)
            getattr(self, name).weight.data.copy_(out[name])
        return out

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name).weight for name in self.SHAPES}


def _placer() -> PackedInPlace:
    return PackedInPlace(HostSegment, "cpu", "cpu", GRANULARITY, MIN_BYTES)


def _sizes() -> list[int]:
    """The candidates' sizes in the sharing pass's order (the model's parameters, then buffers)."""
    return [h * w * 4 for h, w in _Model.SHAPES.values()] + [(1 << 16) * 4]


def test_place_lays_storages_out_in_packs_and_keeps_what_construction_wrote():
    before = _memfd_descriptors()  # another test's segments may still be alive in this process
    model = _Model()
    cache = model.cache.clone()
    placed = _placer()
    placed.place(model)
    plan = plan_packs(_sizes(), GRANULARITY)
    assert len(plan.packs) < len(_sizes()) and not plan.private  # some share an allocation
    for t in [*model.weights().values(), model.cache]:
        assert "/memfd:vllm-dedup" in _mapping(t) and t.untyped_storage().nbytes() == t.numel() * 4  # its own storage
    assert "/memfd:vllm-dedup" not in _mapping(model.norm)  # 64 bytes: private
    assert model.head.weight is model.part.weight and torch.equal(model.cache, cache)
    assert placed.placed_bytes == sum(_sizes())
    assert placed.held_bytes == plan.segment_bytes
    assert _memfd_descriptors() - before == len(plan.packs) * 2  # the segment's and its mapping's
    weights = model.load(0)
    assert all(torch.equal(model.weights()[n], weights[n]) for n in weights)
    placed.release()
    assert _memfd_descriptors() - before == len(plan.packs)  # the mappings' own, which go with the tensors
    del model, t
    assert _memfd_descriptors() == before


def test_the_first_engine_publishes_every_pack_where_it_lies_and_a_second_maps_them(registry_server):
    first, second = _Model(), _Model()
    a, b = _context(registry_server.path, "first"), _context(registry_server.path, "second")
    plan = plan_packs(_sizes(), GRANULARITY)
    try:
        placed = _placer()
        placed.place(first)
        want = first.load(0)
        report = share_model(first, a, pack_granularity=GRANULARITY, in_place=placed)
        assert report.created_bytes == 0, placed.failures  # no copy
        assert report.published_tensors == len(_sizes()) and report.padding_bytes == plan.padding_bytes
        assert placed.sealed_bytes == plan.segment_bytes
        for t in [*first.weights().values(), first.cache]:
            assert _mapping(t).split()[1][:2] == "r-", _mapping(t)  # frozen: a write faults
        (group,) = registry_stats(registry_server.path).groups
        assert (group.segments, group.resident_bytes) == (len(plan.packs), plan.segment_bytes)
        placed.release()

        second.load(0)
        report = share_model(second, b, pack_granularity=GRANULARITY)
        assert (report.shared_tensors, report.published_tensors) == (len(_sizes()), 0)
        for model in (first, second):
            assert all(torch.equal(model.weights()[n], want[n]) for n in want)
        assert torch.equal(first.cache, second.cache) and first.head.weight is first.part.weight
    finally:
        a.lease.close()
        b.lease.close()


def test_a_fine_tune_publishes_only_packs_of_its_own_and_frees_the_rest(registry_server):
    """The base engine publishes its one pack (5 MiB at a 1 MiB granularity).  A fine-tune
    whose ``mid`` and ``small0`` differ maps everything else: its own pack holds shared tensors,
    so it is not published as it lies; its two tensors are copied into a new pack, and the
    allocation it loaded into goes with its last member."""
    base, tuned = _Model(), _Model()
    a, b = _context(registry_server.path, "base"), _context(registry_server.path, "tuned")
    try:
        share_model(base, a, pack_granularity=GRANULARITY, in_place=_placed_and_loaded(base, 0))
        base_bytes = {n: t.clone() for n, t in base.weights().items()}
        placed = _placed_and_loaded(tuned, 0, ("mid", "small0"))
        want = {n: t.clone() for n, t in tuned.weights().items()}
        assert not torch.equal(want["mid"], base_bytes["mid"]) and torch.equal(want["big"], base_bytes["big"])
        report = share_model(tuned, b, pack_granularity=GRANULARITY, in_place=placed)
        assert (report.shared_tensors, report.published_tensors, report.created_bytes) == (4, 2, 2 * GRANULARITY)
        assert placed.sealed_bytes == 0
        placed.release()
        assert all(torch.equal(tuned.weights()[n], want[n]) for n in want)
        for t in [*tuned.weights().values(), tuned.cache]:  # mapped from the base, or the new pack
            assert _mapping(t).split()[1][:2] == "r-", _mapping(t)
        (group,) = registry_stats(registry_server.path).groups
        assert group.engines == 2
    finally:
        a.lease.close()
        b.lease.close()


def _placed_and_loaded(model: _Model, seed: int, retrained: tuple[str, ...] = ()) -> PackedInPlace:
    placed = _placer()
    placed.place(model)
    model.load(seed, retrained)
    return placed


def test_a_declined_replay_discards_what_it_placed():
    model = _Model()
    placed = _placer()
    placed.place(model, [model.big, model.mid])
    assert placed.placed_bytes == sum(_sizes()[:2]) and "/memfd:vllm-dedup" not in _mapping(model.part.weight)
    weights = model.load(5)
    placed.discard()
    assert placed.placed_bytes == 0 and placed.held_bytes == 0
    assert torch.equal(model.big.weight, weights["big"])  # the model given up still reads its bytes


def test_a_storage_something_else_holds_stays_where_it_is():
    model = _Model()
    kept = model.big.weight.data  # a tensor of vLLM's kept outside the model's places
    placed = _placer()
    placed.place(model)
    assert "/memfd:vllm-dedup" not in _mapping(model.big.weight)
    assert model.big.weight.data_ptr() == kept.data_ptr()
    assert "holds its storage" in placed.failures[0]
    assert placed.placed_bytes == sum(_sizes()) - _sizes()[0]
    placed.release()


def _replaced_after_loading(model: _Model, name: str) -> None:
    """What post-processing does to a weight it repacks: a new parameter in its place (the old
    storage, in the pack, is then used by nothing)."""
    old = getattr(model, name).weight
    getattr(model, name).weight = nn.Parameter(old.detach().clone(), requires_grad=False)


def test_a_pack_whose_replaced_members_fit_in_a_granule_is_published_where_it_lies(registry_server):
    """Note [what a pack may hold when it is published]: ``small1`` (64 KiB) is replaced after
    loading; the pack holds its dead bytes as padding and is still published, no copy."""
    model = _Model()
    ctx = _context(registry_server.path, "replaced-small")
    try:
        placed = _placed_and_loaded(model, 0)
        _replaced_after_loading(model, "small1")
        report = share_model(model, ctx, pack_granularity=GRANULARITY, in_place=placed)
        assert report.created_bytes == 0 and placed.sealed_bytes > 0, placed.failures
        # small1's replacement is a miss too, alone a sixteenth of a pack: private
        assert (report.published_tensors, report.private_tensors) == (len(_sizes()) - 1, 2)  # and the norm
        placed.release()
    finally:
        ctx.lease.close()


@pytest.mark.parametrize("case", ["replaced", "kept"])
def test_a_pack_is_copied_when_more_than_a_granule_was_replaced_or_a_member_is_still_used(registry_server, case):
    """``big`` (3 MiB) replaced after loading: its dead bytes would be padding for good, so the
    pack's misses are copied.  Or ``small1``'s storage is still used outside the model: it
    must not turn read-only, so the pack is copied too."""
    model = _Model()
    ctx = _context(registry_server.path, f"copied-{case}")
    try:
        placed = _placed_and_loaded(model, 0)
        kept = model.small1.weight.data if case == "kept" else None
        _replaced_after_loading(model, "big" if case == "replaced" else "small1")
        want = {n: t.clone() for n, t in model.weights().items()}
        report = share_model(model, ctx, pack_granularity=GRANULARITY, in_place=placed)
        assert placed.sealed_bytes == 0 and report.created_bytes > 0
        assert ("were replaced" if case == "replaced" else "stay private") in placed.failures[0], placed.failures
        placed.release()
        assert all(torch.equal(model.weights()[n], want[n]) for n in want)
        if kept is not None:
            kept.add_(1)  # still writable: a write does not fault
    finally:
        ctx.lease.close()


def test_a_pack_to_copy_is_not_sealed_where_a_copy_would_lay_it_out_alike(registry_server):
    """The pack's one live member lies at offset 0, where the copy's plan puts it too; the 3 MiB
    replaced after loading must not be published with it as padding (Note [what a pack may
    hold when it is published]): the live member is copied, the pack is not sealed."""

    class TwoWeights(nn.Module):
        def __init__(self):
            super().__init__()
            self.live = nn.Parameter(torch.zeros(3 * GRANULARITY // 16), requires_grad=False)  # 0.75 MiB, first
            self.replaced = nn.Parameter(torch.zeros(3 * GRANULARITY // 4), requires_grad=False)  # 3 MiB

    model = TwoWeights()
    ctx = _context(registry_server.path, "copied-same-layout")
    try:
        placed = _placer()
        placed.place(model)
        model.live.data.copy_(torch.arange(model.live.numel(), dtype=torch.float32))
        model.replaced = nn.Parameter(torch.ones(4), requires_grad=False)  # post-processing's new one
        want = model.live.detach().clone()
        report = share_model(model, ctx, pack_granularity=GRANULARITY, in_place=placed)
        assert placed.sealed_bytes == 0 and report.created_bytes == GRANULARITY, (placed.failures, report)
        assert "were replaced" in placed.failures[0], placed.failures
        assert torch.equal(model.live, want)
        placed.release()
    finally:
        ctx.lease.close()


def _shmem_bytes() -> int:
    """This process's resident shared memory (``RssShmem``: its memfd pages mapped), bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssShmem:"))


def test_each_pack_that_is_copied_goes_once_its_misses_are_copied_not_at_the_end(registry_server, monkeypatch):
    """Four 48 MiB packs, each half replaced after loading (more than a granule: copied) and
    half a miss.  Each pack goes as soon as the copy of its miss is adopted, so that at any
    copy the memory held is at most what a plain load holds plus one copy (Note [one copy at a
    time]); before, every such pack stayed until the end of the sharing pass (+24 MiB a copy)."""
    mib, n = 1 << 20, 4

    class Halves(nn.Module):
        def __init__(self):
            super().__init__()
            for i in range(n):
                self.register_parameter(f"a{i}", nn.Parameter(torch.zeros(6 * mib), requires_grad=False))  # replaced
                self.register_parameter(f"b{i}", nn.Parameter(torch.zeros(6 * mib), requires_grad=False))  # a miss

    model = Halves()
    placed = _placer()
    placed.place(model)
    assert [p.seg.size for p in placed._packs] == [48 * mib] * n
    for i in range(n):  # loaded, then post-processing replaces a_i
        getattr(model, f"b{i}").data.fill_(i + 1)
        getattr(model, f"a{i}").data.fill_(i + 100)
        setattr(model, f"a{i}", nn.Parameter(torch.ones(4), requires_grad=False))
    base, at_copy = _shmem_bytes(), []
    made = HostSegment.create_packed.__func__

    def counted(cls, *args, **kwargs):
        at_copy.append(_shmem_bytes() - base)
        return made(cls, *args, **kwargs)

    monkeypatch.setattr(HostSegment, "create_packed", classmethod(counted))
    ctx = _context(registry_server.path, "copied-one-at-a-time")
    try:
        report = share_model(model, ctx, pack_granularity=GRANULARITY, in_place=placed)
        assert report.published_tensors == n and placed.sealed_bytes == 0 and len(at_copy) == n, (report, at_copy)
        # before copy k: n - k packs left (48 MiB each) and k copies (24 MiB each)
        assert all(grew <= -24 * mib * k + 4 * mib for k, grew in enumerate(at_copy)), [g / mib for g in at_copy]
        assert all(torch.all(getattr(model, f"b{i}") == i + 1) for i in range(n))
        placed.release()
        assert placed.held_bytes == 0
    finally:
        ctx.lease.close()



def test_a_pack_that_cannot_be_frozen_stays_counted_while_its_members_map_it(monkeypatch):
    """A pack whose freeze fails is not sealed (the sharing pass copies its members instead);
    until then its members still map it, so the load meter (`held_bytes`) keeps counting it."""
    from types import SimpleNamespace

    from vllm_dedup.errors import SegmentError

    def refuse(self):
        raise SegmentError("freeze refused (a test)")

    model = _Model()
    placed = _placer()
    placed.place(model)
    model.load(0)
    (pack,) = plan_packs(_sizes(), GRANULARITY).packs  # one pack: offsets from its first byte
    tensors = [*model.weights().values(), model.cache]
    base = min(t.data_ptr() for t in tensors)
    slots = [SimpleNamespace(tensor=t) for t in tensors]
    monkeypatch.setattr(HostSegment, "freeze", refuse)
    assert placed.seal(slots, [t.data_ptr() - base for t in tensors]) is None
    assert "freeze refused" in placed.failures[0] and placed.sealed_bytes == 0
    assert placed.held_bytes == pack.nbytes  # its members still map it
    placed.release()
    del slots, tensors, model
    assert placed.held_bytes == 0


@pytest.mark.parametrize("case", ["put back", "move failed"])
def test_a_pack_with_a_stretch_no_member_uses_is_not_published_with_it_as_padding(case, monkeypatch):
    """``big`` (3 MiB, the pack's first storage) is held outside the model, so it goes back where
    it was and its copy in the pack is used by nothing; or moving the second storage fails, so
    the rest of the pack is never filled.  Either stretch is more than a granule: published, it
    would be kept read-only for good with nothing over it (Note [what a pack may hold when it is
    published]), so the pack's misses are copied instead, and `seal` refuses it too."""
    from types import SimpleNamespace

    model = _Model()
    kept = model.big.weight.data if case == "put back" else None
    placed = _placer()
    if case == "move failed":
        move, calls = PackedInPlace._move, []

        def fail_second(self, slot, pack, offset):
            calls.append(offset)
            if len(calls) == 2:
                raise RuntimeError("out of device memory (a test)")
            move(self, slot, pack, offset)

        monkeypatch.setattr(PackedInPlace, "_move", fail_second)
    placed.place(model)
    (pack,) = placed._packs
    members = [t for t in [*model.weights().values(), model.cache] if t.data_ptr() in pack.members]
    assert len(members) == (len(_sizes()) - 1 if case == "put back" else 1)
    slots = [SimpleNamespace(tensor=t) for t in members]
    offsets = [pack.members[t.data_ptr()].offset for t in members]
    assert placed.seal(slots, offsets) is None
    in_place, regroup = placed.packs({f"k{i}": [slot] for i, slot in enumerate(slots)})
    assert in_place == [] and len(regroup) == 1, placed.failures
    assert "never filled" in placed.failures[-1]
    del kept


def test_the_load_meter_may_ask_while_packs_are_let_go_of(monkeypatch):
    """The meter's thread reads `held_bytes` while the load's thread lets packs go one by one
    (`packs`); each asks between two of them, when the first is let go of and still listed."""
    import vllm_dedup.engine.in_place_packed as module

    monkeypatch.setattr(module, "plan_packs",
                        lambda sizes, g, **kw: plan_packs(sizes, g, max_pack_bytes=GRANULARITY, **kw))
    model = _Model()
    placed = _placer()
    placed.place(model)
    held, count = placed.held_bytes, len(placed._packs)
    assert count > 2
    seen, close = [], HostSegment.close_fd

    def close_and_ask(self):
        close(self)
        seen.append(placed.held_bytes)

    monkeypatch.setattr(HostSegment, "close_fd", close_and_ask)
    placed.packs({})  # nothing to publish: each let go of, its members still mapping it
    assert len(seen) >= count and set(seen) == {held}
    placed.release()


def test_a_model_whose_storages_cannot_be_collected_loads_privately_and_place_never_raises():
    model = nn.Module()
    model.w = nn.UninitializedParameter()
    model.register_buffer("b", torch.ones(1 << 16))
    placed = _placer()
    placed.place(model)
    assert placed.placed_bytes == 0 and "uninitialized" in placed.failures[0]
