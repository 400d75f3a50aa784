"""The oneDNN handlers a vLLM model's modules hold, and the tensors they pin."""

from __future__ import annotations

from ..attributes import closure_contents, module_attributes

__all__ = ["handlers_in", "holds_handler", "module_handlers", "pinned_tensors"]


def handlers_in(model) -> list[tuple[str, object]]:
    """Every vLLM ``CPUDNNLGEMMHandler`` a model's modules hold, once each, with the name of
    the first module that holds it: in a layer's ``cpu_linear`` closure (unquantized linears
    and the vocabulary head, ``layers/utils.py``) or as ``dnnl_handler`` of an object the layer
    holds (W8A8 kernels, ``kernels/linear/scaled_mm/cpu.py``)."""
    from vllm._custom_ops import CPUDNNLGEMMHandler

    out, seen = [], set()
    for name, module in model.named_modules():
        for handler in _handlers_of(module, CPUDNNLGEMMHandler):
            if id(handler) not in seen:
                seen.add(id(handler))
                out.append((name, handler))
    return out


def module_handlers(module) -> list:
    """The vLLM ``CPUDNNLGEMMHandler`` objects ``module`` itself (not its children) holds, once each."""
    from vllm._custom_ops import CPUDNNLGEMMHandler

    return list({id(h): h for h in _handlers_of(module, CPUDNNLGEMMHandler)}.values())


def pinned_tensors(model) -> list:
    """The tensors whose storage must stay where it is (Note [lifetimes]): every parameter and
    buffer of a module holding a oneDNN handler that is not an unquantized matmul's (a W8A8
    handler keeps a raw pointer to the layer's ``weight_scale``).  Small tensors: the scales,
    zero points and biases of such layers.  Empty where vLLM has no oneDNN handlers, or was
    never imported (a plain ``nn.Module`` shared without vLLM: nothing is imported for it)."""
    import sys

    if "vllm._custom_ops" not in sys.modules:  # where CPUDNNLGEMMHandler lives: no handler exists
        return []
    try:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    except ImportError:
        return []
    out = []
    try:
        for module in model.modules():
            unquantized = isinstance(getattr(module, "quant_method", None),
                                     (UnquantizedLinearMethod, UnquantizedEmbeddingMethod))
            if not unquantized and module_handlers(module):
                out += [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]
    except ImportError:  # a vLLM build without its CPU extension: no handlers
        return []
    return out


def holds_handler(module) -> bool:
    """Whether ``module`` itself (not its children) holds a vLLM ``CPUDNNLGEMMHandler``."""
    return bool(module_handlers(module))


def _handlers_of(module, cls):
    """The ``cls`` objects in ``module``'s attributes, two levels into the vLLM objects it holds
    (a W8A8 kernel's ``dnnl_handler``), and in its attributes' closures (``cpu_linear``)."""
    for a in module_attributes(module, max_depth=2, skip=frozenset()):
        if isinstance(a.value, cls):
            yield a.value
        else:
            for _, content in closure_contents(a.value):
                if isinstance(content, cls):
                    yield content
