"""Content keys: what names a weight tensor's bytes and layout.

A content key is the XXH3-128 digest of a tensor's bytes together with its dtype, shape and
stride.  Two tensors with equal keys are, with overwhelming probability, bit-identical and
laid out the same way, so one resident copy can serve both.  "Overwhelming" is not "certain":
wherever a key decides that memory is swapped, the bytes are compared exactly first (see
DESIGN.md, "Content keys"), so a collision costs time, never correctness.

Hashing is zero-copy: the digest is taken over a memoryview of host memory or of a file's
mmap, never over a copy (a copy first would cut the rate to about a quarter, ENV-NOTES.md).
`content_keys` hashes many buffers in parallel threads; xxhash releases the GIL while it
hashes, so threads overlap page faults on mmapped files with hashing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

__all__ = ["ContentKey", "content_key", "content_keys", "contiguous_stride", "dtype_name", "tensor_bytes", "tensor_key"]


@dataclass(frozen=True, slots=True)
class ContentKey:
    """The identity of a tensor's content.

    Attributes:
        digest: 16 bytes, XXH3-128 of the tensor's bytes in memory order.
        dtype: the element type's name: torch's (``"bfloat16"``) for tensors, or the file
            format's own for raw blocks (``"gguf:Q4_1"``).
        shape: the tensor's shape, in elements (for GGUF blocks, GGUF's logical shape).
        stride: the tensor's strides, in elements.
    """

    digest: bytes
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def __str__(self) -> str:
        dims = ",".join(map(str, self.shape))
        strides = ",".join(map(str, self.stride))
        return f"{self.dtype}[{dims}]/[{strides}]:{self.digest.hex()}"

    @classmethod
    def parse(cls, text: str) -> ContentKey:
        """Inverse of ``str(key)``.

        Raises:
            ValueError: ``text`` is not a key's string form.
        """
        try:
            layout, digest = text.rsplit(":", 1)
            dtype, rest = layout.split("[", 1)
            dims, strides = rest.split("]/[", 1)
            if not strides.endswith("]"):
                raise ValueError("missing closing bracket")

            def ints(s: str) -> tuple[int, ...]:
                return tuple(int(x) for x in s.split(",")) if s else ()

            raw = bytes.fromhex(digest)
            if len(raw) != 16:
                raise ValueError("digest is not 16 bytes")
            return cls(raw, dtype, ints(dims), ints(strides[:-1]))
        except ValueError as e:
            raise ValueError(f"not a content key: {text!r} ({e})") from None


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a dense tensor of ``shape``."""
    stride, acc = [], 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= max(int(dim), 1)
    return tuple(reversed(stride))


def content_key(
    data, dtype: str, shape: Sequence[int], stride: Sequence[int] | None = None
) -> ContentKey:
    """Key of one buffer.

    Args:
        data: any object exposing the buffer protocol over the tensor's bytes (memoryview,
            numpy array, mmap slice); read in place, never copied.
        dtype: element type name (see `ContentKey.dtype`).
        shape: shape in elements.
        stride: strides in elements; row-major when omitted.
    """
    shape = tuple(int(d) for d in shape)
    stride = contiguous_stride(shape) if stride is None else tuple(int(s) for s in stride)
    return ContentKey(xxhash.xxh3_128_digest(data), dtype, shape, stride)


def dtype_name(dtype) -> str:
    """A torch dtype's name as keys carry it: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def tensor_key(tensor) -> ContentKey:
    """Key of a contiguous CPU torch tensor: its bytes (zero-copy), dtype, shape and stride.

    Raises:
        ValueError: see `tensor_bytes`.
    """
    return content_key(tensor_bytes(tensor), dtype_name(tensor.dtype), tensor.shape, tensor.stride())


def tensor_bytes(tensor) -> memoryview:
    """A zero-copy byte view of a torch tensor's elements in host memory.

    Args:
        tensor: a CPU ``torch.Tensor`` of any dtype and shape (0-d included) that is
            contiguous.

    Returns:
        A 1-d memoryview of ``tensor.numel() * tensor.element_size()`` bytes (uint8).

    Raises:
        ValueError: the tensor is not on the CPU, or not contiguous (its elements are not
            one dense run of bytes, so the bytes hashed would not be the tensor's).
    """
    import torch

    if tensor.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(
            f"tensor_bytes needs a contiguous tensor (shape {tuple(tensor.shape)}, "
            f"stride {tuple(tensor.stride())}); call .contiguous() first"
        )
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def content_keys(
    loaders: Iterable[Callable[[], ContentKey]],
    threads: int | None = None,
    on_done: Callable[[int], None] | None = None,
) -> list[ContentKey]:
    """Run key computations in parallel threads, keeping their order.

    Args:
        loaders: callables, each computing one key (typically ``content_key`` over an
            mmapped tensor).  Exceptions propagate to the caller.
        threads: worker threads; default ``min(8, os.cpu_count())``.
        on_done: called with each finished key's index, in completion order (progress bars).
    """
    loaders = list(loaders)
    threads = threads or min(8, os.cpu_count() or 1)
    if threads <= 1 or len(loaders) <= 1:
        out = []
        for i, fn in enumerate(loaders):
            out.append(fn())
            if on_done:
                on_done(i)
        return out
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vllm-dedup-key") as pool:
        futures = [pool.submit(fn) for fn in loaders]
        out = []
        for i, fut in enumerate(futures):
            out.append(fut.result())
            if on_done:
                on_done(i)
        return out

