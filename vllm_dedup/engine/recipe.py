"""Recipes: how one engine's final tensors came from its checkpoint, so that a later engine with
the same load signature maps them instead of reading the checkpoint (docs/architecture.md,
"Loading only what is not resident").

A recipe holds, for one load signature (`signature.py`):

- ``sources``: every checkpoint tensor the load read, name -> source key (BLAKE3-256,
  `sources.py`);
- ``modules``: for each module owning parameters or buffers, the names of the checkpoint
  tensors its weight loaders got, and its final parameters and buffers after
  ``process_weights_after_loading``: each one a content key resident in a named segment (the
  segment the recipe's maker published or mapped, by uid), its bytes inline (tensors too small
  to share), an alias of a tensor of another module (tied weights), or a view into the storage
  of one (`TensorRecipe.view`);
- ``attrs``: the model attributes loading set (numbers, strings, booleans);
- ``final``: every content key it names, with its bytes (what the registry predicts from).

Post-processing is deterministic per module: equal inputs under an equal signature give equal
outputs.  Two properties of a module decide what a recipe may do with it:

- **replayable**: its final tensors are all of its state, and its post-processing can run in
  vLLM's pre-processed mode.  Not so for a quantization method without pre-processed support,
  or a CPU linear layer whose weight vLLM packed into oneDNN memory and dropped, unless that
  packed weight is itself in a segment (``cpu_linear="packed"``): the recipe then names it
  (``packed``), and a replay lets vLLM pack a placeholder of zero pages, then installs the
  segment in its place (`replay.py`).  A module that is not replayable is never mapped;
- **traced**: the checkpoint tensors that went into it are exactly its recorded sources: every
  parameter it owns was filled from checkpoint tensors the load traced, by storage identity or
  through the torch calls of ``load_weights`` (`sources.SourceRecorder`, `provenance.py`), and
  nothing else wrote into it.  Only a traced module can be loaded on its own (from its
  sources), or mapped while some of the checkpoint changed.  An untraced, replayable module is
  mapped only when the whole checkpoint is unchanged, where every input is equal whatever it
  was.  A traced module is *eager* when ``load_weights`` writes it whatever it is fed (a copy
  from another parameter after the loop): it is loaded whenever anything is.

`choose` picks the recipe that maps the most, or says why none applies; anything a recipe
cannot do exactly is declined (`RecipeDeclined`), and the engine loads as usual.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field

import blake3

from ..content.views import contiguous_stride, element_span, squeezed_layout

__all__ = ["Match", "ModuleRecipe", "Recipe", "RecipeDeclined", "TensorRecipe", "choose", "match"]

VERSION = 6  # 2: segments named by uid, traced modules, BLAKE3 source keys; 3: oneDNN packed weights;
#             4: an unreplayable module's tensors may have no place (private), `checked_bytes`;
#             5: views (`TensorRecipe.view`); 6: eager modules (`ModuleRecipe.eager`)


class RecipeDeclined(Exception):
    """A recipe cannot serve this load exactly; the message says why.  The engine loads as
    usual (and holds nothing the recipe made it acquire)."""


@dataclass
class TensorRecipe:
    """One final parameter or buffer of a module.  Exactly one of ``key``, ``inline`` and
    ``alias`` is set, or none for a tensor that stays private in a module that is not
    replayable (its layout is recorded; a replay loads that module from the checkpoint).

    Attributes:
        name: its attribute name in the module.
        param: a parameter (else a buffer).
        dtype, shape, stride: its layout (torch dtype name; elements).
        key: the content key of its resident copy, in the segment ``uid``.
        uid: the segment the recipe's maker published the tensor in or mapped it from.
        inline: its bytes, for tensors too small to share.
        alias: ``"module.name"`` of the tensor it is (tied weights), or, with ``view``, of the
            tensor whose storage it views.
        view: an element offset: the tensor is a view of ``alias``'s storage at that offset
            from ``alias``'s first element, with its own shape and stride (MLA's ``W_UV`` of
            ``kv_b_proj.weight``: Note [views into a shared storage] in `slots.py`).  A replay
            binds it after post-processing, which may make it itself (`replay.py`).
        layout: of an inline oneDNN packed weight, what its content key's dtype would say
            (`packed.packed_dtype`): a replay checks it as it checks a key's.
    """

    name: str
    param: bool
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    key: str | None = None
    uid: str = ""
    inline: bytes | None = None
    alias: str | None = None
    layout: str = ""
    view: int | None = None

    @property
    def nbytes(self) -> int:
        import torch

        return element_span(self.shape, self.stride) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def fits(self, key: str, nbytes: int | None = None) -> bool:
        """Whether this tensor may be read from the ``nbytes`` bytes of content key ``key``
        (without ``nbytes``: the layout checks alone, as recipes are ranked, where the key is
        the recipe's own word and no segment's size is known yet): the key's element type (a oneDNN packed
        weight's key names its layout, and it is read as bytes: Note [a packed weight's content
        key] in `packed.py`), the key's own layout but for dimensions of size 1 (a causal-conv
        weight's (dim, 1, width) over the (dim, width) buffer that holds its bytes:
        `recipe_builder.conv_weight_recipe`), and every element it addresses (shape and
        non-negative strides, as ``as_strided`` would) inside those bytes.  A recipe is another
        engine's data: a layout that reads past its tensor's bytes, or reinterprets them as
        another type or shape, is refused."""
        import torch

        from ..content.keys import ContentKey

        try:
            parsed = ContentKey.parse(key)
            if squeezed_layout(self.shape, self.stride) != squeezed_layout(parsed.shape, parsed.stride):
                return False
            keyed = "uint8" if parsed.dtype.startswith("onednn:") else parsed.dtype
            if not isinstance(getattr(torch, self.dtype), torch.dtype) or keyed != self.dtype:
                return False
            if len(self.shape) != len(self.stride) or min((*self.shape, *self.stride), default=0) < 0:
                return False
            return nbytes is None or self.nbytes == nbytes  # the span of elements it reaches (`nbytes`), in bytes
        except (AttributeError, TypeError, ValueError, RuntimeError):
            return False

    def to_json(self) -> dict:
        out = {"name": self.name, "param": self.param, "dtype": self.dtype, "shape": list(self.shape),
               "stride": list(self.stride)}
        if self.key is not None:
            out["key"], out["uid"] = self.key, self.uid
        if self.inline is not None:
            out["inline"] = base64.b64encode(self.inline).decode()
        if self.alias is not None:
            out["alias"] = self.alias
        if self.layout:
            out["layout"] = self.layout
        if self.view is not None:
            out["view"] = self.view
        return out

    @classmethod
    def from_json(cls, d: dict, placed: bool = True) -> TensorRecipe:
        """Raises:
            ValueError: more than one of key, inline and alias; or none, where ``placed`` (a
                replayable module's tensor) asks for one; a view without an alias, or at a
                negative offset; inline bytes that are not exactly a dense tensor of its
                dtype and shape (`_check_inline`)."""
        t = cls(str(d["name"]), bool(d["param"]), str(d["dtype"]), tuple(int(x) for x in d["shape"]),
                tuple(int(x) for x in d["stride"]), d.get("key"), str(d.get("uid", "")),
                base64.b64decode(d["inline"]) if "inline" in d else None, d.get("alias"), str(d.get("layout", "")),
                int(d["view"]) if d.get("view") is not None else None)
        if not all(x is None or isinstance(x, str) for x in (t.key, t.alias)):
            raise ValueError(f"tensor {t.name!r}: a key and an alias are strings")
        places = sum(x is not None for x in (t.key, t.inline, t.alias))
        if places > 1 or (placed and places == 0):
            raise ValueError(f"tensor {t.name!r} must have exactly one of key, inline and alias"
                             + ("" if placed else ", or none"))
        if t.view is not None and (t.alias is None or t.view < 0 or any(x < 0 for x in t.stride)):
            raise ValueError(f"tensor {t.name!r}: a view names the tensor it views (alias), at an offset and "
                             "strides of at least 0")
        if t.inline is not None:
            t._check_inline()
        return t

    def _check_inline(self) -> None:
        """Inline bytes are a dense tensor's, as the builder keeps them (contiguous tensors
        only): a dense layout (strides of size-1 dimensions aside) and exactly its bytes.  A
        replay binds them with ``as_strided``; a peer's stride of 0 over a huge shape, or an
        overlapping one, would give a tensor no plain load has."""
        import torch

        if (not isinstance(getattr(torch, self.dtype, None), torch.dtype) or len(self.shape) != len(self.stride)
                or min(self.shape, default=0) < 0):
            raise ValueError(f"tensor {self.name!r}: inline bytes need a torch dtype and one stride per dimension")
        if all(self.shape) and squeezed_layout(self.shape, self.stride) != squeezed_layout(
                self.shape, contiguous_stride(self.shape)):
            raise ValueError(f"tensor {self.name!r}: inline bytes are a dense tensor's, not strided {self.stride}")
        if len(self.inline) != self.nbytes:  # dense: the span of its elements is all of them
            raise ValueError(f"tensor {self.name!r}: {len(self.inline)} inline bytes for {math.prod(self.shape)} "
                             f"{self.dtype} elements")


@dataclass
class ModuleRecipe:
    """One module: the checkpoint tensors that went into it and its final tensors (module
    docstring: replayable, traced).  ``attributes``: small tensors the module keeps in plain
    attributes since its construction (a weightless norm's ``weight`` of ones, empty state
    tensors), inline: a model built on the meta device has them on the meta device.
    ``packed``: the packed weight of the module's oneDNN handler (CPU backend), a uint8
    tensor of its bytes under its content key (`packed.py`), named after the weight it packs."""

    sources: list[str]
    tensors: list[TensorRecipe]
    replayable: bool = True
    why: str = ""  # why not replayable
    traced: bool = True
    why_untraced: str = ""
    attributes: list[TensorRecipe] = field(default_factory=list)
    packed: TensorRecipe | None = None
    eager: str = ""  # why ``load_weights`` writes it whatever it is fed ("": only when fed its sources)

    def to_json(self) -> dict:
        out = {"sources": sorted(self.sources), "tensors": [t.to_json() for t in self.tensors],
               "replayable": self.replayable, "why": self.why, "traced": self.traced,
               "why_untraced": self.why_untraced, "attributes": [t.to_json() for t in self.attributes],
               "eager": self.eager}
        if self.packed is not None:
            out["packed"] = self.packed.to_json()
        return out

    @classmethod
    def from_json(cls, d: dict) -> ModuleRecipe:
        attributes = [TensorRecipe.from_json(t) for t in d.get("attributes", [])]
        if any(t.inline is None for t in attributes):
            raise ValueError("a module's attribute tensors travel inline")
        packed = TensorRecipe.from_json(d["packed"]) if d.get("packed") is not None else None
        if packed is not None and (packed.alias is not None or packed.dtype != "uint8" or len(packed.shape) != 1
                                   or (packed.inline is not None and not packed.layout.startswith("onednn:"))):
            raise ValueError("a packed weight is a uint8 vector under a content key, or inline with its layout")
        replayable = bool(d["replayable"])
        tensors = [TensorRecipe.from_json(t, placed=replayable) for t in d["tensors"]]
        for kind, named in (("tensor", tensors), ("attribute", attributes)):
            if len({t.name for t in named}) != len(named):  # a replay would bind the last, the first left held
                raise ValueError(f"a module names a {kind} twice")
        return cls([str(s) for s in d["sources"]], tensors,
                   replayable, str(d.get("why", "")), bool(d["traced"]), str(d.get("why_untraced", "")),
                   attributes, packed, str(d.get("eager", "")))

    def keyed(self) -> list[TensorRecipe]:
        """Its tensors that live in segments, the packed weight included."""
        packed = [self.packed] if self.packed is not None and self.packed.key is not None else []
        return [t for t in self.tensors if t.key is not None] + packed

    def mapped_bytes(self) -> int:
        return sum(t.nbytes for t in self.keyed())


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
        replaces this one in the registry): BLAKE3 of its source keys."""
        return blake3.blake3(json.dumps(sorted(self.sources.items())).encode()).hexdigest()[:32]

    def final(self) -> dict[str, int]:
        """Every content key the recipe names -> its bytes."""
        return {t.key: t.nbytes for m in self.modules.values() for t in m.keyed()}

    def to_bytes(self) -> bytes:
        return json.dumps({
            "version": VERSION, "signature": self.signature, "id": self.id, "sources": self.sources,
            "modules": {name: m.to_json() for name, m in self.modules.items()}, "attrs": self.attrs,
            "unattributed": sorted(self.unattributed), "replayable": self.replayable, "why": self.why,
            "final": self.final(),
        }, separators=(",", ":")).encode()

    def checked_bytes(self) -> bytes:
        """`to_bytes`, read back by the parser every engine reads recipes with (`from_bytes`)
        and written again to the same bytes: the recipe contract, checked before a recipe is
        published, so that no engine publishes a recipe another refuses.

        Raises:
            ValueError: a reader would refuse this recipe, or read another one (says why).
        """
        data = self.to_bytes()
        if Recipe.from_bytes(data).to_bytes() != data:
            raise ValueError("the recipe does not read back as it was written")
        return data

    @classmethod
    def from_bytes(cls, data: bytes) -> Recipe:
        """Raises:
            ValueError: not a recipe of this version, or a malformed one."""
        try:
            d = json.loads(data)
            if d.get("version") != VERSION:
                raise ValueError(f"recipe version {d.get('version')!r}, expected {VERSION}")
            attrs = dict(d["attrs"])
            if not all(v is None or isinstance(v, (bool, int, float, str)) for v in attrs.values()):
                raise ValueError("recipe attributes must be numbers, strings, booleans or null")
            return cls(str(d["signature"]), {str(k): str(v) for k, v in d["sources"].items()},
                       {str(name): ModuleRecipe.from_json(m) for name, m in d["modules"].items()}, attrs,
                       [str(n) for n in d["unattributed"]], bool(d["replayable"]), str(d.get("why", "")))
        except (KeyError, TypeError, AttributeError, ValueError, OverflowError, RecursionError) as e:
            raise ValueError(f"not a recipe ({type(e).__name__}: {e})") from None


# matching ------------------------------------------------------------------------------------
@dataclass
class Match:
    """What a recipe gives a checkpoint: the modules to map and those to load.

    Invariant (`settle`): every module loaded is traced, no module mapped shares a checkpoint
    tensor with a module loaded (feeding that tensor to the model's ``load_weights`` would write
    into the mapped, read-only one, or leave it stale), and when any module is loaded, so is
    every eager one (``load_weights`` writes it whatever it is fed: BERT's MLM decoder, copied
    from the word embedding after the loop).

    Attributes:
        recipe: the recipe chosen.
        matched: names of the modules whose final tensors are mapped (or restored inline).
        unmatched: names of the modules loaded from the checkpoint, with why.
        mapped_bytes: bytes of the matched modules' tensors that live in segments.
    """

    recipe: Recipe
    matched: set[str]
    unmatched: dict[str, str]
    mapped_bytes: int = 0

    def read(self) -> set[str]:
        """Checkpoint tensor names the unmatched modules need."""
        return set().union(*(self.recipe.modules[m].sources for m in self.unmatched)) if self.unmatched else set()

    def demote(self, why: dict[str, str]) -> None:
        """Load these modules (name -> why) from the checkpoint after all (e.g. a tensor of
        theirs is not resident), and those they take with them: one `settle` for all.

        Raises:
            RecipeDeclined: a module to load cannot be loaded on its own.
        """
        for module, reason in why.items():
            if module in self.matched:
                self.matched.discard(module)
                self.unmatched[module] = reason
        self.settle()

    def settle(self) -> None:
        """Restore the invariant (class docstring): demote every mapped module that shares a
        checkpoint tensor with a loaded one, and so on, and every eager one once any module is
        loaded; recount the mapped bytes.  One pass over the sources through an index (a
        recipe is a peer's input: a chain of modules each sharing a name with the next, demoted
        one per pass over all modules, made a 2 MB recipe cost 12 s).

        Raises:
            RecipeDeclined: a module to load is not traced.
        """
        modules = self.recipe.modules
        mapped_by_source: dict[str, list[str]] = {}
        for m in self.matched:
            for s in modules[m].sources:
                mapped_by_source.setdefault(s, []).append(m)
        todo = list(self.read())
        seen = set(todo)

        def load(m: str, why: str) -> None:
            self.matched.discard(m)
            self.unmatched[m] = why
            todo.extend(s for s in modules[m].sources if s not in seen)
            seen.update(modules[m].sources)

        while True:
            while todo:
                for m in mapped_by_source.get(todo.pop(), ()):
                    if m in self.matched:
                        load(m, "it shares a checkpoint tensor with a module loaded from the checkpoint")
            eager = sorted(m for m in self.matched if modules[m].eager) if self.unmatched else []
            if not eager:
                break
            for m in eager:
                load(m, f"a partial load writes it ({modules[m].eager})")
        for name, why in sorted(self.unmatched.items()):
            if not modules[name].traced:
                raise RecipeDeclined(f"module {name} must be loaded ({why}) but cannot be loaded on its own: "
                                     f"{modules[name].why_untraced}")
        self.mapped_bytes = sum(modules[m].mapped_bytes() for m in self.matched)


def match(recipe: Recipe, checkpoint: dict[str, str]) -> Match:
    """What ``recipe`` gives the checkpoint with these source keys (name -> key).

    Raises:
        RecipeDeclined: it gives nothing exact (the message says why).
    """
    if not recipe.replayable:
        raise RecipeDeclined(f"the recipe cannot be replayed: {recipe.why}")
    if set(recipe.sources) != set(checkpoint):
        raise RecipeDeclined("the checkpoint's tensor names differ from the recipe's")
    changed = {n for n, k in checkpoint.items() if recipe.sources[n] != k}
    if changed & set(recipe.unattributed):
        raise RecipeDeclined("a changed checkpoint tensor went into no recorded module")
    if changed - set(recipe.unattributed).union(*(m.sources for m in recipe.modules.values())):
        raise RecipeDeclined("a changed checkpoint tensor is in none of the recipe's modules")
    found = Match(recipe, set(), {})
    for name, module in recipe.modules.items():
        # Checked before the recipes are ranked by the bytes they map (`choose`): a layout its
        # own key does not allow would count bytes no segment holds, and outrank a sound
        # recipe.  The replay would load the module (`TensorRecipe.fits` against the segment).
        # A key that lies with its layout is found out only there (nothing resident matches).
        misfit = next((t for t in module.keyed() if not t.fits(t.key)), None)
        if not module.replayable:
            found.unmatched[name] = module.why
        elif misfit is not None:
            found.unmatched[name] = f"its tensor {misfit.name}'s layout does not fit its content key"
        elif changed & set(module.sources):
            found.unmatched[name] = "its checkpoint tensors changed"
        elif changed and not module.traced:
            found.unmatched[name] = f"the checkpoint changed and its inputs are not known ({module.why_untraced})"
        else:
            found.matched.add(name)
    found.settle()
    if not found.matched:
        raise RecipeDeclined("it maps no module of this checkpoint")
    return found


def choose(recipes: list[Recipe], checkpoint: dict[str, str]) -> tuple[Match | None, str]:
    """The recipe that maps the most bytes of this checkpoint, and its match; or (None, why).

    Args:
        recipes: candidates of this engine's load signature, newest first.
        checkpoint: the checkpoint's tensor name -> source key.
    """
    best, why = None, "no recipe for this load signature yet"
    for recipe in recipes:
        try:
            found = match(recipe, checkpoint)
        except RecipeDeclined as e:
            why = str(e)
            continue
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a malformed recipe
            why = f"a recipe is malformed ({type(e).__name__}: {e})"
            continue
        if best is None or found.mapped_bytes > best.mapped_bytes:
            best = found
    return best, "" if best else why
