"""A hook after each module's own post-processing inside one vLLM ``process_weights_after_loading``.

vLLM post-processes a model module by module (``model_loader/utils.py``): each quantization
method's ``process_weights_after_loading(layer)``, then each deferred attention layer's own.  A
replay runs the mapped modules' in vLLM's pre-processed mode and installs their packed weights
right after (`replay.py`); a usual load moves each packed weight into a segment right after
(`staging.py`).  Both need the same thing: a call per module, at the moment its post-processing
returned, within vLLM's own loop.  `post_processing_hooks` wraps, for the duration of a
``with`` block, the ``process_weights_after_loading`` of the named modules' quantization
methods (and deferred attention layers) on the instances, and restores them after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from torch import nn

from .recipe import RecipeDeclined

__all__ = ["post_processing_hooks"]


@contextlib.contextmanager
def post_processing_hooks(modules: dict[str, nn.Module], after: Callable[[str, nn.Module], None] | None = None,
                          pre_processed: bool = False, before: Callable[[str, nn.Module], None] | None = None):
    """Within the block, ``after(name, module)`` runs right after each of ``modules`` (qualified
    name -> module) was post-processed by vLLM's ``process_weights_after_loading``, and
    ``before(name, module)`` right before.

    Args:
        modules: the modules to hook; every other module is post-processed untouched.
        after: called once per hooked module and method, after it returned.
        pre_processed: run the hooked modules' post-processing in vLLM's pre-processed mode
            (``weights_already_processed``, as vLLM's ``ipc_cache`` loader does): their tensors
            are final already (a replay's mapped modules).

    Raises (from inside the block):
        RecipeDeclined: with ``pre_processed``, a hooked module's quant method does not declare
            ``supports_pre_processed_weights`` (vLLM refuses the mode for such a method before
            calling it; its transform would run again on final, mapped tensors), or its
            post-processing failed in that mode (some of vLLM's methods declare support and
            then ignore the mode: ``patches/`` has their fixes); the message names the module
            and the method.
    """
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.utils import weights_already_processed

    name_of = {id(m): name for name, m in modules.items()}
    patched: list[tuple[object, bool, object]] = []  # (owner, had an instance attribute, it)

    def wrap(owner, bound, layer_of):
        def process(*args, **kwargs):
            name = name_of.get(id(layer_of(args)))
            if name is None:
                return bound(*args, **kwargs)
            if (pre_processed and isinstance(owner, QuantizeMethodBase)
                    and not getattr(owner, "supports_pre_processed_weights", False)):  # vLLM's own check
                raise RecipeDeclined(f"{type(owner).__name__} of {name} does not support vLLM's pre-processed "
                                     "mode: its post-processing would run again on the mapped tensors")
            if before is not None:
                before(name, modules[name])
            if not pre_processed:
                result = bound(*args, **kwargs)
            else:
                try:
                    with weights_already_processed():
                        result = bound(*args, **kwargs)
                except Exception as e:
                    raise RecipeDeclined(f"{type(owner).__name__}.process_weights_after_loading of {name} failed in "
                                         f"vLLM's pre-processed mode ({type(e).__name__}: {e})") from e
            if after is not None:
                after(name, modules[name])
            return result

        patched.append((owner, "process_weights_after_loading" in vars(owner),
                        vars(owner).get("process_weights_after_loading")))
        owner.process_weights_after_loading = process

    seen = set()
    try:  # a wrap that fails midway still unwraps the owners wrapped before it
        for module in modules.values():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None and id(quant_method) not in seen:
                seen.add(id(quant_method))
                wrap(quant_method, quant_method.process_weights_after_loading, lambda args: args[0])
            if is_deferred_attention_layer(module):
                wrap(module, module.process_weights_after_loading, lambda args, m=module: m)
        yield
    finally:
        for owner, had, own in reversed(patched):
            if had:
                owner.process_weights_after_loading = own
            else:
                del owner.process_weights_after_loading
