"""Building a recipe: what one loaded, post-processed and shared model's modules became (the
data it fills in, and how a later engine matches it, are in `recipe.py`).

A module's entry says whether it is replayable (`unreplayable_reason`), and, on vLLM's CPU
backend with packed weights shared (``cpu_linear="packed"``, or ``vllm``), names its oneDNN handler's packed weight
(`packed_recipe`), so a replay can put the segment back in place of a placeholder's packing.
A causal-conv weight that vLLM's CPU path packed for its kernel is recorded as the weight it
was before (`conv_weight_recipe`): a replay binds that, and vLLM packs it again.
"""

from __future__ import annotations

from ..content.views import element_span, squeezed_layout
from .attributes import module_attributes
from .recipe import ModuleRecipe, Recipe, TensorRecipe
from .slots import covers_storage, storage_id

__all__ = ["PLAIN_TYPES", "build_recipe", "conv_weight_recipe", "model_attrs", "packed_recipe", "unpacked_conv_weight",
           "unreplayable_reason"]


def unpacked_conv_weight(module):
    """The (dim, 4) copy vLLM's CPU path kept of ``module``'s causal-conv weight before it packed
    it (`vllm_facts.CPU_UNPACKED_CONV_WEIGHT`), or None where it packed none."""
    import torch

    from .vllm_facts import CPU_UNPACKED_CONV_WEIGHT

    t = vars(module).get(CPU_UNPACKED_CONV_WEIGHT)
    return t if isinstance(t, torch.Tensor) and t.ndim == 2 and not t.is_meta else None


def unreplayable_reason(module, packed_in_segment: bool = False) -> str | None:
    """Why this module's post-processing cannot be replayed from its final tensors, or None.
    ``packed_in_segment``: the packed weight of its oneDNN handler is in a segment
    (`packed_recipe`)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.platforms import current_platform

    quant_method = getattr(module, "quant_method", None)
    if isinstance(quant_method, QuantizeMethodBase) and not quant_method.supports_pre_processed_weights:
        return f"{type(quant_method).__name__} does not support pre-processed weights"
    if getattr(module, "is_amx_bmm_enabled", False):  # MLAAttention on AMX (v1/attention/backends/mla/amx_mla.py)
        return ("MLA on AMX packs W_UK and W_UV into its implementation and drops kv_b_proj's weight, where a "
                "recipe cannot follow")
    if not current_platform.is_cpu():
        return None
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from .onednn import holds_handler

    if packed_in_segment or unpacked_conv_weight(module) is not None:
        return None  # a replay installs the packed segment, or binds the conv weight vLLM packs again
    if ((isinstance(module, LinearBase) and not getattr(module, "_cpu_skip_gemm_dispatch", False))
            or (holds_handler(module) and not isinstance(module, VocabParallelEmbedding))):
        # An embedding keeps its weight and packs it again when replayed (its post-processing
        # ignores the pre-processed mode); a linear's weight is gone once packed.
        return ("on the CPU backend vLLM repacked its weight where a recipe cannot follow (a oneDNN handler "
                "whose packed weight is not in a segment, or another CPU packing)")
    return None


def packed_recipe(module, placement: dict, inline_max: int = 0) -> tuple[TensorRecipe | None, str]:
    """The recipe entry of the packed weight of ``module``'s own oneDNN handler, if a replay can
    make it again: one handler, made by vLLM's unquantized linear method from the module's
    ``weight`` (so a placeholder of that shape packs to the same layout), its packed weight in a
    segment (``placement[id(handler)]``) or, up to ``inline_max`` bytes (a router's gate),
    inline.  A vocabulary embedding (or head) keeps its weight, and a replay packs that again:
    its entry (only when in a segment) lets the replay put the segment in place at once, after an
    exact compare; without one, or when the bytes differ (a tied head's embedding loaded from a
    changed checkpoint), the sharing pass keys and maps the packed copy.  Returns (entry or None,
    why not; "" when the module has no handler, or is an embedding whose copy is in no segment)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from ..errors import PackedWeightError
    from .onednn import find_packed, module_handlers

    handlers = module_handlers(module)
    quant_method = getattr(module, "quant_method", None)
    embedding = isinstance(quant_method, UnquantizedEmbeddingMethod)
    if not handlers or (embedding and (len(handlers) != 1 or id(handlers[0]) not in placement)):
        return None, ""
    if len(handlers) != 1:
        return None, f"it holds {len(handlers)} oneDNN handlers"
    if not isinstance(quant_method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
        return None, f"its oneDNN handler comes from {type(quant_method).__name__}"
    try:
        packed = find_packed(handlers[0])
    except PackedWeightError as e:
        return None, f"its packed weight cannot be read ({e})"
    where = placement.get(id(handlers[0]))
    if where is not None:
        return TensorRecipe("weight", True, "uint8", (packed.nbytes,), (1,), key=where.key, uid=where.uid), ""
    if packed.nbytes <= inline_max:
        from .packed import packed_dtype

        return TensorRecipe("weight", True, "uint8", (packed.nbytes,), (1,), inline=bytes(packed.view()),
                            layout=packed_dtype(packed.layout)), ""
    return None, "its packed weight is not in a segment"


def conv_weight_recipe(unpacked, placed: dict[tuple, list], inline_max: int) -> tuple[TensorRecipe | None, str]:
    """The recipe entry of a causal-conv layer's ``weight`` as it was before vLLM's CPU path
    packed it: shape (dim, 1, width), contiguous, bf16, with the bytes of ``unpacked`` (its
    (dim, width) copy, `unpacked_conv_weight`).  A replay binds it and vLLM's post-processing
    packs it again, exactly as the first load did (the packing is deterministic, and the packed
    tensor is a few KiB per layer).

    The bytes come from a tensor in a segment that holds them (``placed``: (dtype, numel) ->
    [(tensor, its placement)]; Mamba2's mixer keeps its ``conv_weights`` buffer over the weight's
    storage from before the packing), compared exactly; its content key then names a (dim,
    width) layout of the same bytes, which the replay reads as (dim, 1, width).  Else they are
    kept inline, up to ``inline_max`` bytes.  Returns (entry or None, why not)."""
    import torch

    dim, width = unpacked.shape
    entry = TensorRecipe("weight", True, str(unpacked.dtype).removeprefix("torch."), (dim, 1, width),
                         (width, width, 1))
    flat = unpacked.reshape(-1)
    layout = squeezed_layout(entry.shape, entry.stride)
    for t, where in placed.get((unpacked.dtype, unpacked.numel()), ()):
        # Of that layout but for size-1 dimensions: a replay binds a key only so (`TensorRecipe.fits`).
        if squeezed_layout(t.shape, t.stride()) == layout and torch.equal(t.reshape(-1), flat):
            entry.key, entry.uid = where.key, where.uid
            return entry, ""
    nbytes = unpacked.numel() * unpacked.element_size()
    if nbytes <= inline_max:
        entry.inline = bytes(_host_bytes(unpacked))
        return entry, ""
    return None, (f"its causal-conv weight before vLLM packed it ({nbytes} bytes) is neither in a segment nor small "
                  "enough to keep in the recipe")


PLAIN_TYPES = (type(None), bool, int, float, str)  # the model attributes a recipe records and sets


def model_attrs(model) -> dict:
    """The model's own public attributes whose values are numbers, strings, booleans or None."""
    return {k: v for k, v in vars(model).items() if not k.startswith("_") and isinstance(v, PLAIN_TYPES)}


def build_recipe(model, signature: str, sources: dict[str, str], recording, placement: dict, inline_max: int,
                 attrs_before: dict, inherited: dict[str, ModuleRecipe] | None = None) -> Recipe:
    """The recipe of a loaded, post-processed and shared model.

    Args:
        model: the model, after `share.share_model`.
        signature: its load signature.
        sources: checkpoint tensor name -> source key, for every tensor the load read (or, for
            a partial load, every tensor of the checkpoint).
        recording: the `sources.SourceRecorder` of the load (its ``module_sources`` and
            ``untraced``).
        placement: ``id`` of a tensor bound in the model -> its `context.Placement`.
        inline_max: tensors of at most this many bytes (private, or in a segment: post-processing
            may write them) are stored inline.
        attrs_before: `model_attrs` before ``load_weights`` (what loading set is the difference).
        inherited: modules mapped from an earlier recipe, taken over as they are.
    """
    from .vllm_facts import CPU_UNPACKED_CONV_WEIGHT

    inherited = inherited or {}
    modules: dict[str, ModuleRecipe] = {}
    owner, bases = _owners_and_bases(model, placement)
    placed = None  # (dtype, numel) -> placed contiguous tensors: made for the first packed conv
    for module_name, module in model.named_modules():
        tensors = [(n, t, True) for n, t in module._parameters.items() if t is not None]
        tensors += [(n, t, False) for n, t in module._buffers.items() if t is not None]
        attributes = _attribute_tensors(module)
        if not tensors and not attributes:
            continue
        if module_name in inherited:
            modules[module_name] = inherited[module_name]
            continue
        packed, why_packed = packed_recipe(module, placement, inline_max)
        why = unreplayable_reason(module, packed_in_segment=packed is not None)
        if why and why_packed:
            why = f"{why} ({why_packed})"
        conv = unpacked_conv_weight(module)
        if conv is not None:
            attributes = [(n, t) for n, t in attributes if n != CPU_UNPACKED_CONV_WEIGHT]  # post-processing remakes it
            if placed is None:
                placed = _placed_by_size(model, placement)
            conv_entry, why_conv = conv_weight_recipe(conv, placed, inline_max)
            why = why or why_conv
        untraced = recording.untraced.get(module_name, "")
        recipe = ModuleRecipe(sorted(recording.module_sources.get(module_name, ())), [], packed=packed)
        for n, t in attributes:
            nbytes = t.numel() * t.element_size()
            if t.is_meta or not t.is_contiguous() or nbytes > inline_max:
                why = why or f"its attribute {n} ({nbytes} bytes) cannot be kept in the recipe"
            else:
                recipe.attributes.append(TensorRecipe(n, False, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                                      tuple(t.stride()), inline=bytes(_host_bytes(t))))
        for n, t, is_param in tensors:
            if conv is not None and conv_entry is not None and is_param and n == "weight":
                recipe.tensors.append(conv_entry)
                continue
            qualified = _qualified(module_name, n)
            entry = TensorRecipe(n, is_param, str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()))
            if owner[id(t)] != qualified:
                entry.alias = owner[id(t)]
            elif id(t) in placement and t.is_contiguous() and t.numel() * t.element_size() <= inline_max:
                # Kept inline, not mapped, though in a segment: post-processing may write it
                # whatever the pre-processed mode (attention's 4-byte scales, ``fill_(1.0)``,
                # published under ``min_tensor_bytes`` 4), and a replay would refuse that write
                # into a mapping (`provenance.WriteGuard`) and decline every time.
                entry.inline = bytes(_host_bytes(t))
            elif id(t) in placement:
                entry.key, entry.uid = placement[id(t)].key, placement[id(t)].uid
            elif (viewed := _view_of(t, bases)) is not None:
                entry.alias, entry.view = viewed
            elif t.is_meta:
                why = why or f"{n} was never materialized"
            elif t.is_contiguous() and t.numel() * t.element_size() <= inline_max:
                entry.inline = bytes(_host_bytes(t))
            else:
                why = why or (f"{n} ({t.numel() * t.element_size()} bytes) is neither in a segment nor small "
                              "enough to keep in the recipe")
            recipe.tensors.append(entry)
        recipe.replayable, recipe.why = not why, why or ""
        recipe.traced, recipe.why_untraced = not untraced, untraced
        recipe.eager = recording.eager.get(module_name, "")
        modules[module_name] = recipe
    _tie_to_what_was_compared(modules, inherited)
    # Only what the recipe's modules name: a module left without a tensor (post-processing
    # dropped them all) is in no entry, and a change to its sources must rule the recipe out.
    attributed = set().union(*(m.sources for m in modules.values()))
    after = model_attrs(model)
    attrs = {k: v for k, v in after.items() if attrs_before.get(k, object()) != v}
    whole_why = ("the model has its own process_weights_after_loading (it may combine modules)"
                 if callable(getattr(type(model), "process_weights_after_loading", None)) else "")
    return Recipe(signature, dict(sources), modules, attrs, sorted(set(sources) - attributed), not whole_why,
                  whole_why)


def _tie_to_what_was_compared(modules: dict[str, ModuleRecipe], inherited: dict) -> None:
    """Note [a tie made after loading]: a module that loaded checkpoint tensors of its own and
    ends up aliasing another module's tensor was tied because their bytes were equal (vLLM's
    ``maybe_retie_word_embeddings``: a checkpoint that ships a redundant ``lm_head.weight``).
    Whether a later load ties them again depends on both modules' bytes, so the alias's
    target's sources become the module's too: a fine-tune that changes either loads this
    module, and vLLM decides the tie again (`recipe.settle` takes it along with the target).
    A tie made when the model was built (no sources of its own) is structural: it holds
    whatever the target's bytes."""
    for name, recipe in modules.items():
        if name in inherited or not recipe.sources:
            continue
        targets = {e.alias.rpartition(".")[0] for e in recipe.tensors if e.alias is not None and e.view is None}
        for target in sorted(targets - {name}):
            if target in modules:
                recipe.sources = sorted(set(recipe.sources) | set(modules[target].sources))


def _placed_by_size(model, placement: dict) -> dict[tuple, list]:
    """(dtype, numel) -> [(tensor, its `context.Placement`)] of the model's contiguous parameters
    and buffers in a segment."""
    placed: dict[tuple, list] = {}
    for module in model.modules():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None and id(t) in placement and t.is_contiguous():
                placed.setdefault((t.dtype, t.numel()), []).append((t, placement[id(t)]))
    return placed


def _owners_and_bases(model, placement: dict) -> tuple[dict[int, str], dict[tuple, list]]:
    """``id(tensor)`` -> ``"module.name"`` of its first place; and, per storage
    (`slots.storage_id`), the (name, tensor) of the tensors a view in it may be recorded
    against: contiguous, and in a segment or covering their whole storage; parameters before
    buffers (Note [which of two tensors over one storage is the view])."""
    owner: dict[int, str] = {}
    param_bases: dict[tuple, list] = {}
    buffer_bases: dict[tuple, list] = {}
    for module_name, module in model.named_modules():
        for table, bases in ((module._parameters, param_bases), (module._buffers, buffer_bases)):
            for n, t in table.items():
                if t is None or id(t) in owner:
                    continue
                owner[id(t)] = _qualified(module_name, n)
                if (not t.is_meta and t.numel() and t.is_contiguous()
                        and (id(t) in placement or covers_storage(t))):
                    bases.setdefault(storage_id(t), []).append((owner[id(t)], t))
    for storage, buffers in buffer_bases.items():
        param_bases.setdefault(storage, []).extend(buffers)
    return owner, param_bases


# Note [which of two tensors over one storage is the view]
# Two tensors may each cover one whole storage (Mamba2's mixer registers its ``conv_weights``
# buffer as a (dim, width) view of its conv layer's (dim, 1, width) weight).  Only one may be
# recorded as the other's view, else each names the other and neither is ever bound.  A view is
# bound after post-processing (`replay.Replay._bind_views`), which reads a layer's parameters:
# so a parameter is the base, a buffer the view; among parameters, or among buffers, the first
# in the model's order is the base.


def _view_of(t, bases: dict[tuple, list]) -> tuple[str, int] | None:
    """(name of the tensor ``t`` is a view of, ``t``'s element offset from its first element),
    or None: ``t`` lies within one of ``bases`` of its storage that comes before it, with its
    dtype (Note [views into a shared storage] in `slots.py`, Note [which of two tensors over one
    storage is the view])."""
    if t.is_meta or not t.numel() or any(s < 0 for s in t.stride()):
        return None
    span = element_span(t.shape, t.stride())
    for name, base in bases.get(storage_id(t), ()):
        if base is t:
            return None  # a base itself: only those before it may be its base
        offset = t.storage_offset() - base.storage_offset()
        if base.dtype == t.dtype and 0 <= offset and offset + span <= base.numel():
            return name, offset
    return None


def _attribute_tensors(module) -> list[tuple[str, object]]:
    """(name, tensor) of the tensors ``module`` keeps in its own plain attributes (not its
    parameters or buffers, not serving state such as the KV cache)."""
    import torch

    return [(a.name, a.value) for a in module_attributes(module, max_depth=0) if isinstance(a.value, torch.Tensor)]


def _qualified(module_name: str, name: str) -> str:
    return f"{module_name}.{name}" if module_name else name


def _host_bytes(t) -> memoryview:
    from ..content.views import tensor_bytes

    return tensor_bytes(t.detach().cpu().contiguous())
