"""Mapping what is resident (`engine.resident.map_resident`) and the layouts a replay accepts
for it (`TensorRecipe.fits`): a caller that stops early holds nothing and leaks no descriptor, and
a recipe's layout is only trusted within its key's type and bytes.  A real registry in this
process, real sealed memfds."""

from __future__ import annotations

import os

import torch

from vllm_dedup.content.keys import content_key
from vllm_dedup.content.views import tensor_bytes
from vllm_dedup.engine.recipe import TensorRecipe
from vllm_dedup.engine.resident import map_resident
from vllm_dedup.registry.client import RegistryClient, registry_stats
from vllm_dedup.registry.lease import Lease
from vllm_dedup.segments.host import SEGMENT_MEMFD_NAME, HostSegment


def _lease(sock, model: str) -> Lease:
    return Lease(RegistryClient(sock), model, "cpu", "default", "sig")


def _published(lease: Lease, tensor: torch.Tensor) -> tuple[HostSegment, str]:
    data = tensor_bytes(tensor)
    segment = HostSegment.from_bytes(bytes(data), name=SEGMENT_MEMFD_NAME)
    key = str(content_key(data, "float32", tuple(tensor.shape)))
    lease.publish(segment.fileno(), segment.nbytes, [(key, 0, segment.nbytes)])
    return segment, key


def _held(sock, model: str) -> int:
    return next(e.segments for e in registry_stats(sock).engines if e.model == model)


def _descriptors(segment: HostSegment) -> int:
    """How many of this process's descriptors open ``segment``'s memfd."""
    inode = os.fstat(segment.fileno()).st_ino
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.stat(f"/proc/self/fd/{fd}").st_ino == inode
        except OSError:  # the listing's own descriptor, closed since
            pass
    return count


def test_a_caller_that_stops_early_holds_nothing_it_was_not_given(registry_server):
    sock = registry_server.path
    publisher, mapper = _lease(sock, "publisher"), _lease(sock, "mapper")
    try:
        published = [_published(publisher, torch.full((1024,), float(i))) for i in range(3)]
        before = [_descriptors(segment) for segment, _ in published]
        mapped = map_resident(mapper, HostSegment, "cpu", [key for _, key in published])
        first = next(mapped)
        assert first.segment is not None and _held(sock, "mapper") == 3  # one acquire for every key
        mapped.close()  # the caller gives up after the first segment
        assert _held(sock, "mapper") == 1  # the two it was never given went back
        # ... and no descriptor of theirs is left; the first is open in the lease and its mapping
        assert [_descriptors(segment) for segment, _ in published] == [before[0] + 2, *before[1:]]
        mapper.release([first.found.segment])
        assert _held(sock, "mapper") == 0
    finally:
        mapper.close()
        publisher.close()


def test_a_recipe_layout_is_trusted_only_within_its_keys_type_and_bytes():
    key = str(content_key(bytes(64), "bfloat16", (4, 8)))

    def entry(dtype="bfloat16", shape=(4, 8), stride=(8, 1)):
        return TensorRecipe("weight", True, dtype, shape, stride, key=key)

    assert entry().fits(key, 64)
    assert entry(shape=(4, 1, 8), stride=(8, 8, 1)).fits(key, 64)  # a causal-conv weight over its buffer
    assert not entry(shape=(8, 4), stride=(4, 1)).fits(key, 64)  # another shape than the one published
    assert not entry(shape=(8, 4), stride=(1, 8)).fits(key, 64)  # the bytes read transposed
    assert not entry(dtype="float16").fits(key, 64)  # the bytes read as another type
    assert not entry(dtype="load").fits(key, 64)  # not a dtype at all
    assert not entry(shape=(4, 8), stride=(9, 1)).fits(key, 64)  # reaches past the tensor's bytes
    assert not entry(shape=(4, 8), stride=(-8, 1)).fits(key, 64)
    assert not entry(shape=(4, 8, 1), stride=(8, 1)).fits(key, 64)  # a stride missing
    assert not entry().fits("not a key", 64)
    # A oneDNN packed weight's key names its layout; the recipe reads it as bytes.
    packed = str(content_key(bytes(64), "onednn:0123456789abcdef", (64,)))
    assert TensorRecipe("weight", True, "uint8", (64,), (1,), key=packed).fits(packed, 64)
    assert not TensorRecipe("weight", True, "bfloat16", (32,), (1,), key=packed).fits(packed, 64)
