"""A model built on the meta device, given real tensors afterwards (the replay's model).

Nothing is allocated when a model is built under ``torch.device("meta")``; the replay then puts a
real tensor in each place.  These helpers keep the rest of the model pointing at the real one:
a replacement keeps the class and attributes of the meta parameter it replaces (vLLM's
``materialize_meta_tensor`` does the same), every other reference to a replaced meta tensor is
repointed, and a model given up leaves nothing behind in vLLM's process-wide tables.
"""

from __future__ import annotations

import torch
from torch import nn

from .attributes import module_attributes
from .recipe import RecipeDeclined
from .slots import attribute_tensors

__all__ = ["check_no_meta", "forget_layers", "like_meta", "registered_layers", "retie", "rope_cache"]


def like_meta(meta, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a parameter of ``meta``'s class with its attributes (a new parameter when
    there is no meta one)."""
    if meta is None:
        return nn.Parameter(tensor, requires_grad=False)
    new = tensor.detach()
    new.__class__ = meta.__class__
    new.__dict__ = meta.__dict__.copy()
    return new


def retie(model: nn.Module, replaced: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Point every remaining reference to a replaced meta tensor at its replacement: parameters
    and buffers of other modules (ties made at construction), module attributes, and attributes
    of the plain objects modules hold (an attention implementation keeps ``sinks``).
    ``replaced`` keeps each meta tensor alive, so an ``id`` here names that tensor and no other."""
    def fresh(value):
        return (isinstance(value, torch.Tensor) and id(value) in replaced and replaced[id(value)][0] is value)

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for n, t in list(table.items()):
                if fresh(t):
                    table[n] = replaced[id(t)][1]
        for a in module_attributes(module):
            if fresh(a.value):
                setattr(a.owner, a.name, replaced[id(a.value)][1])


def check_no_meta(model: nn.Module, placeholder=None) -> None:
    """Raises `RecipeDeclined` naming the first meta tensor a kernel could read, or, with
    ``placeholder`` (a predicate: `packed.ZeroPages.holds`), the first tensor still over a
    placeholder's zero pages: vLLM drops a linear layer's own weight once it packed it, and
    any other reference to it left behind would read zeros."""
    def left(t) -> str:
        if t.is_meta:
            return "on the meta device"
        return "a placeholder reading zeros" if placeholder is not None and placeholder(t) else ""

    for name, module in model.named_modules():
        for n, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None and (why := left(t)):
                raise RecipeDeclined(f"{name}.{n} is still {why} after post-processing")
    for where, t in attribute_tensors(model):
        if why := left(t):
            raise RecipeDeclined(f"{where} is still {why} after post-processing")


def registered_layers(vllm_config) -> tuple[set[str], int]:
    """What vLLM's compilation config has registered so far: the names in its static forward
    context, and how many MoE layer names it lists (`forget_layers` goes back to it)."""
    cc = vllm_config.compilation_config
    return set(cc.static_forward_context), len(getattr(cc, "static_all_moe_layers", ()))


def forget_layers(vllm_config, before: tuple[set[str], int]) -> None:
    """Unregister the layers a model given up registered since ``before``
    (`registered_layers`): attention layers register by name in vLLM's static forward context
    as they are constructed, MoE layers in its list, and the usual load builds them again.
    Taken from the names, not from the model, so that a construction that failed halfway
    leaves nothing either."""
    names, moe = before
    cc = vllm_config.compilation_config
    for name in [n for n in cc.static_forward_context if n not in names]:
        del cc.static_forward_context[name]
    moe_layers = getattr(cc, "static_all_moe_layers", None)
    if moe_layers is not None:
        del moe_layers[moe:]


class Registrations:
    """What building a model registers process-wide in vLLM, as it is when this is made: the
    layers in the compilation config (`registered_layers`) and the rotary modules `get_rope`
    caches (`rope_cache`).  `undo` goes back to it, for a model given up whose replacement is
    built next in the same process (vLLM refuses a layer name registered twice: "Duplicate
    layer name"; a cached rotary module may have been built on the meta device, or moved into
    a segment since)."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.layers = registered_layers(vllm_config)
        self.ropes = dict(rope_cache())

    def undo(self) -> None:
        forget_layers(self.vllm_config, self.layers)
        ropes = rope_cache()
        ropes.clear()
        ropes.update(self.ropes)


def rope_cache() -> dict:
    """vLLM's process-wide cache of rotary embedding modules (``get_rope`` hands the same module
    to every model built with the same parameters, whatever the device it was built on)."""
    try:
        from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT
    except ImportError:
        return {}
    return _ROPE_DICT
