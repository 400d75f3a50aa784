"""A packed weight's layout: oneDNN's blocked format, checked, and how to read an element of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from ...errors import PackedWeightError
from . import library as C

if TYPE_CHECKING:  # the handler module imports this one
    from .handler import PackedWeight

__all__ = ["PackedLayout", "check_packing", "packed_offsets", "read_layout"]


@dataclass(frozen=True)
class PackedLayout:
    """How a packed weight's bytes are laid out, and what made them: the packing identity.

    Two packed buffers with equal bytes and equal ``identity`` are interchangeable in a handler
    of this vLLM build on this machine.  ``dims`` are oneDNN's ``{K, N}`` (vLLM passes the
    weight transposed, ``csrc/cpu/dnnl_helper.cpp``); ``strides`` are the outer blocks' strides
    in elements; ``inner_blks``/``inner_idxs`` the inner blocks (``tag`` spells them the way
    oneDNN's format tags do, e.g. ``BA16a64b2a``); ``nbytes`` is oneDNN's
    ``dnnl_memory_desc_get_size`` (padding, and any extra such as int8 compensation, included).
    """

    kind: str                       # "matmul" (unquantized) or "w8a8"
    dtype: str                      # torch dtype name of the elements
    dims: tuple[int, ...]
    padded_dims: tuple[int, ...]
    strides: tuple[int, ...]
    inner_blks: tuple[int, ...]
    inner_idxs: tuple[int, ...]
    nbytes: int
    library: str                    # which vLLM extension holds the kernel: _C, _C_AVX512, _C_AVX2
    onednn: str                     # oneDNN's version and commit (dnnl_version)
    isa: int                        # dnnl_get_effective_cpu_isa
    vllm: str
    descriptor: str = ""            # XXH3-128 of oneDNN's serialized memory descriptor (dnnl_memory_desc_get_blob)
    build_id: str = ""              # the extension's GNU build id (ELF .note.gnu.build-id), hex

    @property
    def tag(self) -> str:
        """oneDNN's name for the layout, e.g. ``BA16a64b2a`` (outer dims by stride, blocked ones
        upper case, then the inner blocks)."""
        letters = "abcdefghijkl"
        order = sorted(range(len(self.dims)), key=lambda d: -self.strides[d])
        blocked = set(self.inner_idxs)
        outer = "".join(letters[d].upper() if d in blocked else letters[d] for d in order)
        return outer + "".join(f"{b}{letters[d]}" for b, d in zip(self.inner_blks, self.inner_idxs))

    @property
    def identity(self) -> str:
        """Everything that decides how the bytes are read, as one string: part of a packed
        buffer's content key.  The layout is oneDNN's own exact memory descriptor (its
        serialized blob, which holds every field oneDNN reads, padding and extra flags such as
        int8 compensation included), and the code that reads it is the extension's build id
        (one binary, whatever its path) on the ISA oneDNN dispatches to here."""
        return f"onednn-packed/2|{self.kind}|md={self.descriptor}|build={self.build_id}|isa={self.isa:#x}"


def read_layout(lib: C.Library, md: int, kind: str, b_type: int, k: int, n: int) -> PackedLayout:
    """The weights' descriptor, checked: 2-D ``{K, N}`` of the handler's type, blocked, no
    offsets, and dense (its size is what its strides and blocks span)."""
    ndims = lib.query_int(md, C.QUERY_NDIMS)
    if ndims != 2:
        raise PackedWeightError(f"the packed weight has {ndims} dimensions, not 2")
    dims = lib.query_dims(md, C.QUERY_DIMS, 2)
    dtype = lib.query_int(md, C.QUERY_DATA_TYPE)
    if dims != (k, n) or dtype != b_type:
        raise PackedWeightError(f"the packed weight is {dims} of type {dtype}, expected {(k, n)} of {b_type}")
    if lib.query_int(md, C.QUERY_FORMAT_KIND) != C.BLOCKED:
        raise PackedWeightError("the packed weight's format is not a blocked one")
    if lib.query_s64(md, C.QUERY_SUBMEMORY_OFFSET) or any(lib.query_dims(md, C.QUERY_PADDED_OFFSETS, 2)):
        raise PackedWeightError("the packed weight has offsets")
    padded = lib.query_dims(md, C.QUERY_PADDED_DIMS, 2)
    strides = lib.query_dims(md, C.QUERY_STRIDES, 2)
    nblks = lib.query_int(md, C.QUERY_INNER_NBLKS)
    if not 0 <= nblks <= C.MAX_NDIMS:
        raise PackedWeightError(f"the packed weight has {nblks} inner blocks")
    blks = lib.query_dims(md, C.QUERY_INNER_BLKS, nblks)
    idxs = lib.query_dims(md, C.QUERY_INNER_IDXS, nblks)
    name, size = C.DATA_TYPES[dtype]
    nbytes = lib.desc_get_size(md)
    layout = PackedLayout(kind, name, dims, padded, strides, blks, idxs, nbytes, lib.name, lib.onednn,
                          lib.isa, lib.vllm, xxhash.xxh3_128_hexdigest(lib.descriptor_blob(md)), lib.build_id)
    per_dim = [_product(b for b, d in zip(blks, idxs) if d == dim) for dim in range(2)]
    if any(i not in (0, 1) for i in idxs) or any(p % b or p < d for p, b, d in zip(padded, per_dim, dims)):
        raise PackedWeightError(f"the packed weight's blocks {layout.tag} do not divide its padded dims {padded}")
    span = _product(blks)
    for d in sorted(range(2), key=lambda d: strides[d]):  # dense: each outer stride spans what lies inside
        if padded[d] == per_dim[d]:
            continue  # one outer block: its stride is never used
        if strides[d] != span:
            raise PackedWeightError(f"the packed weight ({layout.tag}, strides {strides}) is not dense")
        span *= padded[d] // per_dim[d]
    if nbytes < span * size:
        raise PackedWeightError(f"the packed weight's size {nbytes} is below its {span * size} elements' bytes")
    return layout


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def packed_offsets(layout: PackedLayout, k_index, n_index):
    """Element offsets in the packed buffer of the logical elements ``(k_index[i], n_index[i])``
    (int64 tensors) of the ``{K, N}`` weight: outer block indices times ``strides``, plus the
    position within the inner blocks (oneDNN's blocked layout: ``doc/advanced/understanding_memory_formats``)."""
    index = (k_index, n_index)
    per_dim = [_product(b for b, d in zip(layout.inner_blks, layout.inner_idxs) if d == dim) for dim in range(2)]
    offset = sum((index[d] // per_dim[d]) * layout.strides[d] for d in range(2))
    inner = 0
    for i, (blk, dim) in enumerate(zip(layout.inner_blks, layout.inner_idxs)):
        # the digit of this block: the dim's remainder over the blocks of the same dim inside it
        below = _product(b for b, d in zip(layout.inner_blks[i + 1:], layout.inner_idxs[i + 1:]) if d == dim)
        inner = inner * blk + (index[dim] % per_dim[dim]) // below % blk
    return offset + inner


def check_packing(packed: PackedWeight, weight, sample: int | None = 4096, seed: int = 0) -> None:
    """Check that the packed bytes are ``weight`` in ``packed.layout``: ``weight`` is the
    ``{K, N}`` tensor vLLM gave the handler (``layer.weight.t()``).  ``sample``: that many
    random elements (and the four corners); ``None``: every element, and every padding
    element is zero.  Bit-exact (the bytes are compared, not the values).

    Raises:
        PackedWeightError: a mismatch (the first one is named), or the weight's shape or type
            is not the layout's.
    """
    import torch

    layout = packed.layout
    if tuple(weight.shape) != layout.dims or str(weight.dtype).removeprefix("torch.") != layout.dtype:
        raise PackedWeightError(f"a {tuple(weight.shape)} {weight.dtype} weight is not a {layout.dims} {layout.dtype} packing")
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[weight.element_size()]
    plain = weight.detach().view(bits)
    raw = torch.frombuffer(bytearray(packed.view()), dtype=torch.uint8)[: _product(layout.padded_dims) * weight.element_size()]
    stored = raw.view(bits)
    k, n = layout.dims
    if sample is None:
        seen = torch.zeros(stored.numel(), dtype=torch.bool)
        for start in range(0, k, max(1, (1 << 22) // n)):
            stop = min(k, start + max(1, (1 << 22) // n))
            ks = torch.arange(start, stop).repeat_interleave(n)
            ns = torch.arange(n).repeat(stop - start)
            _compare(stored, plain, layout, ks, ns)
            seen[packed_offsets(layout, ks, ns)] = True
        if bool((stored[~seen] != 0).any()):
            raise PackedWeightError("the packed weight's padding is not zero")
        return
    generator = torch.Generator().manual_seed(seed)
    ks = torch.cat([torch.tensor([0, 0, k - 1, k - 1]), torch.randint(0, k, (sample,), generator=generator)])
    ns = torch.cat([torch.tensor([0, n - 1, 0, n - 1]), torch.randint(0, n, (sample,), generator=generator)])
    _compare(stored, plain, layout, ks, ns)


def _compare(stored, plain, layout, ks, ns) -> None:
    got = stored[packed_offsets(layout, ks, ns)]
    want = plain[ks, ns]
    bad = (got != want).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise PackedWeightError(f"packed element ({int(ks[i])}, {int(ns[i])}) of {layout.tag} holds other bits "
                                "than the weight")
