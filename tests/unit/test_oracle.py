"""The final-tensor oracle (`harness.oracle`) the end-to-end tests trust: a packed weight whose
bytes cannot be read is compared by what its kernel computes, and what the oracle cannot vouch
for is a difference, never an equality.  Real vLLM oneDNN handlers, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.oracle import differences, packed_digests
from helpers import onednn_matmul_dtype
from vllm_dedup.engine import onednn
from vllm_dedup.errors import PackedWeightError

ops = pytest.importorskip("vllm._custom_ops")
N, K = 256, 128
DTYPE = onednn_matmul_dtype()  # bfloat16, or float32 where oneDNN cannot pack bfloat16 (AVX2)


def _model(seed: int) -> nn.Module:
    """A model whose one layer holds a vLLM oneDNN handler of a seeded weight, as a linear
    layer does after vLLM's post-processing (the weight dropped)."""
    layer = nn.Module()
    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)).to(DTYPE)
    layer.handler = ops.create_onednn_mm(weight.t(), 32)
    layer.params_dtype = DTYPE
    model = nn.Module()
    model.add_module("proj", layer)
    return model


def test_a_packed_weight_that_cannot_be_read_is_compared_by_its_output(monkeypatch):
    def unreadable(handler):
        raise PackedWeightError("a layout not understood (for the test)")

    a, b, other = _model(1), _model(1), _model(2)
    readable = packed_digests(a)
    monkeypatch.setattr(onednn, "find_packed", unreadable)
    digests = [packed_digests(m) for m in (a, b, other)]
    assert all(d["packed:proj"].startswith("output|") for d in digests), digests
    assert differences(digests[0], digests[1]) == []  # equal weights compute the same
    assert differences(digests[0], digests[2]) != []  # another weight computes otherwise
    assert readable["packed:proj"].startswith("onednn:")  # where the bytes can be read, their key


def test_what_the_oracle_cannot_read_is_a_difference_even_on_both_sides():
    same = {"packed:proj": "unreadable: a layout not understood"}
    assert differences(same, dict(same)) != []


def test_a_failure_to_walk_the_handlers_is_raised_not_an_empty_answer(monkeypatch):
    def renamed(model):
        raise AttributeError("a vLLM rename")

    monkeypatch.setattr(onednn, "handlers_in", renamed)
    with pytest.raises(AttributeError, match="rename"):
        packed_digests(_model(1))
