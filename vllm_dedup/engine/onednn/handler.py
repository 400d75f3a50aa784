"""vLLM's oneDNN handler: its packed weight found (reads only) and replaced by a segment's bytes.

Note [reading another library's objects]
    The only private layout read is vLLM's handler (``DNNLMatMulPrimitiveHandler``: vptr, N, N
    stride, K, K stride, b/c types, ``memory_cache_`` (a libstdc++ ``unordered_map<int,
    dnnl::memory>``), ``runtime_memory_ptrs_`` (a vector of 8 pairs)) and the map's nodes.
    Every word is read through ``/proc/self/mem`` (a bad address is an error, not a crash) and
    checked before use: vtables by address, N and K against the Python handler, the map's
    bucket and node counts, exactly one ``DNNL_ARG_WEIGHTS`` entry, every ``dnnl_memory`` by its
    vtable, ``runtime_memory_ptrs_[0..1]`` against the descriptors oneDNN reports for the
    source and destination memories, and the weights' descriptor (2-D, ``{K, N}``, the
    handler's type, blocked, dense) through oneDNN's own queries.  Anything unexpected raises
    `PackedWeightError` before anything is written.

Note [how the packed buffer is replaced]
    oneDNN's own C function ``dnnl_memory_set_data_handle`` (``src/common/memory.cpp``) does
    it: it calls ``cpu_memory_storage_t::set_data_handle`` (``src/cpu/cpu_memory_storage.hpp``),
    which assigns ``data_ = unique_ptr(handle, release)``: the buffer oneDNN allocated is freed
    with the deleter it had (``destroy``, i.e. ``free``), and the new one gets the no-op
    ``release`` that oneDNN gives every user-provided buffer.  The matmul primitive reads the
    weights' address from ``memory_cache_`` at every ``execute`` (``matmul.execute(stream,
    memory_cache_)``), so the kernel reads the segment from the next call on.  Nothing of
    oneDNN's is written by us; the function does not zero-pad (its body calls only the
    storage's virtual get/set and verbose logging in oneDNN 3.13, bundled with vLLM 0.32).
    The other ways, and why not, are in docs/architecture.md ("Packed linear weights on the
    CPU").

Note [lifetimes]
    After `install` the handler's storage does not own the segment's mapping (``release`` is a
    no-op), so the mapping must outlive the C++ handler: `install` keeps the mapping's tensor
    on the Python ``CPUDNNLGEMMHandler``, whose ``__del__`` deletes the C++ handler before the
    instance's attributes (and so the mapping) go.  Destroying a handler is therefore safe and
    leaks nothing.  W8A8 handlers also keep a raw pointer to the layer's ``weight_scale``
    tensor (``W8A8MatMulPrimitiveHandler::Args::b_scales_ptr``, wrapped as a user-memory
    ``dnnl::memory`` under ``DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS``): once the handler exists,
    that tensor's storage must never be swapped or freed (sharing it would leave the handler
    reading freed memory).

Note [a handler found once]
    A first engine asks for each handler's packed weight five times (staging it, installing its
    segment, recording the recipe, the sharing pass, and checking which segments it reads), and
    the full check (above) reads some forty words through ``/proc/self/mem`` and queries oneDNN
    for the layout: 0.12-0.15 s of a 1.2B model's load over its 91 handlers.  So what was found
    (the weights' memory, its address and layout) is kept on the Python handler (``_FOUND``)
    with the C++ handler's address and the handler tensor it came from, and given again while
    both are the same and oneDNN still reports the same data handle for the weights' memory (one
    C call).  Not the `PackedWeight` itself: it refers to the handler, and a reference cycle
    would keep a dropped handler, and the packed buffer or segment its ``__del__`` frees, alive
    until a garbage collection.  What the full check validated cannot have changed meanwhile:
    the Python handler owns its C++ handler (``CPUDNNLGEMMHandler.__del__`` deletes it), vLLM
    builds the handler's memory map once in the constructor, and the only writer of the
    weights' data handle after that is `install`, which keeps the new address.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import NamedTuple

from ...errors import PackedWeightError, SharedWeightsError
from . import library as C
from .layout import PackedLayout, read_layout

__all__ = ["PackedWeight", "find_packed", "install"]

# vLLM's handler (csrc/cpu/dnnl_helper.h, DNNLMatMulPrimitiveHandler) as laid out by g++ on
# x86-64 with libstdc++: byte offsets of the fields read (Note [reading another library's objects]).
_H_N, _H_N_STRIDE, _H_K, _H_K_STRIDE, _H_TYPES = 8, 16, 24, 32, 40
_H_MAP = 48                         # std::unordered_map<int, dnnl::memory>: 56 bytes
_H_RUNTIME_PTRS = 104               # std::vector<std::pair<memory_storage_t*, dnnl_memory_desc*>>
_RUNTIME_PTRS = 8                   # runtime_memory_ptrs_(8) in the constructor (dnnl_helper.cpp)
_MAX_MAP_ENTRIES = 16

HOLDS = "_vllm_dedup_segments"     # attribute of the Python handler: the mappings it reads
_FOUND = "_vllm_dedup_found"       # attribute of the Python handler: a `_Found` (Note [a handler found once])


class _Found(NamedTuple):
    """What `find_packed` found of one handler, kept on it (Note [a handler found once]): the
    handler tensor and the C++ handler's address it came from, the weights' ``dnnl_memory``, the
    packed bytes' address and their layout."""

    tensor: object
    handle: int
    memory: int
    address: int
    layout: PackedLayout


@dataclass(frozen=True)
class PackedWeight:
    """One handler's packed weight, as `find_packed` found and checked it.

    Attributes:
        handler: vLLM's ``CPUDNNLGEMMHandler`` (Python object).
        memory: address of the ``dnnl_memory`` holding the weights (``DNNL_ARG_WEIGHTS``).
        address: the packed bytes' address when found.
        layout: their `PackedLayout`.
    """

    handler: object
    memory: int
    address: int
    layout: PackedLayout

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def view(self) -> memoryview:
        """The packed bytes, zero-copy (a read-only view at ``address``), valid until `install`
        replaces them (this object keeps the handler alive).

        Raises:
            PackedWeightError: `install` replaced them since this was found.
        """
        if not self.reads_own_buffer():
            raise PackedWeightError("the handler's packed weight moved since it was found")
        return memoryview((ctypes.c_uint8 * self.nbytes).from_address(self.address)).toreadonly()

    def reads_own_buffer(self) -> bool:
        """Whether the handler still reads the buffer at ``address`` (no `install` since this
        was found, nor one that oneDNN took before it failed)."""
        return C.library().data_handle(self.memory) == self.address

    @property
    def shared(self) -> bool:
        """Whether `install` put a segment's bytes in this handler."""
        return bool(getattr(self.handler, HOLDS, None))


def find_packed(handler) -> PackedWeight:
    """The packed weight of one of vLLM's ``CPUDNNLGEMMHandler`` objects, validated (Note
    [reading another library's objects]) once per handler (Note [a handler found once]).  Reads
    only; writes nothing in the library (the result is kept on the Python handler).

    Raises:
        PackedWeightError: this build is not supported (`probe`), or a check failed: the
            message names it.
    """
    lib = C.library()
    tensor = getattr(handler, "handler_tensor", None)
    if tensor is None or getattr(handler, "n", -1) <= 0 or getattr(handler, "k", -1) <= 0:
        raise PackedWeightError("not a live vLLM oneDNN handler")
    h = int(tensor.item())
    found = _found_before(lib, handler, tensor, h)
    if found is not None:
        return found
    vptr, = lib.words(h, "Q")
    kind = lib.vtables.get(vptr)
    if kind is None:
        raise PackedWeightError(f"the object at {h:#x} is neither a MatMulPrimitiveHandler nor a "
                                "W8A8MatMulPrimitiveHandler of this library")
    n, n_stride, k, k_stride, b_type, c_type = lib.words(h + _H_N, "qqqqii")
    if (n, k) != (handler.n, handler.k):
        raise PackedWeightError(f"the handler says N={n}, K={k}; vLLM's Python side {handler.n}, {handler.k}")
    if b_type not in C.DATA_TYPES or c_type not in C.DATA_TYPES:
        raise PackedWeightError(f"unexpected data types {b_type}, {c_type} in the handler")
    entries = _map_entries(lib, h + _H_MAP)
    if not {C.ARG_WEIGHTS, C.ARG_SRC, C.ARG_DST} <= entries.keys():  # each once: `_map_entries` refuses repeats
        raise PackedWeightError(f"the handler's memory map has keys {sorted(entries)}, expected one weights "
                                "entry and the source and destination")
    for key, memory in entries.items():
        if lib.words(memory, "Q")[0] != lib.memory_vptr:
            raise PackedWeightError(f"map entry {key} is not a dnnl_memory")
    begin, end, _cap = lib.words(h + _H_RUNTIME_PTRS, "QQQ")
    if end - begin != _RUNTIME_PTRS * 16:
        raise PackedWeightError(f"the handler's runtime pointers are {(end - begin) // 16}, not {_RUNTIME_PTRS}")
    _, src_md, _, dst_md = lib.words(begin, "QQQQ")
    if (src_md, dst_md) != (lib.memory_desc(entries[C.ARG_SRC]), lib.memory_desc(entries[C.ARG_DST])):
        raise PackedWeightError("the handler's runtime pointers do not match its source and destination memories")
    memory = entries[C.ARG_WEIGHTS]
    layout = read_layout(lib, lib.memory_desc(memory), kind, b_type, k, n)
    address = lib.data_handle(memory)
    if not address or address % C.ALIGNMENT:
        raise PackedWeightError(f"the packed weight's address {address:#x} is not {C.ALIGNMENT}-byte aligned")
    lib.read(address, 1)
    lib.read(address + layout.nbytes - 1, 1)
    setattr(handler, _FOUND, _Found(tensor, h, memory, address, layout))
    return PackedWeight(handler, memory, address, layout)


def _found_before(lib: C.Library, handler, tensor, h: int) -> PackedWeight | None:
    """What was found of ``handler`` before, if it still describes it (Note [a handler found
    once]): the same handler tensor and C++ handler, and the weights' data handle unchanged."""
    kept = getattr(handler, _FOUND, None)
    if kept is None or kept.tensor is not tensor or kept.handle != h or lib.data_handle(kept.memory) != kept.address:
        return None
    return PackedWeight(handler, kept.memory, kept.address, kept.layout)


def _map_entries(lib: C.Library, table: int) -> dict[int, int]:
    """key -> dnnl_memory* of a libstdc++ ``unordered_map<int, dnnl::memory>`` at ``table``:
    ``_M_buckets, _M_bucket_count, _M_before_begin._M_nxt, _M_element_count, _M_rehash_policy
    (16 bytes), _M_single_bucket``; nodes ``{next, int key, dnnl::memory (a shared_ptr, raw
    pointer first)}`` (``dnnl.hpp``: ``handle<T>`` holds a ``std::shared_ptr``)."""
    buckets, bucket_count, node, count = lib.words(table, "QQQQ")
    if not 1 <= count <= _MAX_MAP_ENTRIES or not 1 <= bucket_count <= 1 << 16:
        raise PackedWeightError(f"the handler's memory map has {count} entries in {bucket_count} buckets")
    if bucket_count == 1 and buckets != table + 48:
        raise PackedWeightError("the handler's memory map is not laid out as libstdc++'s")
    out: dict[int, int] = {}
    for _ in range(count):
        if not node:
            break
        node, key, _pad, memory, _control = lib.words(node, "QiiQQ")
        if key in out or not memory:
            raise PackedWeightError(f"the handler's memory map repeats key {key} or holds an empty memory")
        out[key] = memory
    if len(out) != count or node:
        raise PackedWeightError(f"the handler's memory map lists {len(out)} nodes, not {count}")
    return out


def install(packed: PackedWeight, data, compare: bool = True) -> int:
    """Make ``packed``'s handler read ``data`` (a CPU uint8 tensor of ``packed.nbytes`` bytes
    over a sealed segment's read-only mapping, ``HostSegment.tensor``) instead of its private
    buffer, which oneDNN frees (Note [how the packed buffer is replaced]).  ``data`` is kept on
    the handler for as long as it lives (Note [lifetimes]).

    Args:
        packed: from `find_packed`, for a handler nothing runs on meanwhile.
        data: the segment's bytes; 64-byte aligned.
        compare: first check that ``data`` holds exactly the handler's current bytes (never a
            wrong weight).  ``False`` only where that is known already: a handler built from
            placeholder bytes (zero pages) whose segment was matched by content key, or bytes
            just copied from the handler's own (`staging.py`) or compared before
            (`packed.PackedSlot.install`).

    Returns:
        The bytes of private memory given back (0 if the handler already read a segment).

    Raises:
        PackedWeightError: ``data`` does not fit (size, alignment, device), differs from the
            packed bytes, or oneDNN refused; the handler is unchanged.
        SharedWeightsError: oneDNN took the new handle, then reads another: its own buffer
            may be freed already, so the layer would compute with bytes nobody owns, and no
            private copy is left to fall back to (the load must stop; ``data`` is kept on the
            handler, whatever it reads).
    """
    import torch

    lib = C.library()
    if (not isinstance(data, torch.Tensor) or data.device.type != "cpu" or data.dtype != torch.uint8
            or not data.is_contiguous() or data.numel() != packed.nbytes):
        raise PackedWeightError(f"the replacement must be a contiguous CPU uint8 tensor of {packed.nbytes} bytes")
    address = data.data_ptr()
    if address % C.ALIGNMENT:
        raise PackedWeightError(f"the replacement at {address:#x} is not {C.ALIGNMENT}-byte aligned")
    current = lib.data_handle(packed.memory)
    if current != packed.address:
        raise PackedWeightError("the handler's packed weight moved since it was found")
    if compare and C.memcmp(current, address, packed.nbytes) != 0:
        raise PackedWeightError("the replacement's bytes differ from the handler's packed weight")
    was_private = not packed.shared
    before = getattr(packed.handler, HOLDS, None) or []
    if lib.set_data_handle(packed.memory, address) != C.SUCCESS:
        raise PackedWeightError("oneDNN refused the new data handle")
    # Both kept until it is sure which one the handler reads: a mapping must outlive any
    # handler that took it.
    setattr(packed.handler, HOLDS, [*before, data])
    if lib.data_handle(packed.memory) != address:
        raise SharedWeightsError(
            "oneDNN took a shared packed weight's data handle but reads another buffer, so a linear layer would "
            "compute with bytes nobody owns: this load stops (the engine loads again without sharing, unless "
            "on_registry_error='fail'). If it recurs, set cpu_linear='private' in the dedup config (packed weights "
            "stay private) and report this oneDNN build")
    # The handler reads ``data`` alone from now on: a segment it read before (one this engine
    # staged, `staging.py`) is let go of here, and freed with its last mapping.
    setattr(packed.handler, HOLDS, [data])
    kept = getattr(packed.handler, _FOUND, None)
    if kept is not None and kept.memory == packed.memory:  # Note [a handler found once]
        setattr(packed.handler, _FOUND, kept._replace(address=address))
    return packed.nbytes if was_private else 0


