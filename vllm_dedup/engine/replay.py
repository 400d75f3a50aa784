"""Replaying a recipe: building a model whose matched modules' final tensors are mapped from
resident segments, and whose unmatched modules alone are loaded from the checkpoint
(docs/architecture.md, "Loading only what is not resident").

The steps of `Replay.build`, in order:

1. create the model on the meta device (nothing is allocated);
2. acquire the matched modules' final content keys, each in the segment the recipe names
   (`resident.map_resident`; with ``verify: false``, in any segment holding the key).  The
   registry holds those segments from this lookup until the engine lets go: none can be freed
   before it is mapped.  A module with a key not resident is loaded from the checkpoint
   instead (`recipe.Match.demote`, which takes along every module sharing a checkpoint tensor
   with it, or declines);
3. bind the matched modules' tensors: mapped read-only from their segments, small ones restored
   from the recipe, tied ones aliased; each keeps the class and attributes (``weight_loader``,
   ...) of the meta parameter it replaces (vLLM's ``materialize_meta_tensor`` does the same),
   and every other reference to the meta tensor it replaces (a parameter or buffer of another
   module, a module attribute, an attention implementation's attribute) is pointed at it.  A
   linear layer whose recipe names a oneDNN packed weight (CPU backend) gets a placeholder
   ``weight`` of its full shape over zero pages (Note [packed weights replayed]);
4. materialize the unmatched modules' parameters (vLLM's ``materialize_meta_tensor``), move
   them into writable segments of this engine's own where the load publishes in place
   (`in_place.InPlace`, as a usual load does), and load them through the model's own
   ``load_weights``, fed only the checkpoint tensors they need, read by
   `checkpoint.loading.read_tensors` (no other tensor's bytes are touched); every parameter of
   theirs must have been filled by a weight loader;
5. post-process: vLLM's ``process_weights_after_loading``, in its pre-processed mode
   (``weights_already_processed``, the mechanism vLLM's ``ipc_cache`` loader uses) for the
   mapped modules and normally for the loaded ones; right after a mapped module's own
   post-processing made its oneDNN handler, the handler's packed weight is replaced by the
   recipe's segment (`onednn.install`);
6. check that no meta tensor, and no placeholder's zero pages, is left anywhere a kernel may
   read one (`slots.attribute_tensors`).

Any failure raises `recipe.RecipeDeclined` after giving back every segment acquired (those not
yet mapped too: `resident.map_resident`) and unregistering the layers the build registered; the
loader then loads the whole model as usual.  No byte is compared here: the trust is the BLAKE3
source keys, the load signature and the segments the recipe names (docs/architecture.md,
"Trust"); but a recipe is another engine's data, so each layout it gives a key must fit that
key's type and bytes (`TensorRecipe.fits`), and the model attributes it sets must be plain ones.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from ..checkpoint.loading import read_tensors
from ..content.views import dtype_name, element_span
from ..errors import SegmentError
from ..log import init_logger
from ..segments import segment_class
from .context import LoadContext, Placement
from .heap import reused_heap, trim
from .meta_model import Registrations, check_no_meta, like_meta, retie
from .packed import ZeroPages, install_replayed, keeps_weight
from .post_processing import post_processing_hooks
from .provenance import WriteGuard
from .recipe import Match, RecipeDeclined, TensorRecipe
from .recipe_builder import PLAIN_TYPES
from .resident import map_resident
from .sources import SourceRecorder

__all__ = ["Replay", "settable_attribute"]

logger = init_logger(__name__)


class Replay:
    """One build of a model from a `recipe.Match` (module docstring).

    Args:
        ctx: the load (its ``create_model`` builds the model; its lease acquires).
        match: which modules to map and which to load.
        where: checkpoint tensor name -> its file.
        identities: each file's identity the match's keys describe (`fast_path.Decision`): a
            file changed since is not read, and the replay is declined.
        in_place: where the unmatched modules' tensors are loaded (`in_place.InPlace`; the
            sharing pass seals them where they lie), or None: private memory.

    Attributes:
        placement: ``id`` of each tensor bound from a segment -> its `context.Placement`.
        mapped_bytes: bytes of those tensors.
        recorder: records the loaded modules' sources (`sources.SourceRecorder`).
    """

    def __init__(self, ctx: LoadContext, match: Match, where: dict, in_place=None, identities: dict | None = None):
        self.ctx, self.match, self.where, self.in_place = ctx, match, where, in_place
        self.identities = identities
        self.placement: dict[int, Placement] = {}  # handlers' ids too, for their packed weights
        self.mapped_bytes = 0
        self._zeros = ZeroPages()  # Note [packed weights replayed]
        self._segment_of: dict[str, int] = {}  # uid -> segment id, of what was acquired
        self.recorder = SourceRecorder(hash_keys=False)
        self.held: list[int] = []
        # (weak reference to a bound tensor, its id, its data_ptr, its bytes): `_forget_replaced`
        self._mapped: list[tuple[weakref.ref, int, int, int]] = []
        # (weak reference to a tensor bound read-only: mapped, or a placeholder over zero pages,
        # what it is): post-processing must not write into them (`WriteGuard`)
        self._read_only: list[tuple[weakref.ref, str]] = []

    @property
    def bytes_read(self) -> int:
        """Checkpoint bytes read for the unmatched modules."""
        return self.recorder.bytes_read

    def build(self) -> nn.Module:
        """The model, post-processed, its matched modules mapped.

        Raises:
            RecipeDeclined: anything went wrong; every segment acquired has been given back.
        """
        from vllm.utils.torch_utils import set_default_torch_dtype

        model = None
        registrations = Registrations(self.ctx.vllm_config)
        try:
            with set_default_torch_dtype(self.ctx.model_config.dtype):
                with torch.device("meta"):
                    model = self.ctx.create_model()
                modules = dict(model.named_modules())
                unknown = (set(self.match.matched) | set(self.match.unmatched)) - set(modules)
                if unknown:
                    raise RecipeDeclined(f"the recipe names modules this model does not have ({sorted(unknown)[:3]})")
                resident = self._acquire()
                if not resident or not self.match.mapped_bytes:  # an embedding's packed copy is optional
                    raise RecipeDeclined("nothing the recipe names is resident any more")
                # id(meta tensor) -> (it, its replacement).  The meta tensor is kept alive with
                # its replacement: a freed object's id is reused by the next one made, and a
                # stale id would rebind some unrelated tensor (see `meta_model.retie`).
                replaced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
                for name in sorted(self.match.matched):
                    self._bind(modules[name], name, resident, replaced)
                    self._placeholder(modules[name], name, replaced)
                self._materialize(modules, replaced)
                retie(model, replaced)
                self._alias(model)
                self._restore_attributes(modules)
                for key, value in self.match.recipe.attrs.items():
                    if not settable_attribute(model, key, value):
                        raise RecipeDeclined(f"the recipe would set the model's {key!r}, which is not a plain attribute")
                    setattr(model, key, value)
                if self.match.unmatched:
                    if self.in_place is not None:
                        self.in_place.place(model, [modules[name] for name in self.match.unmatched])
                    self._load_unmatched(model, modules)
                with WriteGuard([(t, what) for ref, what in self._read_only if (t := ref()) is not None]):
                    self._post_process(model, {m: modules[m] for m in self.match.matched}, resident)
                self._read_only.clear()
                resident.clear()  # the last references of this build to the mapped tensors
                replaced.clear()
                self._forget_replaced()
                self._bind_views(model)
                self._check_aliases(model)
                self._release_unused()
            check_no_meta(model, self._zeros.holds)
            return model.eval()
        except Exception as e:  # a fast path never stops an engine: the usual load follows
            logger.debug("building the model from a recipe failed", exc_info=True)
            self.release()
            # Nothing of this build may outlive it: the loader keeps this object during the
            # usual load that follows, and these hold tensors over the released segments.
            self._mapped.clear()
            self._read_only.clear()
            self.placement.clear()
            if self.in_place is not None:
                self.in_place.discard()
            registrations.undo()  # the usual load builds them again (rotary modules made on the meta device too)
            if isinstance(e, RecipeDeclined):
                raise
            raise RecipeDeclined(f"{type(e).__name__}: {e}") from e

    def release(self) -> None:
        """Give back every segment acquired (the tensors mapped from them are not used)."""
        held, self.held = self.held, []
        if held:
            with contextlib.suppress(Exception):
                self.ctx.lease.release(held)

    # 2. acquire ----------------------------------------------------------------------------
    def _acquire(self) -> dict[tuple[str, str], tuple[torch.Tensor, str]]:
        """(content key, uid asked) -> (a tensor over its resident copy, the uid of its segment),
        for every key of the matched modules (a module with a key not resident, or whose
        segment cannot be mapped, is demoted).  Without ``verify``, a key may be found in any
        segment: the uid asked is then ""."""
        recipe, strict = self.match.recipe, self.ctx.config.verify
        wanted: dict[tuple[str, str], list[TensorRecipe]] = {}
        for name in self.match.matched:
            for t in recipe.modules[name].keyed():
                wanted.setdefault((t.key, t.uid if strict else ""), []).append(t)
        keys = [k for k, _ in wanted]
        found = map_resident(self.ctx.lease, segment_class(self.ctx.device_type), self.ctx.device_key, keys,
                             [u for _, u in wanted] if strict else None)
        resident: dict[tuple[str, str], tuple[torch.Tensor, str]] = {}
        for got in found:
            if got.error is not None:  # released already
                logger.warning("%s; its modules are loaded", got.error)
                continue
            self.held.append(got.found.segment)
            self._segment_of[got.found.uid] = got.found.segment
            for hit in got.found.hits:
                asked = (hit.key, got.found.uid if strict else "")
                entries = wanted.get(asked, [])
                if not entries or not all(t.fits(hit.key, hit.nbytes) for t in entries):
                    continue  # a layout its key and bytes do not allow: never trusted, the module loads
                t = entries[0]
                try:
                    tensor = got.segment.tensor(hit.offset, getattr(torch, t.dtype), t.shape, t.stride)
                except (SegmentError, RuntimeError, ValueError, TypeError) as e:
                    logger.debug("%s cannot be viewed in its segment (%s)", hit.key, e)
                    continue
                resident[asked] = (tensor, got.found.uid)
        gone = {}
        for name in self.match.matched:
            optional = recipe.modules[name].packed if keeps_weight(recipe.modules[name]) else None
            missing = [t.name for t in recipe.modules[name].keyed()
                       if t is not optional and (t.key, t.uid if strict else "") not in resident]
            if missing:
                gone[name] = f"{missing[0]} is no longer resident"
        if gone:
            self.match.demote(gone)
        return resident

    # 3. bind -------------------------------------------------------------------------------
    def _bind(self, module: nn.Module, name: str, resident: dict, replaced: dict) -> None:
        """Make the module's tensors exactly the recipe's (aliases are bound later)."""
        recipe, strict = self.match.recipe.modules[name], self.ctx.config.verify
        keep = {t.name for t in recipe.tensors}
        for table in (module._parameters, module._buffers):
            for n in [n for n, t in table.items() if t is not None and n not in keep]:
                del table[n]  # post-processing removed it
        for t in recipe.tensors:
            if t.view is not None:  # bound after post-processing (`_bind_views`), which may make it
                (module._parameters if t.param else module._buffers).pop(t.name, None)
                continue
            if t.alias is not None:
                continue
            if t.key is not None:
                tensor, uid = resident[(t.key, t.uid if strict else "")]
                if (tuple(tensor.shape), tensor.stride()) != (t.shape, t.stride):
                    # One key, two layouts of its bytes: a conv weight before packing, read from
                    # the (dim, width) buffer that holds it (`recipe_builder.conv_weight_recipe`).
                    tensor = tensor.as_strided(t.shape, t.stride)
                self.mapped_bytes += t.nbytes
            else:
                tensor = _restore_inline(t, self.ctx.device)
            old = module._parameters.get(t.name) if t.param else module._buffers.get(t.name)
            # A tensor object of its own per place, as a plain load makes: two buffers of one
            # key bound to one object would both change where post-processing rebinds one's data.
            new = like_meta(old, tensor) if t.param else tensor.detach()
            if t.param:
                module._parameters[t.name] = new
            elif t.name in module._buffers:
                module._buffers[t.name] = new
            else:
                module.register_buffer(t.name, new)
            if old is not None:
                replaced[id(old)] = (old, new)
            if t.key is not None:
                self.placement[id(new)] = Placement(t.key, uid)
                self._mapped.append((weakref.ref(new), id(new), new.data_ptr(), t.nbytes))
                self._read_only.append((weakref.ref(new), f"{name}.{t.name}, mapped read-only from a segment"))

    def _placeholder(self, module: nn.Module, name: str, replaced: dict) -> None:
        """A linear layer whose packed weight the recipe names: its ``weight`` (packed and
        dropped by vLLM's post-processing) becomes a placeholder over zero pages of the meta
        weight's shape (Note [packed weights replayed])."""
        recipe = self.match.recipe.modules[name]
        if recipe.packed is None or keeps_weight(recipe):
            return  # no packed weight, or an embedding: it packs its own weight
        current = module._parameters.get(recipe.packed.name)
        meta = next((old for old, new in replaced.values() if new is current), None)
        if meta is None or not meta.is_meta or meta.ndim != 2:
            raise RecipeDeclined(f"module {name}: no 2-D {recipe.packed.name} to pack (found {meta!r})")
        placeholder = self._zeros.tensor(meta.dtype, meta.shape)
        module._parameters[recipe.packed.name] = like_meta(meta, placeholder)
        self._read_only.append((weakref.ref(module._parameters[recipe.packed.name]),
                                f"{name}.{recipe.packed.name}, a placeholder over zero pages"))
        replaced[id(meta)] = (meta, module._parameters[recipe.packed.name])

    def _install_packed(self, name: str, module: nn.Module, resident: dict) -> None:
        """Right after ``module``'s post-processing: its handler reads the recipe's segment (an
        embedding's, only where its own packing is equal: `packed.install_replayed`)."""
        recipe, strict = self.match.recipe.modules[name], self.ctx.config.verify
        entry = recipe.packed
        if entry.inline is not None:  # a small packed weight, kept in the recipe (private here too)
            install_replayed(name, module, recipe, torch.frombuffer(bytearray(entry.inline), dtype=torch.uint8).clone())
            return
        found = resident.get((entry.key, entry.uid if strict else ""))
        if found is None:  # only an embedding's copy may be missing (`_acquire` demotes the rest)
            if keeps_weight(recipe):
                return
            raise RecipeDeclined(f"module {name}: its packed weight {entry.key} is not resident")
        tensor, uid = found
        handler = install_replayed(name, module, recipe, tensor)
        if handler is None:  # an embedding whose own packing differs: the sharing pass keys it
            return  # (`_release_unused` gives its segment back unless something else reads it)
        self.placement[id(handler)] = Placement(entry.key, uid)
        self.mapped_bytes += entry.nbytes

    def _release_unused(self) -> None:
        """Give back every segment acquired that nothing bound in the model reads (no tensor or
        handler in `placement`): an embedding's packed copy that no handler took, and a segment
        whose every hit was a demoted module's, did not fit its recipe entry, or was replaced by
        post-processing.  Held, it would stay resident as long as this engine lives, for nothing
        (the sharing pass maps again what it needs)."""
        used = {p.uid for p in self.placement.values()}
        unused = [seg for uid, seg in self._segment_of.items() if uid not in used]
        if unused:
            self.held = [s for s in self.held if s not in unused]
            with contextlib.suppress(Exception):
                self.ctx.lease.release(unused)

    def _forget_replaced(self) -> None:
        """Drop the placement of each mapped tensor that loading or post-processing replaced:
        its data (a causal-conv weight vLLM packed again: private now, the sharing pass keys
        it), or the tensor itself, which nothing holds any more (vLLM's
        ``maybe_retie_word_embeddings`` binds the head to an embedding loaded with equal bytes).
        Placed, a dead tensor's segment would stay held for nothing (`_release_unused`), and its
        id would name whatever object is made next with that id.  The build holds no
        reference of its own to them by now."""
        for ref, ident, ptr, nbytes in self._mapped:
            tensor = ref()
            if tensor is None or tensor.data_ptr() != ptr:
                self.placement.pop(ident, None)
                self.mapped_bytes -= nbytes
        self._mapped = []

    def _tied(self, model: nn.Module):
        """(module name, module, entry) of each alias the matched modules' recipes name that is
        not a view: a tied weight, the very tensor of another module."""
        for name in self.match.matched:
            module = model.get_submodule(name)
            for t in self.match.recipe.modules[name].tensors:
                if t.alias is not None and t.view is None:
                    yield name, module, t

    def _alias(self, model: nn.Module) -> None:
        for _, module, t in self._tied(model):
            (module._parameters if t.param else module._buffers)[t.name] = _named_tensor(model, t.alias)

    def _check_aliases(self, model: nn.Module) -> None:
        """After post-processing: each alias the recipe names (a tied weight) is its target's
        tensor, in the dtype, shape and stride the recipe recorded for it.  `_alias` bound it
        without looking, and a peer's recipe is untrusted: one tying a head to a tensor of
        another shape would give a model no plain load makes.

        Raises:
            RecipeDeclined: an alias that is not so."""
        for name, module, t in self._tied(model):
            made, target = getattr(module, t.name, None), _named_tensor(model, t.alias)
            if (not isinstance(made, torch.Tensor) or made.is_meta or made.data_ptr() != target.data_ptr()
                    or (dtype_name(made.dtype), tuple(made.shape), tuple(made.stride()))
                    != (t.dtype, t.shape, t.stride)):
                raise RecipeDeclined(f"module {name}: {t.name} is not {t.alias} in the recipe's "
                                     f"{t.dtype} {list(t.shape)} stride {list(t.stride)}")

    def _bind_views(self, model: nn.Module) -> None:
        """After post-processing: each view the recipe names is exactly that view of its base
        (Note [views into a shared storage] in `slots.py`).  Post-processing may have made it
        (MLA's ``W_UV`` and ``W_UK_T``, from ``kv_b_proj``'s mapped weight: it writes into an
        existing one, which is why `_bind` removed it); else it is bound here."""
        for name in self.match.matched:
            module = model.get_submodule(name)
            for t in self.match.recipe.modules[name].tensors:
                if t.view is None:
                    continue
                base = _named_tensor(model, t.alias)
                if (t.dtype != dtype_name(base.dtype) or base.is_meta or not base.is_contiguous()
                        or t.view + element_span(t.shape, t.stride) > base.numel()):
                    raise RecipeDeclined(f"module {name}: {t.name} is not a view of {t.alias} as the recipe says")
                want = base.detach().as_strided(t.shape, t.stride, base.storage_offset() + t.view)
                table = module._parameters if t.param else module._buffers
                made = table.get(t.name)
                if made is None:
                    if t.param:
                        module.register_parameter(t.name, nn.Parameter(want, requires_grad=False))
                    else:
                        module.register_buffer(t.name, want)
                elif (made.data_ptr(), made.dtype, tuple(made.shape), made.stride()) != (
                        want.data_ptr(), want.dtype, tuple(want.shape), want.stride()):
                    raise RecipeDeclined(f"module {name}: post-processing made {t.name} other than the recipe's view "
                                         f"of {t.alias}")

    def _restore_attributes(self, modules: dict[str, nn.Module]) -> None:
        """Give every module of the recipe the small attribute tensors the recorded engine's
        module held after its load (post-processing included), where this module has none or
        a meta one (it was made on the meta device here)."""
        for name, recipe in self.match.recipe.modules.items():
            module = modules.get(name)
            for t in recipe.attributes if module is not None else ():
                current = getattr(module, t.name, None)
                if current is None or (isinstance(current, torch.Tensor) and current.is_meta):
                    setattr(module, t.name, _restore_inline(t, self.ctx.device))

    # 4. the unmatched modules --------------------------------------------------------------
    def _materialize(self, modules: dict[str, nn.Module], replaced: dict) -> None:
        """Give the unmatched modules' meta parameters memory (vLLM's ``materialize_meta_tensor``),
        and their meta buffers that view a parameter (Mamba2's mixer views its conv layer's
        weight as ``conv_weights``) the same view of that parameter's replacement, mapped or
        materialized.  Any other buffer made at construction cannot be made here."""
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

        with self.ctx.device:
            for name in self.match.unmatched:
                for n, p in list(modules[name]._parameters.items()):
                    if p is not None and p.is_meta and id(p) not in replaced:
                        modules[name]._parameters[n] = materialize_meta_tensor(p)
                        replaced[id(p)] = (p, modules[name]._parameters[n])
        for name in self.match.unmatched:
            for n, b in list(modules[name]._buffers.items()):
                if b is None or not b.is_meta:
                    continue
                base = b._base
                new = replaced.get(id(base), (None, None))[1] if base is not None else None
                if new is None or new.is_meta or replaced[id(base)][0] is not base:
                    raise RecipeDeclined(f"module {name} has buffers made at construction, which a model built on "
                                         "the meta device does not have")
                offset = b.storage_offset() - base.storage_offset()
                modules[name]._buffers[n] = new.detach().as_strided(b.shape, b.stride(), new.storage_offset() + offset)
                replaced[id(b)] = (b, modules[name]._buffers[n])

    def _load_unmatched(self, model: nn.Module, modules: dict[str, nn.Module]) -> None:
        names = self.match.read()
        self.recorder.wrap(model, self.match.unmatched,
                           holds_no_data=self.in_place.holds_no_data if self.in_place is not None else None)
        try:
            with self.recorder.tracing(protect=self._bound(modules)):
                model.load_weights(self.recorder.iterate(read_tensors(sorted(names), self.where, self.identities)))
        finally:
            self.recorder.finish()
        for name in sorted(self.match.unmatched):
            if name in self.recorder.untraced:
                raise RecipeDeclined(f"module {name}: {self.recorder.untraced[name]}")
            unfilled = [n for n, p in modules[name]._parameters.items()
                        if p is not None and id(p) not in self.recorder.loaded]
            if unfilled:
                raise RecipeDeclined(f"module {name}: {unfilled[0]} got none of its checkpoint tensors")

    def _bound(self, modules: dict[str, nn.Module]) -> list[tuple[torch.Tensor, str]]:
        """The matched modules' tensors bound from the recipe (mapped, inline or placeholders;
        not aliases, which may be a loaded module's), each with its name: ``load_weights`` must
        not write them (most are mapped read-only, where a write would fault)."""
        bound = []
        for name in sorted(self.match.matched):
            module = modules[name]
            for t in self.match.recipe.modules[name].tensors:
                if t.alias is None and t.view is None:
                    tensor = (module._parameters if t.param else module._buffers).get(t.name)
                    if tensor is not None:
                        bound.append((tensor, f"{name}.{t.name}, which the recipe maps"))
        return bound

    # 5. post-processing --------------------------------------------------------------------
    def _post_process(self, model: nn.Module, mapped: dict[str, nn.Module], resident: dict) -> None:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.utils import weights_already_processed

        packed = {name for name in mapped if self.match.recipe.modules[name].packed is not None}

        def before(name: str, module: nn.Module) -> None:
            # An embedding's packing is the largest block of all: the heap's free pages, the
            # linear layers' freed packings, go back to the kernel first rather than sit
            # beside it.
            if name in packed and keeps_weight(self.match.recipe.modules[name]):
                trim()

        def after(name: str, module: nn.Module) -> None:
            if name in packed:
                self._install_packed(name, module, resident)

        # Each linear layer's zero-page packing is freed once the segment is installed: the next
        # layer's reuses its pages, however large (`heap`, Note [large blocks from the heap]).
        with reused_heap(large_blocks=True), post_processing_hooks(mapped, after, pre_processed=True, before=before), \
                contextlib.ExitStack() as stack:
            if not self.match.unmatched:
                stack.enter_context(weights_already_processed())
            process_weights_after_loading(model, self.ctx.model_config, self.ctx.device)


def _named_tensor(model: nn.Module, qualified: str) -> torch.Tensor:
    """The tensor at ``"module.name"`` of ``model`` (a recipe's ``alias``)."""
    owner, _, attr = qualified.rpartition(".")
    return getattr(model.get_submodule(owner), attr)


def settable_attribute(model, key: str, value) -> bool:
    """Whether a recipe may set ``model.<key> = value``: a plain value (None, bool, int, float or
    str: what `recipe_builder.model_attrs` records) in place of no value or a plain one, and over
    no method, property, submodule, parameter or buffer.  A recipe is another engine's data: one
    that would replace ``compute_logits`` or ``config`` would load and then fail at the first
    forward pass, so it is declined instead."""
    import inspect

    if key.startswith("_") or key in model._modules or key in model._parameters or key in model._buffers:
        return False
    if not isinstance(value, PLAIN_TYPES) or not isinstance(vars(model).get(key), PLAIN_TYPES):
        return False
    declared = inspect.getattr_static(type(model), key, None)
    return not (callable(declared) or hasattr(declared, "__get__"))


def _restore_inline(t: TensorRecipe, device: torch.device) -> torch.Tensor:
    raw = (torch.frombuffer(bytearray(t.inline), dtype=torch.uint8) if t.inline
           else torch.empty(0, dtype=torch.uint8))
    dtype = getattr(torch, t.dtype)
    flat = raw.view(dtype) if raw.numel() else torch.empty(0, dtype=dtype)
    return flat.as_strided(t.shape, t.stride).to(device)
