"""Packed segments end to end on the host backend: two processes share a small model through
a real registry with a forced 1 MiB granularity, the packing the CUDA backend uses at 2 MiB."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.procs import PeerProcess
from helpers import PEERS
from peers.share_peer import SIZES, build
from vllm_dedup.content.keys import tensor_key
from vllm_dedup.engine.share import FORCE_COLLISIONS_ENV
from vllm_dedup.registry.client import RegistryClient, registry_stats
from vllm_dedup.segments.host import sealed_memfd
from vllm_dedup.segments.packing import plan_packs

PEER = PEERS / "share_peer.py"
GRANULARITY = 1 << 20


class SharePeer(PeerProcess):
    """``tests/peers/share_peer.py``: shares a small model of VARIANT through the registry."""

    def __init__(self, sock: Path, variant: str, env: dict | None = None, fail: bool = False):
        super().__init__([PEER, sock, variant, GRANULARITY, *(["fail"] if fail else [])], f"share peer {variant}",
                         env)

    def check(self) -> dict:
        """The digests of the peer's parameters, read through whatever memory backs them now."""
        self.send("check")
        return self.read_json()["digests"]


@pytest.mark.heavy
def test_packed_segments_are_published_mapped_and_outlive_their_creator(registry_server):
    plan = plan_packs(list(SIZES.values()), GRANULARITY)
    assert len(plan.packs) < len(SIZES)  # the layout does pack several tensors together
    base = SharePeer(registry_server.path, "base")
    first = base.read_json()
    r = first["result"]
    assert first["digests"] == first["expected"]
    packed_bytes = sum(SIZES[n] for n in SIZES) - sum(list(SIZES.values())[i] for i in plan.private)
    assert (r["published_tensors"], r["published_bytes"]) == (len(SIZES) - len(plan.private), packed_bytes)
    assert r["private_tensors"] == len(plan.private)
    assert r["padding_bytes"] == plan.padding_bytes
    (group,) = registry_stats(registry_server.path).groups
    assert group.segments == len(plan.packs)
    assert group.resident_bytes == plan.segment_bytes

    tuned = SharePeer(registry_server.path, "tuned")  # mid1 differs, everything else is base's
    second = tuned.read_json()
    r2 = second["result"]
    assert second["digests"] == second["expected"]
    assert second["expected"]["mid1"] != first["expected"]["mid1"]
    assert r2["shared_bytes"] == packed_bytes - SIZES["mid1"]
    assert r2["published_bytes"] + r2["private_bytes"] == SIZES["mid1"] + sum(
        list(SIZES.values())[i] for i in plan.private)

    assert base.end() == 0  # the creator of every shared pack exits
    assert tuned.check() == second["expected"]  # its mappings still hold base's bytes
    (group,) = registry_stats(registry_server.path).groups
    assert group.engines == 1
    assert tuned.end() == 0
    assert registry_stats(registry_server.path).groups == []


@pytest.mark.heavy
def test_a_pack_stays_held_for_the_tensors_taken_when_others_in_it_collide(registry_server):
    """Every key collides (digests zeroed): tensors of one shape share a key.  The base engine
    publishes one tensor per shape, all in one pack; the retuned engine finds every key in that
    pack, takes the tensors whose bytes match and keeps the others private, and keeps holding
    the pack although every tensor of one of its keys (small0, small1) differs."""
    force = {FORCE_COLLISIONS_ENV: "1"}
    base = SharePeer(registry_server.path, "base", force)
    r1 = base.read_json()["result"]
    assert (r1["published_tensors"], r1["collisions"]) == (3, 4)  # big0, mid0, small0; the rest differ
    (group,) = registry_stats(registry_server.path).groups
    assert group.segments == 1
    tuned = SharePeer(registry_server.path, "retuned", force)
    second = tuned.read_json()
    r2 = second["result"]
    assert second["digests"] == second["expected"]  # no other bytes were ever swapped in
    assert (r2["shared_tensors"], r2["collisions"], r2["published_tensors"]) == (2, 5, 0)
    assert base.end() == 0
    assert tuned.check() == second["expected"]
    (group,) = registry_stats(registry_server.path).groups
    assert (group.engines, group.segments) == (1, 1)  # the pack is still held by the tuned engine
    assert tuned.end() == 0
    assert registry_stats(registry_server.path).groups == []


@pytest.mark.parametrize("fail", [False, True], ids=["fallback", "fail"])
def test_a_segment_the_backend_cannot_use_leaves_its_tensor_private_with_one_warning(registry_server, fail):
    """A broken client publishes base's ``big0`` key over a 4 KiB segment (the registry checks only
    that the entry fits its segment).  The engine that maps it gets a real error from the backend
    when it wraps the bytes as the tensor (`typed_view`: the tensor reaches past the segment), as
    a CUDA error or torch's out-of-memory would be: that tensor stays private, everything else is
    shared as usual, one warning says so; with ``fail`` sharing stops with that error."""
    big0 = dict(build("base").named_parameters())["big0"].data
    with RegistryClient(registry_server.path) as broken:
        broken.hello("broken", "cpu", "default")
        fd = sealed_memfd([(bytes(4096), 0)], 4096)
        broken.publish(fd, 4096, [(str(tensor_key(big0)), 0, 4096)])
        os.close(fd)
        peer = SharePeer(registry_server.path, "base", fail=fail)
        if fail:
            got = peer.read_json("ERR ")
            assert got["type"] == "SegmentError" and "reaches past the segment" in got["error"], got
            peer.end()
            return
        first = peer.read_json()
        r = first["result"]
        assert first["digests"] == first["expected"]  # big0 kept its own bytes
        assert r["private_tensors"] >= 1 and r["private_bytes"] >= SIZES["big0"]
        assert r["shared_tensors"] == 0 and r["published_tensors"] == len(SIZES) - r["private_tensors"]
        assert len(r["errors"]) == 1 and "reaches past the segment" in r["errors"][0]
        warnings = [line for line in peer.log().splitlines() if "stay private" in line]
        assert len(warnings) == 1, peer.log()
        assert peer.end() == 0
        # Nothing of the engine's was taken from the broken segment: it released it.
        (group,) = registry_stats(registry_server.path).groups
        assert group.engines == 1 and group.segments == 1
