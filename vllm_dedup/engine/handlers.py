"""vLLM's oneDNN handlers recorded where they are created, with the tensors they read through raw pointers.

On the CPU backend a W8A8 int8 layer's post-processing calls
``ops.create_onednn_scaled_mm(weight, weight_scales, ...)`` (``vllm/_custom_ops.py``, from
``model_executor/kernels/linear/scaled_mm/cpu.py``).  The C++ handler keeps
``weight_scales.data_ptr()`` (``W8A8MatMulPrimitiveHandler::Args::b_scales_ptr``, vLLM
``csrc/cpu/dnnl_helper.h``) and reads it at every matmul, but holds no reference to the tensor.

Note [tensors a handler reads through raw pointers]
    The sharing pass swaps a layer's tensors for segment mappings and lets the private copies
    go.  Swapping the ``weight_scale`` a handler points at frees the bytes the handler still
    reads; the next tensor allocated there (another linear's scales, say) then scales this
    linear's output: wrong outputs, with every parameter equal to a plain load's.  Finding
    afterwards which handler reads which tensor is a search through attributes and closures
    (`onednn.handlers_in`) that can miss a handler held somewhere it does not look.  So the
    fact is recorded at its source: `recorded_handlers` wraps the creating function for the
    block, and each handler made there keeps an alias of the tensors it reads on itself
    (`READS`: ``detach()``, the same storage), so that storage lives exactly as long as the
    handler, whatever becomes of the layer's parameter (the sharing pass rebinds a parameter's
    ``.data``, which would drop the parameter's hold on it); `HandlerRecord.pinned` gives the
    sharing pass exactly those storages to leave in place.
    ``create_onednn_mm`` (unquantized) copies its weight into the packed buffer and keeps no
    pointer to a caller's tensor, so it needs no record.
"""

from __future__ import annotations

import contextlib
import weakref

__all__ = ["READS", "HandlerRecord", "recorded_handlers"]

READS = "dedup_reads"  # attribute of a Python CPUDNNLGEMMHandler: the tensors its C++ handler points at


class HandlerRecord:
    """The oneDNN handlers created inside one `recorded_handlers` block (weak references: a
    handler vLLM drops is not kept alive here)."""

    def __init__(self):
        self._handlers: list[weakref.ref] = []

    def add(self, handler, reads: tuple) -> None:
        """Record ``handler`` (a ``CPUDNNLGEMMHandler``) and attach ``reads`` to it (`READS`)."""
        setattr(handler, READS, reads)
        self._handlers.append(weakref.ref(handler))

    def handlers(self) -> list:
        """The recorded handlers that are still alive, in creation order."""
        return [h for h in (ref() for ref in self._handlers) if h is not None]

    def pinned(self) -> set[int]:
        """The storages (``untyped_storage().data_ptr()``) that live recorded handlers read
        through raw pointers: no tensor over them may be swapped (Note [tensors a handler reads
        through raw pointers])."""
        return {t.untyped_storage().data_ptr() for h in self.handlers() for t in getattr(h, READS, ())}


@contextlib.contextmanager
def recorded_handlers(record: HandlerRecord | None = None):
    """Within the block, every handler vLLM creates with ``ops.create_onednn_scaled_mm`` is
    recorded in ``record`` (a new `HandlerRecord` if None), which the block yields, and keeps
    its ``weight_scales`` tensor alive (Note [tensors a handler reads through raw pointers]).
    Where vLLM or its CPU extension is not there no handler can be made, and the record stays
    empty.  The function is restored after."""
    record = HandlerRecord() if record is None else record
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        yield record
        return
    create = getattr(ops, "create_onednn_scaled_mm", None)
    if create is None:
        yield record
        return

    def create_recorded(weight, weight_scales, *args, **kwargs):
        handler = create(weight, weight_scales, *args, **kwargs)
        record.add(handler, (weight_scales.detach(),))
        return handler

    ops.create_onednn_scaled_mm = create_recorded
    try:
        yield record
    finally:
        ops.create_onednn_scaled_mm = create
