"""Byte views of tensors: a tensor's bytes without a copy, and a typed tensor over raw bytes.

Everything that hashes, compares, copies into a segment or reads out of one goes through these
helpers, so "the bytes of a tensor" means the same thing everywhere: its elements in memory
order, ``numel * element_size`` bytes, for contiguous tensors only.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["contiguous_stride", "dtype_name", "element_span", "int_view", "squeezed_layout", "tensor_bytes",
           "typed_view"]


def dtype_name(dtype) -> str:
    """A torch dtype's name as keys carry it: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a dense tensor of ``shape``."""
    stride, acc = [], 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= max(int(dim), 1)
    return tuple(reversed(stride))


def element_span(shape: Sequence[int], stride: Sequence[int]) -> int:
    """How many elements a strided tensor reaches from its first one, the last included: 0 when
    it has none (strides of at least 0)."""
    return 1 + sum((int(n) - 1) * int(s) for n, s in zip(shape, stride)) if all(shape) else 0


def squeezed_layout(shape: Sequence[int], stride: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """A strided layout's (size, stride) pairs without its dimensions of size 1, whose strides
    address nothing: two layouts equal here read the same elements in the same order."""
    return tuple((int(n), int(s)) for n, s in zip(shape, stride) if n != 1)


def tensor_bytes(tensor) -> memoryview:
    """A zero-copy byte view of a torch tensor's elements in host memory.

    Args:
        tensor: a CPU ``torch.Tensor`` of any dtype and shape (0-d included) that is
            contiguous.

    Returns:
        A 1-d memoryview of ``tensor.numel() * tensor.element_size()`` bytes (uint8).

    Raises:
        ValueError: the tensor is not on the CPU, not contiguous (its elements are not one
            dense run of bytes, so the bytes hashed would not be the tensor's), or a conjugate
            or negative view (its bytes are not its values; ``.resolve_conj().resolve_neg()``).
    """
    import torch

    if tensor.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor, got one on {tensor.device}")
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError("tensor_bytes needs a tensor whose bytes are its values, got a conjugate or negative view; "
                         "call .resolve_conj().resolve_neg() first")
    if not tensor.is_contiguous():
        raise ValueError(
            f"tensor_bytes needs a contiguous tensor (shape {tuple(tensor.shape)}, "
            f"stride {tuple(tensor.stride())}); call .contiguous() first"
        )
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def int_view(t, widest: int = 8):
    """``t``'s bytes, without a copy, as the widest integer type of at most ``widest`` bytes
    (8, 4, 2 or 1) whose size divides their count: fewer, wider elements for torch to reduce.

    Args:
        t: a contiguous tensor on any device.
        widest: the widest integer size to use, in bytes.

    Returns:
        A 1-d int64/int32/int16/uint8 tensor over ``t``'s memory.
    """
    import torch

    flat = t.detach().reshape(-1).view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if size <= widest and flat.numel() % size == 0:
            return flat.view(dtype)
    return flat


def typed_view(raw, offset: int, dtype, shape, stride):
    """A tensor of ``dtype``/``shape``/``stride`` over ``raw`` (a 1-d uint8 tensor) starting
    ``offset`` bytes in, sharing its memory.  Every segment backend's `Segment.tensor` uses it.

    Raises:
        ValueError: ``offset`` is negative or not a multiple of the item size, or the tensor
            would reach past the end of ``raw``.
    """
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    if offset < 0:  # a slice would count it from the end
        raise ValueError(f"offset {offset} is negative")
    if offset % itemsize:
        raise ValueError(f"offset {offset} is not a multiple of the {dtype} item size {itemsize}")
    shape, stride = tuple(shape), tuple(stride)
    span = element_span(shape, stride)
    if offset + span * itemsize > raw.numel():
        raise ValueError(f"a {span * itemsize}-byte tensor at offset {offset} reaches past the segment's "
                         f"{raw.numel()} bytes")
    return raw[offset : offset + span * itemsize].view(dtype).as_strided(shape, stride)
