"""Packing tensors into granularity-sized segments (pure logic: no GPU needed)."""

from __future__ import annotations

import random

import pytest

from vllm_dedup.segments.packing import plan_packs, round_up

MiB = 1 << 20


def check_plan(sizes, plan, granularity, alignment):
    seen = []
    for pack in plan.packs:
        assert pack.nbytes % granularity == 0 and pack.nbytes > 0
        spans = sorted((off, off + sizes[i]) for i, off in pack.members)
        for (a0, a1), (b0, _) in zip(spans, spans[1:]):
            assert a1 <= b0, "members overlap"
        assert all(off % alignment == 0 for _, off in pack.members)
        assert spans[-1][1] <= pack.nbytes
        assert pack.payload_bytes == sum(sizes[i] for i, _ in pack.members)
        seen += [i for i, _ in pack.members]
    assert sorted(seen + plan.private) == list(range(len(sizes)))


@pytest.mark.parametrize("seed", range(5))
def test_random_sizes_are_packed_without_overlap_and_little_padding(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([rng.randint(1, 64 << 10), rng.randint(64 << 10, 8 * MiB), rng.randint(8 * MiB, 80 * MiB)])
             for _ in range(300)]
    plan = plan_packs(sizes, granularity=2 * MiB)
    check_plan(sizes, plan, 2 * MiB, 256)
    kept = sum(p.payload_bytes for p in plan.packs)
    assert plan.padding_bytes <= 0.02 * kept, (plan.padding_bytes, kept)


def test_a_model_of_small_tensors_pays_under_one_granule_per_pack():
    # SmolLM2-135M-like: 30 layers x (4 x 1.2 MB + 3 x 3.1 MB) + a 28 MB embedding.
    sizes = [28 * MiB] + [1_179_648] * 120 + [3_145_728] * 90
    plan = plan_packs(sizes, granularity=2 * MiB, max_pack_bytes=64 * MiB)
    check_plan(sizes, plan, 2 * MiB, 256)
    assert plan.private == []
    assert plan.padding_bytes < len(plan.packs) * 2 * MiB
    one_per_tensor = sum(round_up(s, 2 * MiB) - s for s in sizes)
    assert plan.padding_bytes < one_per_tensor / 20


def test_small_items_fill_the_slack_of_a_big_one_and_a_mostly_empty_pack_stays_private():
    plan = plan_packs([5 * MiB, 512 << 10, 256 << 10], granularity=2 * MiB, max_pack_bytes=4 * MiB)
    (pack,) = plan.packs
    assert pack.nbytes == 6 * MiB and len(pack.members) == 3  # the small ones ride in the big one's rounding
    lone = plan_packs([100 << 10], granularity=2 * MiB)
    assert lone.packs == [] and lone.private == [0]  # 100 KiB in a 2 MiB segment: not worth it
    assert plan_packs([100 << 10], granularity=4096).packs[0].nbytes == round_up(100 << 10, 4096)


def test_in_order_packs_hold_consecutive_items_with_as_little_padding():
    # SmolLM2-135M's GPU layout: per layer qkv 1.05 MiB, gate_up 3.4 MiB, down 1.7 MiB; 54 MiB embedding.
    sizes = [56_623_104] + [1_105_920, 3_538_944, 1_769_472] * 30
    plan = plan_packs(sizes, granularity=2 * MiB, in_order=True)
    check_plan(sizes, plan, 2 * MiB, 256)
    members = [i for pack in plan.packs for i, _ in pack.members]
    assert members == list(range(len(sizes)))  # in the order given, each pack a run of items
    assert plan.padding_bytes < len(plan.packs) * 2 * MiB
    assert plan.padding_bytes <= 1.01 * plan_packs(sizes, granularity=2 * MiB).padding_bytes + 2 * MiB


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        plan_packs([1], granularity=3 * MiB)
    with pytest.raises(ValueError, match="> 0"):
        plan_packs([0], granularity=2 * MiB)
    with pytest.raises(ValueError, match="must not exceed"):
        plan_packs([1], granularity=4096, alignment=8192)
