"""vLLM's oneDNN handlers (CPU backend): their packed weights, found, checked and shared.

On vLLM's CPU backend, ``process_weights_after_loading`` hands every unquantized linear weight
to ``ops.create_onednn_mm`` (``vllm/model_executor/layers/utils.py``,
``dispatch_cpu_unquantized_gemm``; the vocabulary head through
``vocab_parallel_embedding.py``), and W8A8 int8 weights to ``ops.create_onednn_scaled_mm``
(``model_executor/kernels/linear/scaled_mm/cpu.py``).  Each returns a ``CPUDNNLGEMMHandler``
(``vllm/_custom_ops.py``) whose ``handler_tensor.item()`` is a C++ ``MatMulPrimitiveHandler*``
or ``W8A8MatMulPrimitiveHandler*`` (vLLM ``csrc/cpu/dnnl_helper.h``).  The handler reorders
the weight into the layout oneDNN's kernel wants, into memory oneDNN allocates
(``DNNLMatMulPrimitiveHandler::prepack_weight``, ``csrc/cpu/dnnl_helper.cpp``), and vLLM drops
the torch weight.  This package finds that packed buffer, checks it, and puts a segment's
read-only mapping in its place, so that every engine runs vLLM's own kernel on one copy.

- `probe.py`: `vllm_packs` (does vLLM pack this dtype here) and `probe` (can its packed
  weights be shared here: a self-test on a small handler; the reason when not).
- `handler.py`: `find_packed` (a handler's `PackedWeight`, validated step by step; reads only)
  and `install` (a segment's bytes in place of the private buffer, which oneDNN frees).
- `layout.py`: `PackedLayout` (oneDNN's blocked format and the packing identity) and
  `check_packing` (the packed bytes against the plain weight).
- `model.py`: the handlers a model's layers hold, and the tensors they pin.
- `library.py`: vLLM's extension as a library (symbols from its ELF symbol table, safe reads).

The engine sees packed weights through `engine/packed.py`; of the engine, this package imports
only the attribute walker (`engine/attributes.py`).
"""

from .handler import PackedWeight, find_packed, install
from .layout import PackedLayout, check_packing, packed_offsets
from .model import ModelHandlers, handlers_in, holds_handler, module_handlers, pinned_tensors
from .probe import Support, probe, vllm_packs

__all__ = ["ModelHandlers", "PackedLayout", "PackedWeight", "Support", "check_packing", "find_packed", "handlers_in",
           "holds_handler", "install", "module_handlers", "packed_offsets", "pinned_tensors", "probe",
           "vllm_packs"]
