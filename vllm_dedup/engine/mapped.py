"""Building a model from a recipe: the matched modules' final tensors are mapped from resident
segments, only the unmatched modules are loaded from the checkpoint (docs/architecture.md,
"Loading only what is not resident").

The steps of `MappedBuild.build`, in order:

1. create the model on the meta device (nothing is allocated);
2. acquire the matched modules' final content keys from the registry, which holds their
   segments from this lookup until the engine lets go: none can be freed before it is mapped.
   A module with a key that is not resident is loaded from the checkpoint instead;
3. bind the matched modules' tensors: mapped read-only from their segments, small ones restored
   from the recipe, tied ones aliased; each keeps the class and attributes (``weight_loader``,
   ...) of the meta parameter it replaces (vLLM's ``materialize_meta_tensor`` does the same);
4. materialize the unmatched modules' parameters (vLLM's ``materialize_meta_tensor``) and load
   them through the model's own ``load_weights``, fed only the checkpoint tensors they need,
   read by `sources.read_tensors` (no other tensor's bytes are touched);
5. post-process: vLLM's ``process_weights_after_loading``, in its pre-processed mode
   (``weights_already_processed``, the mechanism vLLM's ``ipc_cache`` loader uses) for the
   mapped modules and normally for the loaded ones;
6. check that no meta tensor is left.

Any failure raises `FallBack` after giving back every segment it acquired; the loader then
loads the whole model as usual.  Nothing here compares bytes: the trust is the source keys and
the load signature, within a share group (docs/architecture.md, "Loading only what is not resident").
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import defaultdict

import torch
from torch import nn

from ..errors import SegmentError
from .recipe import Match, TensorRecipe
from .sources import SourceRecorder, read_tensors

__all__ = ["FallBack", "MappedBuild"]

logger = logging.getLogger("vllm.dedup.mapped")


class FallBack(Exception):
    """The recipe cannot build this model; the message says why.  Nothing is held any more."""


class MappedBuild:
    """One build of a model from a `recipe.Match` (module docstring).

    Args:
        loader: the `DedupModelLoader` (its ``create_model`` builds the model).
        vllm_config, model_config, prefix: as vLLM passes them to ``load_model``.
        client: the engine's registry connection.
        seg_cls: the segment backend; device_key: the device's key.
        target_device: where the model's tensors live.
        match: which modules to map and which to load.
        where: checkpoint tensor name -> its file.

    Attributes:
        placement: ``id`` of each tensor bound from a segment -> its content key.
        mapped_bytes: bytes of those tensors.
        recorder: records the loaded modules' sources (`sources.SourceRecorder`).
        bytes_read: checkpoint bytes read for the unmatched modules.
    """

    def __init__(self, loader, vllm_config, model_config, prefix: str, client, seg_cls, device_key: str,
                 target_device: torch.device, match: Match, where: dict):
        self.loader, self.vllm_config, self.model_config, self.prefix = loader, vllm_config, model_config, prefix
        self.client, self.seg_cls, self.device_key, self.device = client, seg_cls, device_key, target_device
        self.match, self.where = match, where
        self.placement: dict[int, str] = {}
        self.mapped_bytes = 0
        self.recorder = SourceRecorder(hash_keys=False)
        self.held: list[int] = []

    def build(self) -> nn.Module:
        """The model, post-processed, its matched modules mapped.

        Raises:
            FallBack: anything went wrong; every segment acquired has been given back.
        """
        from vllm.utils.torch_utils import set_default_torch_dtype

        model = None
        rope_cache = _rope_cache()
        rope_before = dict(rope_cache)
        try:
            with set_default_torch_dtype(self.model_config.dtype):
                with torch.device("meta"):
                    model = self.loader.create_model(self.vllm_config, self.model_config, self.prefix)
                modules = dict(model.named_modules())
                unknown = (set(self.match.matched) | set(self.match.unmatched)) - set(modules)
                if unknown:
                    raise FallBack(f"the recipe names modules this model does not have ({sorted(unknown)[:3]})")
                resident = self._acquire()
                if not self.match.mapped_bytes:
                    raise FallBack("nothing the recipe names is resident any more")
                # id(meta tensor) -> (it, its replacement).  The meta tensor is kept alive with
                # its replacement: a freed object's id is reused by the next one made, and a
                # stale id would rebind some unrelated tensor (see `_retie`).
                replaced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
                for name in sorted(self.match.matched):
                    self._bind(modules[name], name, resident, replaced)
                self._materialize(modules, replaced)
                _retie(model, replaced)
                self._alias(model)
                for key, value in self.match.recipe.attrs.items():
                    setattr(model, key, value)
                if self.match.unmatched:
                    self._load_unmatched(model, modules)
                self._post_process(model, {m: modules[m] for m in self.match.matched})
            _check_no_meta(model)
            return model.eval()
        except Exception as e:  # a fast path never stops an engine: the usual load follows
            logger.debug("vllm-dedup: building the model from a recipe failed", exc_info=True)
            self.release()
            if model is not None:
                _forget_layers(self.vllm_config, model)
            rope_cache.clear()  # rotary modules made on the meta device must not be reused
            rope_cache.update(rope_before)
            if isinstance(e, FallBack):
                raise
            raise FallBack(f"{type(e).__name__}: {e}") from e

    def release(self) -> None:
        """Give back every segment acquired (the tensors mapped from them are not used)."""
        held, self.held = self.held, []
        if held:
            with contextlib.suppress(Exception):
                self.client.release(held)

    # 2. acquire ----------------------------------------------------------------------------
    def _acquire(self) -> dict[str, torch.Tensor]:
        """Content key -> a tensor over its resident copy, for every key of the matched modules
        (a module with a key not resident, or whose segment cannot be mapped, is demoted)."""
        recipe = self.match.recipe
        wanted: dict[str, TensorRecipe] = {}
        for name in self.match.matched:
            for t in recipe.modules[name].tensors:
                if t.key is not None:
                    wanted[t.key] = t
        hits = defaultdict(list)
        for hit, fd in self.client.acquire(list(wanted)):
            hits[hit.segment].append((hit, fd))
        resident: dict[str, torch.Tensor] = {}
        for seg_id, seg_hits in hits.items():
            self.held.append(seg_id)
            for _, fd in seg_hits[1:]:
                os.close(fd)
            try:
                seg = self.seg_cls.attach(seg_hits[0][1], max(h.offset + h.nbytes for h, _ in seg_hits), self.device_key)
            except SegmentError as e:
                logger.warning("vllm-dedup: resident segment %d cannot be mapped (%s); its modules are loaded", seg_id, e)
                continue
            for hit, _ in seg_hits:
                t = wanted[hit.key]
                if hit.nbytes != t.nbytes:
                    continue  # another layout under the same key cannot happen; never trust it
                resident[hit.key] = seg.tensor(hit.offset, getattr(torch, t.dtype), t.shape, t.stride)
            seg.close_fd()
        for name in list(self.match.matched):
            missing = [t.name for t in recipe.modules[name].tensors if t.key is not None and t.key not in resident]
            if missing:
                self.match.demote(name, f"{missing[0]} is no longer resident")
        return resident

    # 3. bind -------------------------------------------------------------------------------
    def _bind(self, module: nn.Module, name: str, resident: dict, replaced: dict) -> None:
        """Make the module's tensors exactly the recipe's (aliases are bound later)."""
        recipe = self.match.recipe.modules[name]
        keep = {t.name for t in recipe.tensors}
        for table in (module._parameters, module._buffers):
            for n in [n for n, t in table.items() if t is not None and n not in keep]:
                del table[n]  # post-processing removed it
        for t in recipe.tensors:
            if t.alias is not None:
                continue
            if t.key is not None:
                tensor = resident[t.key]
                self.mapped_bytes += t.nbytes
            else:
                tensor = _restore_inline(t, self.device)
            old = module._parameters.get(t.name) if t.param else module._buffers.get(t.name)
            new = _like(old, tensor) if t.param else tensor
            if t.param:
                module._parameters[t.name] = new
            elif t.name in module._buffers:
                module._buffers[t.name] = new
            else:
                module.register_buffer(t.name, new)
            if old is not None:
                replaced[id(old)] = (old, new)
            if t.key is not None:
                self.placement[id(new)] = t.key

    def _alias(self, model: nn.Module) -> None:
        for name in self.match.matched:
            module = model.get_submodule(name)
            for t in self.match.recipe.modules[name].tensors:
                if t.alias is None:
                    continue
                owner, _, attr = t.alias.rpartition(".")
                target = getattr(model.get_submodule(owner), attr)
                (module._parameters if t.param else module._buffers)[t.name] = target

    # 4. the unmatched modules --------------------------------------------------------------
    def _materialize(self, modules: dict[str, nn.Module], replaced: dict) -> None:
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

        with self.device:
            for name in self.match.unmatched:
                module = modules[name]
                if any(b is not None and b.is_meta for b in module._buffers.values()):
                    raise FallBack(f"module {name} has buffers made at construction, which a model built on the "
                                   "meta device does not have")
                for n, p in list(module._parameters.items()):
                    if p is not None and p.is_meta and id(p) not in replaced:
                        module._parameters[n] = materialize_meta_tensor(p)
                        replaced[id(p)] = (p, module._parameters[n])

    def _load_unmatched(self, model: nn.Module, modules: dict[str, nn.Module]) -> None:
        names = self.match.read()
        self.recorder.wrap(model, self.match.unmatched)
        try:
            model.load_weights(self.recorder.iterate(read_tensors(sorted(names), self.where)))
        finally:
            self.recorder.finish()
        for name in self.match.unmatched:
            has_params = any(p is not None for p in modules[name]._parameters.values())
            if has_params and self.match.recipe.modules[name].sources and not self.recorder.module_sources.get(name):
                raise FallBack(f"module {name} got none of its checkpoint tensors")
            if name in self.recorder.unrecorded:
                raise FallBack(f"module {name}: {self.recorder.unrecorded[name]}")

    @property
    def bytes_read(self) -> int:
        return self.recorder.bytes_read

    # 5. post-processing --------------------------------------------------------------------
    def _post_process(self, model: nn.Module, mapped: dict[str, nn.Module]) -> None:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.utils import weights_already_processed

        with _pre_processed(mapped), contextlib.ExitStack() as stack:
            if not self.match.unmatched:
                stack.enter_context(weights_already_processed())
            process_weights_after_loading(model, self.model_config, self.device)


@contextlib.contextmanager
def _pre_processed(modules: dict[str, nn.Module]):
    """Run these modules' post-processing in vLLM's pre-processed mode (the others' normally) within
    one ``process_weights_after_loading`` call: their quantization methods' (and a deferred
    attention layer's own) ``process_weights_after_loading`` are wrapped, for the duration, to
    enter ``weights_already_processed`` when called for one of them.  A failure there is a
    `FallBack` naming the module and the method (some of vLLM's methods declare
    ``supports_pre_processed_weights`` and then ignore the mode: ``patches/`` has their fixes)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.utils import weights_already_processed

    name_of = {id(m): name for name, m in modules.items()}
    patched: list[tuple[object, bool, object]] = []  # (owner, had an instance attribute, it)

    def wrap(owner, bound, layer_of):
        def process(*args, **kwargs):
            name = name_of.get(id(layer_of(args)))
            if name is None:
                return bound(*args, **kwargs)
            try:
                with weights_already_processed():
                    return bound(*args, **kwargs)
            except Exception as e:
                raise FallBack(f"{type(owner).__name__}.process_weights_after_loading of {name} failed in vLLM's "
                               f"pre-processed mode ({type(e).__name__}: {e})") from e

        patched.append((owner, "process_weights_after_loading" in vars(owner),
                        vars(owner).get("process_weights_after_loading")))
        owner.process_weights_after_loading = process

    seen = set()
    for module in modules.values():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None and id(quant_method) not in seen:
            seen.add(id(quant_method))
            wrap(quant_method, quant_method.process_weights_after_loading, lambda args: args[0])
        if is_deferred_attention_layer(module):
            wrap(module, module.process_weights_after_loading, lambda args, m=module: m)
    try:
        yield
    finally:
        for owner, had, before in reversed(patched):
            if had:
                owner.process_weights_after_loading = before
            else:
                del owner.process_weights_after_loading


def _like(meta, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a parameter of ``meta``'s class with its attributes (a new parameter when
    there is no meta one)."""
    if meta is None:
        return nn.Parameter(tensor, requires_grad=False)
    new = tensor.detach()
    new.__class__ = meta.__class__
    new.__dict__ = meta.__dict__.copy()
    return new


def _restore_inline(t: TensorRecipe, device: torch.device) -> torch.Tensor:
    raw = (torch.frombuffer(bytearray(t.inline), dtype=torch.uint8) if t.inline
           else torch.empty(0, dtype=torch.uint8))
    dtype = getattr(torch, t.dtype)
    flat = raw.view(dtype) if raw.numel() else torch.empty(0, dtype=dtype)
    return flat.as_strided(t.shape, t.stride).to(device)


def _retie(model: nn.Module, replaced: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Replace every remaining reference to a replaced meta tensor (ties made at construction).
    ``replaced`` keeps each meta tensor alive, so an ``id`` here names that tensor and no other."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for n, t in list(table.items()):
                if t is not None and id(t) in replaced and replaced[id(t)][0] is t:
                    table[n] = replaced[id(t)][1]


def _rope_cache() -> dict:
    """vLLM's process-wide cache of rotary embedding modules (``get_rope`` hands the same module
    to every model built with the same parameters, whatever the device it was built on)."""
    try:
        from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT
    except ImportError:
        return {}
    return _ROPE_DICT


def _forget_layers(vllm_config, model: nn.Module) -> None:
    """Unregister the layers a model given up registered in vLLM's static forward context
    (attention layers register by name at construction; the usual load builds them again)."""
    ours = {id(m) for m in model.modules()}
    context = vllm_config.compilation_config.static_forward_context
    for name in [n for n, layer in context.items() if id(layer) in ours]:
        del context[name]


def _check_no_meta(model: nn.Module) -> None:
    for name, module in model.named_modules():
        for n, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None and t.is_meta:
                raise FallBack(f"{name}.{n} is still on the meta device after post-processing")
