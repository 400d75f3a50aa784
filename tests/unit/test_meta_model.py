"""What a replay checks and undoes around the model it builds (`engine.meta_model`): a build given
up leaves no layer registered with vLLM, even one whose construction failed halfway, and no
tensor may still read a placeholder's zero pages once post-processing is over."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from vllm_dedup.engine.meta_model import check_no_meta, forget_layers, registered_layers
from vllm_dedup.engine.packed import ZeroPages
from vllm_dedup.engine.recipe import RecipeDeclined


def test_a_build_given_up_halfway_leaves_no_layer_registered():
    cc = types.SimpleNamespace(static_forward_context={"model.layers.0.attn": object()},
                               static_all_moe_layers=["model.layers.0.mlp"])
    config = types.SimpleNamespace(compilation_config=cc)
    before = registered_layers(config)
    # A construction that registered two layers, then raised: no model to ask which they were.
    cc.static_forward_context["model.layers.1.attn"] = object()
    cc.static_all_moe_layers.append("model.layers.1.mlp")
    forget_layers(config, before)
    assert list(cc.static_forward_context) == ["model.layers.0.attn"]
    assert cc.static_all_moe_layers == ["model.layers.0.mlp"]


def test_a_tensor_left_over_a_placeholder_declines_the_replay():
    zeros = ZeroPages()
    layer = nn.Module()
    layer.weight = nn.Parameter(zeros.tensor(torch.bfloat16, torch.Size((64, 4096))), requires_grad=False)
    assert zeros.holds(layer.weight) and not zeros.holds(torch.zeros(4))
    check_no_meta(layer)  # without the predicate, only meta tensors count
    with pytest.raises(RecipeDeclined, match="weight is still a placeholder reading zeros"):
        check_no_meta(layer, zeros.holds)
    layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)  # what vLLM leaves once it packed it
    check_no_meta(layer, zeros.holds)
    longer = zeros.tensor(torch.float32, torch.Size((2, 1 << 20)))  # a new, longer mapping
    assert zeros.holds(longer) and zeros.holds(layer.weight) is False
