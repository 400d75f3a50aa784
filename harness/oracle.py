"""The final-tensor oracle: what an engine's model holds after loading, tensor by tensor, so
that a dedup engine can be compared with a plain load of the same checkpoint with the same
options.  Not shipped with vllm-dedup.

`FinalTensors` is a vLLM worker extension (``worker_extension_cls="harness.oracle.FinalTensors"``,
``--worker-extension-cls`` for ``vllm serve``): vLLM mixes it into its Worker class, and
``collective_rpc("final_tensor_digests")`` runs it in every worker (``LLM.collective_rpc``, or
``POST /collective_rpc`` of a ``vllm serve`` started with ``VLLM_SERVER_DEV_MODE=1``).  Each worker
answers with a digest per tensor:

- ``param:<module>.<name>`` and ``buffer:<module>.<name>``: every parameter and buffer;
- ``attr:<module>.<name>``: tensors (parameters included) a module (or a plain object it holds,
  such as an attention layer's implementation) keeps in an attribute outside
  ``_parameters``/``_buffers``, and
  tensors captured by a layer's ``cpu_linear`` closure (`vllm_dedup.engine.slots.attribute_tensors`:
  a kernel reads those too; the KV cache, which serving fills, is left out);
- ``packed:<module>``: on vLLM's CPU backend, the packed weight of each oneDNN handler a module
  holds (`vllm_dedup.engine.onednn`): what the linear kernels read once vLLM dropped the
  weight, as the content key the sharing pass gives it (`vllm_dedup.engine.packed`:
  ``onednn:<layout identity digest>[<bytes>]/[1]:<XXH3-128 of the bytes>``); where the packed
  bytes cannot be read (a layout not understood), ``output|`` and the digest of the handler's
  output on a fixed input instead, and where even that fails ``unreadable: <why>``, which
  `differences` always reports;
- ``output:<module>``: each quantized linear's output on a fixed input (`output_digests`): what
  its kernel computes, with tensors it reads through raw pointers;

each as ``dtype|shape|stride|<XXH3-128 of the bytes>`` (``meta`` in place of the digest for a
tensor that has no data).  `differences` names every tensor whose entry is not the reference's.
"""

from __future__ import annotations

import json
import urllib.request

from vllm_dedup.engine.slots import attribute_tensors

__all__ = ["FinalTensors", "differences", "output_digests", "packed_digests", "serve_digests", "tensor_digests"]

EXTENSION = "harness.oracle.FinalTensors"


def _digest(t) -> str:
    import torch
    import xxhash

    head = f"{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|{list(t.stride())}"
    if t.is_meta:
        return head + "|meta"
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous().reshape(-1)
    if not data.numel():
        return head + "|empty"
    return head + "|" + xxhash.xxh3_128_hexdigest(memoryview(data.view(torch.uint8).numpy()))


def tensor_digests(model) -> dict[str, str]:
    """Every tensor the model holds, by name (module docstring), in a model of this process."""
    out: dict[str, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = module_name or "<model>"
        for name, t in module._parameters.items():
            if t is not None:
                out[f"param:{prefix}.{name}"] = _digest(t)
        for name, t in module._buffers.items():
            if t is not None:
                out[f"buffer:{prefix}.{name}"] = _digest(t)
    for where, t in attribute_tensors(model):
        out[f"attr:{where}"] = _digest(t)
    out.update(packed_digests(model))
    out.update(output_digests(model))
    return out


def output_digests(model) -> dict[str, str]:
    """``output:<module>`` -> digest of each quantized vLLM linear's output on a fixed input
    (``quant_method.apply``, 3 rows of seeded values in the layer's ``params_dtype``).  A
    quantized kernel can read tensors through raw pointers its handler took at creation (a W8A8
    handler's ``weight_scale``): equal parameters do not prove it reads them, its output does.
    Empty where vLLM is not there."""
    import torch

    try:
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    except ImportError:
        return {}
    out = {}
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if not isinstance(module, LinearBase) or method is None or isinstance(method, UnquantizedLinearMethod):
                continue
            k = getattr(module, "input_size_per_partition", module.input_size)
            x = torch.randn(3, k, generator=generator).to(module.params_dtype)
            bias = None if getattr(module, "skip_bias_add", False) else getattr(module, "bias", None)
            out[f"output:{name}"] = _digest(method.apply(module, x.to(_device_of(module)), bias))
    return out


def _device_of(module):
    import torch

    for t in module.parameters():
        return t.device
    return torch.device("cpu")


def packed_digests(model) -> dict[str, str]:
    """``packed:<module>`` -> digest of each oneDNN handler's packed weight (module docstring);
    empty where vLLM is not there.  (Any other failure to walk the handlers is raised: an empty
    answer on both sides would compare nothing.)"""
    import xxhash

    try:
        import vllm._custom_ops  # noqa: F401  (where the handlers come from)
    except ImportError:
        return {}
    from vllm_dedup.content.keys import ContentKey
    from vllm_dedup.engine import onednn
    from vllm_dedup.engine.packed import packed_dtype
    from vllm_dedup.errors import PackedWeightError

    out = {}
    for name, handler in onednn.handlers_in(model):
        try:
            packed = onednn.find_packed(handler)
        except PackedWeightError as e:
            out[f"packed:{name}"] = _handler_output(model, name, handler, e)
            continue
        key = ContentKey(xxhash.xxh3_128_digest(packed.view()), packed_dtype(packed.layout), (packed.nbytes,), (1,))
        out[f"packed:{name}"] = str(key)
    return out


def _handler_output(model, name: str, handler, why: Exception) -> str:
    """``output|`` and the digest of ``handler``'s output (vLLM's ``onednn_mm``) on 3 rows of
    seeded values in the dtype of the module ``name`` (its ``params_dtype``, else the model's
    first floating-point parameter's): what its kernel computes from the packed bytes that
    could not be read (``why``); ``unreadable: ...`` where it cannot be run either."""
    import torch
    from vllm import _custom_ops as ops

    module = model.get_submodule(name)
    dtype = getattr(module, "params_dtype", None) or next(
        (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    x = torch.randn(3, handler.k, generator=torch.Generator().manual_seed(0)).to(dtype)
    try:
        with torch.inference_mode():
            return "output|" + _digest(ops.onednn_mm(handler, x, None))
    except Exception as e:  # whatever stops it: the oracle cannot vouch for it
        return f"unreadable: {why}; its output neither ({type(e).__name__}: {e})"


class FinalTensors:
    """vLLM worker extension: ``collective_rpc("final_tensor_digests")`` (module docstring)."""

    def final_tensor_digests(self) -> dict[str, str]:
        return tensor_digests(self.model_runner.model)


def serve_digests(port: int, timeout_s: float = 120) -> list[dict[str, str]]:
    """Per worker, `tensor_digests` of a ``vllm serve`` on 127.0.0.1:``port`` started with
    ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls harness.oracle.FinalTensors``."""
    body = json.dumps({"method": "final_tensor_digests"}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/collective_rpc", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())["results"]


def differences(engine: dict[str, str], reference: dict[str, str]) -> list[str]:
    """Names whose digest differs from the reference's, or that only one side has, each with
    both values (empty: the final tensors are equal)."""
    out = []
    for name in sorted(set(engine) | set(reference)):
        a, b = engine.get(name), reference.get(name)
        if a != b or str(a).startswith("unreadable"):  # what cannot be read is not known equal
            out.append(f"{name}: {a} != reference {b}")
    return out
