"""What a module keeps outside its parameters and buffers: the one walker over its attributes.

Kernels read more than ``_parameters`` and ``_buffers``: a module's own attributes (a tensor
computed at construction), the plain vLLM objects it holds (an attention layer's ``impl``
keeps ``sinks``), and closures (vLLM's CPU GEMM dispatch keeps the weight or its oneDNN
handler in a layer's ``cpu_linear``).  Four steps look there: the tensors a model must not
leave on the meta device (`slots.attribute_tensors`), the references a replay reties
(`replay.py`), the attribute tensors a recipe keeps (`recipe_builder.py`) and the oneDNN
handlers a model holds (`onednn/model.py`).  They all walk with `module_attributes`.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["RUNTIME_STATE", "Attribute", "closure_contents", "module_attributes"]

RUNTIME_STATE = frozenset({"kv_cache"})  # attributes serving writes (the KV cache): not weights
_TABLES = frozenset({"_parameters", "_buffers", "_modules"})  # what nn.Module itself keeps
# Note [inert values]
#     Every caller of `module_attributes` looks for a tensor, a callable (a closure) or an
#     object (a oneDNN handler, a vLLM object to walk into), and none looks inside a
#     container.  A value of these exact types is none of them, so it is not yielded: in a vLLM
#     model they are most attributes (SmolLM2's: 9,421 of 10,120, nn.Module's hook dicts, flags
#     and sizes), and leaving them out made each walk of it 0.03 s faster.  The types are
#     looked up by ``id``: hashing a value's type calls its metaclass, which may refuse.
_INERT_TYPE_IDS = frozenset(map(id, (type(None), bool, int, float, complex, str, bytes, list, tuple, set, frozenset,
                                     dict, collections.OrderedDict, torch.dtype, torch.device)))


class Attribute(NamedTuple):
    """One attribute found: ``getattr(owner, name) is value``; ``path`` names it from the
    module (``"impl.sinks"``).  A tuple, not a dataclass: a model's walk makes tens of
    thousands of them, and a frozen dataclass costs several times more to make."""

    owner: object
    name: str
    value: object
    path: str


def module_attributes(module, max_depth: int = 1, skip: frozenset = RUNTIME_STATE) -> Iterator[Attribute]:
    """Every attribute of ``module`` itself (not its parameters, buffers or child modules, not
    the names in ``skip``, not dunder names, not scalars, strings, dtypes or containers: Note
    [inert values]), then, up to ``max_depth`` levels down, of the plain vLLM objects it holds
    (instances of classes from ``vllm.*`` that are neither modules, tensors nor classes).
    Parents come before what they hold; a snapshot of each object's attributes is walked, so a
    caller may ``setattr`` on an owner while walking.
    """

    def walk(obj, prefix: str, depth: int):
        for name, value in list(vars(obj).items()):
            if (id(type(value)) in _INERT_TYPE_IDS or name in _TABLES or name in skip or name.startswith("__")
                    or isinstance(value, nn.Module)):
                continue
            yield Attribute(obj, name, value, prefix + name)
            if (depth < max_depth and hasattr(value, "__dict__") and not isinstance(value, (type, torch.Tensor))
                    and type(value).__module__.startswith("vllm")):
                yield from walk(value, f"{prefix}{name}.", depth + 1)

    yield from walk(module, "", 0)


def closure_contents(value) -> Iterator[tuple[int, object]]:
    """``(index, content)`` of each filled cell of a function's closure (nothing for anything
    else): where vLLM's CPU GEMM dispatch keeps a layer's weight or oneDNN handler."""
    if not callable(value):
        return
    for i, cell in enumerate(getattr(value, "__closure__", None) or ()):
        try:
            yield i, cell.cell_contents
        except ValueError:  # an empty cell
            continue
