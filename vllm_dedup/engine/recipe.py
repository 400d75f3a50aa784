"""Recipes: how one engine's final tensors came from its checkpoint, so that a later engine with
the same load signature maps them instead of reading the checkpoint (docs/architecture.md,
"Loading only what is not resident").

A recipe holds, for one load signature (`signature.py`):

- ``sources``: every checkpoint tensor the load read, name -> source key (`sources.py`);
- ``modules``: for each module owning parameters or buffers, the names of the checkpoint
  tensors its weight loaders got, and its final parameters and buffers after
  ``process_weights_after_loading``: each one a content key resident in a segment, its bytes
  inline (tensors too small to share), or an alias of a tensor of another module (tied
  weights);
- ``attrs``: the model attributes loading set (numbers, strings, booleans);
- ``final``: every content key it names, with its bytes (what the registry predicts from).

Post-processing is deterministic per module: equal inputs under an equal signature give equal
outputs.  So a module *matches* a checkpoint when the recipe's tensor names are the
checkpoint's and none of the tensors that went into the module changed; its final tensors can
then be mapped.  A module is *replayable* only when that reasoning holds for it: its sources were
recorded, its quantization method supports vLLM's pre-processed mode, and its post-processing
left all its state in tensors (on the CPU backend a linear layer repacked into oneDNN memory
does not).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field

import xxhash

__all__ = ["Match", "ModuleRecipe", "Recipe", "TensorRecipe", "build_recipe", "choose", "model_attrs",
           "unreplayable_reason"]

VERSION = 1


@dataclass
class TensorRecipe:
    """One final parameter or buffer of a module.  Exactly one of ``key``, ``inline`` and
    ``alias`` is set.

    Attributes:
        name: its attribute name in the module.
        param: a parameter (else a buffer).
        dtype, shape, stride: its layout (torch dtype name; elements).
        key: the content key of its resident copy in a segment.
        inline: its bytes, for tensors too small to share.
        alias: ``"module.name"`` of the tensor it is (tied weights).
    """

    name: str
    param: bool
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    key: str | None = None
    inline: bytes | None = None
    alias: str | None = None

    @property
    def nbytes(self) -> int:
        import torch

        if not all(self.shape):
            return 0
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return span * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_json(self) -> dict:
        out = {"name": self.name, "param": self.param, "dtype": self.dtype, "shape": list(self.shape),
               "stride": list(self.stride)}
        if self.key is not None:
            out["key"] = self.key
        if self.inline is not None:
            out["inline"] = base64.b64encode(self.inline).decode()
        if self.alias is not None:
            out["alias"] = self.alias
        return out

    @classmethod
    def from_json(cls, d: dict) -> TensorRecipe:
        return cls(d["name"], bool(d["param"]), d["dtype"], tuple(d["shape"]), tuple(d["stride"]), d.get("key"),
                   base64.b64decode(d["inline"]) if "inline" in d else None, d.get("alias"))


@dataclass
class ModuleRecipe:
    """One module: the checkpoint tensors that went into it and its final tensors."""

    sources: list[str]
    tensors: list[TensorRecipe]
    replayable: bool = True
    why: str = ""  # why not replayable

    def to_json(self) -> dict:
        return {"sources": sorted(self.sources), "tensors": [t.to_json() for t in self.tensors],
                "replayable": self.replayable, "why": self.why}

    @classmethod
    def from_json(cls, d: dict) -> ModuleRecipe:
        return cls(list(d["sources"]), [TensorRecipe.from_json(t) for t in d["tensors"]], bool(d["replayable"]),
                   d.get("why", ""))


@dataclass
class Recipe:
    """A load signature's recipe (module docstring).  ``unattributed``: checkpoint tensors the
    load read that no recorded weight loader got (unused by the model, or loaded some other
    way: a change to one of them rules the recipe out)."""

    signature: str
    sources: dict[str, str]
    modules: dict[str, ModuleRecipe]
    attrs: dict = field(default_factory=dict)
    unattributed: list[str] = field(default_factory=list)
    replayable: bool = True
    why: str = ""

    @property
    def id(self) -> str:
        """Identity of the checkpoint content it was made from (a recipe with the same id
        replaces this one in the registry)."""
        return xxhash.xxh3_64_hexdigest(json.dumps(sorted(self.sources.items())).encode())

    def final(self) -> dict[str, int]:
        """Every content key the recipe names -> its bytes."""
        return {t.key: t.nbytes for m in self.modules.values() for t in m.tensors if t.key is not None}

    def to_bytes(self) -> bytes:
        return json.dumps({
            "version": VERSION, "signature": self.signature, "id": self.id, "sources": self.sources,
            "modules": {name: m.to_json() for name, m in self.modules.items()}, "attrs": self.attrs,
            "unattributed": sorted(self.unattributed), "replayable": self.replayable, "why": self.why,
            "final": self.final(),
        }, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Recipe:
        """Raises:
            ValueError: not a recipe of this version."""
        try:
            d = json.loads(data)
            if d.get("version") != VERSION:
                raise ValueError(f"recipe version {d.get('version')!r}, expected {VERSION}")
            return cls(d["signature"], dict(d["sources"]),
                       {name: ModuleRecipe.from_json(m) for name, m in d["modules"].items()}, dict(d["attrs"]),
                       list(d["unattributed"]), bool(d["replayable"]), d.get("why", ""))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a recipe ({type(e).__name__}: {e})") from None


# building ------------------------------------------------------------------------------------
def unreplayable_reason(module) -> str | None:
    """Why this module's post-processing cannot be replayed from its final tensors, or None."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.platforms import current_platform

    quant_method = getattr(module, "quant_method", None)
    if isinstance(quant_method, QuantizeMethodBase) and not quant_method.supports_pre_processed_weights:
        return f"{type(quant_method).__name__} does not support pre-processed weights"
    if (current_platform.is_cpu() and isinstance(module, LinearBase)
            and not getattr(module, "_cpu_skip_gemm_dispatch", False)):
        return "on the CPU backend its weight is repacked into oneDNN memory (cpu_share_linear=false)"
    return None


def model_attrs(model) -> dict:
    """The model's own public attributes whose values are numbers, strings, booleans or None."""
    return {k: v for k, v in vars(model).items()
            if not k.startswith("_") and (v is None or isinstance(v, (bool, int, float, str)))}


def build_recipe(model, signature: str, sources: dict[str, str], module_sources: dict[str, set[str]],
                 unrecorded: dict[str, str], placement: dict[int, str], inline_max: int, attrs_before: dict,
                 inherited: dict[str, ModuleRecipe] | None = None) -> Recipe:
    """The recipe of a loaded, post-processed and shared model.

    Args:
        model: the model, after `share.share_model`.
        signature: its load signature.
        sources: checkpoint tensor name -> source key, for every tensor the load read (or, for
            a partial load, every tensor of the checkpoint).
        module_sources, unrecorded: from the `sources.SourceRecorder` of the load.
        placement: ``id`` of a tensor bound in the model -> its content key in a segment.
        inline_max: tensors of at most this many bytes (and private) are stored inline.
        attrs_before: `model_attrs` before ``load_weights`` (what loading set is the difference).
        inherited: modules mapped from an earlier recipe, taken over as they are.
    """
    inherited = inherited or {}
    modules: dict[str, ModuleRecipe] = {}
    owner: dict[int, str] = {}  # id(tensor) -> "module.name" of its first place
    for module_name, module in model.named_modules():
        tensors = [(n, t, True) for n, t in module._parameters.items() if t is not None]
        tensors += [(n, t, False) for n, t in module._buffers.items() if t is not None]
        for n, t, _ in tensors:
            owner.setdefault(id(t), _qualified(module_name, n))
        if not tensors:
            continue
        if module_name in inherited:
            modules[module_name] = inherited[module_name]
            continue
        owns_params = any(is_param and owner[id(t)] == _qualified(module_name, n) for n, t, is_param in tensors)
        why = unrecorded.get(module_name) or unreplayable_reason(module)
        if not why and owns_params and not module_sources.get(module_name):
            why = "its parameters were filled without a weight loader call"
        recipe = ModuleRecipe(sorted(module_sources.get(module_name, ())), [], True, "")
        for n, t, is_param in tensors:
            qualified = _qualified(module_name, n)
            entry = TensorRecipe(n, is_param, str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()))
            if owner[id(t)] != qualified:
                entry.alias = owner[id(t)]
            elif id(t) in placement:
                entry.key = placement[id(t)]
            elif t.is_meta:
                why = why or f"{n} was never materialized"
            elif t.is_contiguous() and t.numel() * t.element_size() <= inline_max:
                entry.inline = bytes(_host_bytes(t))
            else:
                why = why or (f"{n} ({t.numel() * t.element_size()} bytes) is neither in a segment nor small "
                              "enough to keep in the recipe")
            recipe.tensors.append(entry)
        recipe.replayable, recipe.why = not why, why or ""
        modules[module_name] = recipe
    attributed = set().union(*module_sources.values(), *(m.sources for m in inherited.values()))
    after = model_attrs(model)
    attrs = {k: v for k, v in after.items() if attrs_before.get(k, object()) != v}
    whole_why = ("the model has its own process_weights_after_loading (it may combine modules)"
                 if callable(getattr(type(model), "process_weights_after_loading", None)) else "")
    return Recipe(signature, dict(sources), modules, attrs, sorted(set(sources) - attributed), not whole_why,
                  whole_why)


def _qualified(module_name: str, name: str) -> str:
    return f"{module_name}.{name}" if module_name else name


def _host_bytes(t) -> memoryview:
    from ..content.views import tensor_bytes

    return tensor_bytes(t.detach().cpu().contiguous())


# matching ------------------------------------------------------------------------------------
@dataclass
class Match:
    """What a recipe gives a checkpoint: the modules to map and those to load.

    Attributes:
        recipe: the recipe chosen.
        matched: names of the modules whose final tensors are mapped (or restored inline).
        unmatched: names of the modules loaded from the checkpoint, with why.
        mapped_bytes: bytes of the matched modules' tensors that live in segments.
    """

    recipe: Recipe
    matched: set[str]
    unmatched: dict[str, str]
    mapped_bytes: int

    def read(self) -> set[str]:
        """Checkpoint tensor names the unmatched modules need."""
        return set().union(*(self.recipe.modules[m].sources for m in self.unmatched)) if self.unmatched else set()

    def demote(self, module: str, why: str) -> None:
        """Load ``module`` from the checkpoint after all (e.g. a tensor of it is not resident)."""
        if module in self.matched:
            self.matched.discard(module)
            self.unmatched[module] = why
            self.mapped_bytes -= sum(t.nbytes for t in self.recipe.modules[module].tensors if t.key)


def choose(recipes: list[Recipe], checkpoint: dict[str, str]) -> tuple[Match | None, str]:
    """The recipe that maps the most bytes of this checkpoint, and its match; or (None, why).

    Args:
        recipes: candidates of this engine's load signature, newest first.
        checkpoint: the checkpoint's tensor name -> source key.
    """
    best, why = None, "no recipe for this load signature yet"
    for recipe in recipes:
        if not recipe.replayable:
            why = f"the recipe cannot be replayed: {recipe.why}"
            continue
        if set(recipe.sources) != set(checkpoint):
            why = "the checkpoint's tensor names differ from the recipe's"
            continue
        changed = {n for n, k in checkpoint.items() if recipe.sources[n] != k}
        if changed & set(recipe.unattributed):
            why = "a changed checkpoint tensor went into no recorded module"
            continue
        matched, unmatched = set(), {}
        for name, module in recipe.modules.items():
            if not module.replayable:
                unmatched[name] = module.why
            elif changed & set(module.sources):
                unmatched[name] = "its checkpoint tensors changed"
            else:
                matched.add(name)
        mapped = sum(t.nbytes for m in matched for t in recipe.modules[m].tensors if t.key)
        if matched and (best is None or mapped > best.mapped_bytes):
            best = Match(recipe, matched, unmatched, mapped)
    return best, "" if best else why
