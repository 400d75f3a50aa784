"""Shared packed linear weights on vLLM's CPU backend (``cpu_linear="packed"``, the default):
real engines run vLLM's own oneDNN kernels on one copy of each packed weight.

A plain (``auto``) engine is the reference: its greedy tokens, and its final tensors with every
oneDNN handler's packed weight as its content key (`harness.oracle.packed_digests`).  Two
dedup engines of the same checkpoint: the first publishes its packed weights, the second maps
them from the first's recipe without reading the checkpoint (the registry finds every one of
those keys) and its private memory (``Pss_Anon``) is
below a plain engine's by at least 95% of the packed bytes.  Both hold exactly the plain engine's bytes and
answer exactly as it does, on every prompt.  A write to a shared packed page faults:
tests/integration/test_onednn_packed.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from harness.engines import EngineProcess
from harness.oracle import differences
from harness.procs import pss_parts
from vllm_dedup.content.keys import ContentKey
from vllm_dedup.registry.client import RegistryClient
from vllm_dedup.segments import segment_class


def packed_keys(tensors: dict[str, str]) -> list[str]:
    """The content key of each handler's packed weight in an oracle listing (a tied head's
    handler packs the embedding again: the same key twice)."""
    return sorted(v for k, v in tensors.items() if k.startswith("packed:"))


@pytest.fixture(scope="module", autouse=True)
def _vllm_packs():
    """vLLM packs bfloat16 linear weights only where oneDNN has a bfloat16 matmul (AVX-512 and
    up); on AVX2 it runs ``F.linear``, nothing is packed, and dedup engines share the plain
    weights (cpu_linear falls back to vllm: every other engine test covers that branch, and
    tests/e2e/test_avx2_linear.py holds engines to AVX2 on any machine).  An
    ISA above the machine's cannot be forced, so this test needs such a CPU."""
    from vllm_dedup.engine.onednn import vllm_packs

    if not vllm_packs("bfloat16"):
        pytest.skip("vLLM packs no bfloat16 linear weight on this CPU (no AVX-512): nothing packed to share")


def test_a_second_engine_maps_the_packed_linears_and_answers_as_plain(smollm2, registry):
    with EngineProcess(smollm2, "auto", core=0) as plain:
        plain.wait_ready()
        (reference,) = plain.final_tensors()
        plain_ids = plain.generate()
        plain.pss()  # trims the heap first
        plain_anon = pss_parts(plain.pid)["Pss_Anon"]
    keys = packed_keys(reference)
    linear = sum(ContentKey.parse(k).shape[0] for k in keys)
    assert linear > 0.7 * (smollm2 / "model.safetensors").stat().st_size  # SmolLM2: about 120 handlers

    first = EngineProcess(smollm2, core=0).wait_ready()
    try:
        l1 = registry.engine_loads()[first.pid]
        assert l1["packed_tensors"] == len(keys), l1
        (tensors,) = first.final_tensors()
        assert not differences(tensors, reference)
        with EngineProcess(smollm2, core=1) as second:
            second.wait_ready()
            l2 = registry.engine_loads()[second.pid]
            assert (l2["packed_tensors"], l2["published_tensors"]) == (len(keys), 0), l2
            assert (l2["load_path"], l2["checkpoint_bytes_read"]) == ("full", 0), l2  # a recipe maps them
            (tensors,) = second.final_tensors()
            assert not differences(tensors, reference)
            with RegistryClient(registry.socket) as client:
                client.hello("inspector", segment_class("cpu").device_key(torch.device("cpu")), "default")
                hits = client.acquire(sorted(set(keys)))
                assert sorted(h.key for got in hits for h in got.hits) == sorted(set(keys))
                client.release([got.segment for got in hits])
                for got in hits:
                    os.close(got.fd)
            second.pss()
            saved = plain_anon - pss_parts(second.pid)["Pss_Anon"]  # what it adds to the machine, below plain's
            assert saved >= 0.95 * linear, (saved, linear)
            assert second.generate() == plain_ids
        assert first.generate() == plain_ids
    finally:
        first.stop()
