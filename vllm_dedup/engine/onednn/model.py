"""The oneDNN handlers a vLLM model's modules hold, and the tensors they pin."""

from __future__ import annotations

from ..attributes import closure_contents, module_attributes

__all__ = ["ModelHandlers", "handlers_in", "holds_handler", "module_handlers", "pinned_tensors"]


class ModelHandlers:
    """Every vLLM ``CPUDNNLGEMMHandler`` a model's modules hold, found in one walk.

    A handler sits in a layer's ``cpu_linear`` closure (unquantized linears and the vocabulary
    head, ``layers/utils.py``) or as ``dnnl_handler`` of an object the layer holds (W8A8
    kernels, ``kernels/linear/scaled_mm/cpu.py``).  Finding one walks every attribute of every
    module (`attributes.module_attributes`), which costs more than mapping a small model's
    segments, so a sharing pass walks once and asks this object (Note [one walk per pass]).

    Note [one walk per pass]
        Handlers are made by post-processing and never after: a replay installs a segment
        *into* a handler (`install`), it does not make one.  A walk after post-processing
        therefore stays true until the model is dropped; one taken before it does not.
    """

    def __init__(self, model):
        self._per_module: list[tuple[str, object, list]] = []  # (name, module, its handlers), model order
        if not _vllm_imported():
            return
        from vllm._custom_ops import CPUDNNLGEMMHandler

        for name, module in model.named_modules():
            found = _handlers_of(module, CPUDNNLGEMMHandler)
            if found:
                self._per_module.append((name, module, found))

    def named(self) -> list[tuple[str, object]]:
        """``(module name, handler)`` for every handler once, with the first module holding it."""
        out, seen = [], set()
        for name, _, handlers in self._per_module:
            for handler in handlers:
                if id(handler) not in seen:
                    seen.add(id(handler))
                    out.append((name, handler))
        return out

    def pinned_tensors(self) -> list:
        """The tensors whose storage must stay where it is (Note [lifetimes]): every parameter
        and buffer of a module holding a oneDNN handler that is not an unquantized matmul's (a
        W8A8 handler keeps a raw pointer to the layer's ``weight_scale``).  Small tensors: the
        scales, zero points and biases of such layers.  Imports nothing where no module holds
        a handler (a plain ``nn.Module`` shared without vLLM)."""
        if not self._per_module:
            return []
        try:
            from vllm.model_executor.layers.linear import UnquantizedLinearMethod
            from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        except ImportError:  # a vLLM build without its CPU extension: no handlers
            return []
        out = []
        for _, module, _ in self._per_module:
            if not isinstance(getattr(module, "quant_method", None), (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
                out += [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]
        return out


def handlers_in(model) -> list[tuple[str, object]]:
    """Every vLLM ``CPUDNNLGEMMHandler`` a model's modules hold, once each, with the name of
    the first module that holds it (`ModelHandlers.named`; one walk of the model)."""
    return ModelHandlers(model).named()


def pinned_tensors(model) -> list:
    """`ModelHandlers.pinned_tensors` of ``model`` (one walk of the model).  Empty where vLLM
    has no oneDNN handlers, or was never imported (a plain ``nn.Module`` shared without vLLM)."""
    return ModelHandlers(model).pinned_tensors()


def module_handlers(module) -> list:
    """The vLLM ``CPUDNNLGEMMHandler`` objects ``module`` itself (not its children) holds, once each."""
    if not _vllm_imported():
        return []
    from vllm._custom_ops import CPUDNNLGEMMHandler

    return _handlers_of(module, CPUDNNLGEMMHandler)


def holds_handler(module) -> bool:
    """Whether ``module`` itself (not its children) holds a vLLM ``CPUDNNLGEMMHandler``."""
    return bool(module_handlers(module))


def _vllm_imported() -> bool:
    """Whether vLLM's ``_custom_ops`` (where ``CPUDNNLGEMMHandler`` lives) was imported: when
    not, no handler can exist, and a plain ``nn.Module`` is shared without importing vLLM."""
    import sys

    return "vllm._custom_ops" in sys.modules


def _handlers_of(module, cls) -> list:
    """The ``cls`` objects, once each, in ``module``'s attributes, two levels into the vLLM
    objects it holds (a W8A8 kernel's ``dnnl_handler``), and in its attributes' closures
    (``cpu_linear``)."""
    found = {}
    for a in module_attributes(module, max_depth=2, skip=frozenset()):
        if isinstance(a.value, cls):
            found.setdefault(id(a.value), a.value)
        else:
            for _, content in closure_contents(a.value):
                if isinstance(content, cls):
                    found.setdefault(id(content), content)
    return list(found.values())
