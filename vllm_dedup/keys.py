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

On a GPU the bytes are not copied to the host to be hashed: `device_fingerprints` computes a
16-byte fingerprint with torch reductions where the tensor lives, and `same_bytes` compares
two tensors exactly there.  Such keys are only ever looked up among keys of the same device
(the registry indexes by device), so the two digest kinds never meet.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

__all__ = [
    "ContentKey", "content_key", "content_keys", "contiguous_stride", "device_fingerprints", "dtype_name",
    "fingerprint_key", "same_bytes", "tensor_bytes", "tensor_key",
]


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



# Device-side fingerprints ---------------------------------------------------------------
#
# The tensor's bytes are read as 32-bit words (16- or 8-bit when the size is not a multiple of
# 4), laid out as a [rows, 1024] matrix plus a tail.  Row sums and column sums are taken in the
# words' own integer type, so torch reads the tensor in place (a wider accumulator would make it
# cast a copy first) and the sums wrap modulo 2**32.  Each vector of sums is then folded with
# odd per-position weights into one int64 (wrapping modulo 2**64).  Integer addition modulo a
# power of two is associative, so the result does not depend on the order in which a GPU's
# reduction adds: equal bytes give equal fingerprints in every process, on every run.  One
# changed word changes its row sum and its column sum; moving rows or columns around changes
# the weighted folds.  Different bytes can still collide (rarely): a fingerprint only proposes
# a candidate, and `same_bytes` decides.  Cost: two reads of the tensor, about what a
# device-to-device copy (one read, one write) costs.

_FP_COLUMNS = 1024
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # 2**64 / golden ratio, as a signed int64


def _weights(n: int, salt: int, device):
    """``n`` odd int64 weights, a fixed function of position and ``salt`` (wrapping)."""
    import torch

    idx = torch.arange(1, n + 1, dtype=torch.int64, device=device) + salt * 0x51ED27
    return (idx * _GOLDEN) | 1


def _fingerprint_pair(t):
    """Two int64 scalars (a [2] tensor on ``t``'s device) fingerprinting ``t``'s bytes."""
    import torch

    words = _int_view(t, widest=4)
    rows = words.numel() // _FP_COLUMNS
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    if rows:
        main = words[: rows * _FP_COLUMNS].view(rows, _FP_COLUMNS)
        acc = words.dtype if words.dtype == torch.int32 else torch.int32
        row_sums = main.sum(dim=1, dtype=acc).to(torch.int64)
        col_sums = main.sum(dim=0, dtype=acc).to(torch.int64)
        out[0] = (row_sums * _weights(rows, 1, t.device)).sum()
        out[1] = (col_sums * _weights(_FP_COLUMNS, 2, t.device)).sum()
    tail = words[rows * _FP_COLUMNS :]
    if tail.numel():
        out[0] += (tail.to(torch.int64) * _weights(tail.numel(), 3, t.device)).sum()
    return out


def device_fingerprints(tensors) -> list[bytes]:
    """16-byte fingerprints of tensors' bytes, computed on the tensors' own device.

    Nothing but the 16 bytes per tensor crosses to the host: one transfer per device for the
    whole list.  See the comment above for how it is computed and why it is deterministic.

    Args:
        tensors: contiguous torch tensors of any dtype, shape and device (CPU included).

    Returns:
        One 16-byte digest per tensor, in order.  Equal bytes (and equal byte count) give
        equal digests; different bytes almost always give different ones.

    Raises:
        ValueError: a tensor is not contiguous.
    """
    import torch

    tensors = list(tensors)
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"device_fingerprints needs contiguous tensors, got stride {tuple(t.stride())} "
                             f"for shape {tuple(t.shape)}")
    by_device: dict = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[bytes] = [b""] * len(tensors)
    for indices in by_device.values():
        pairs = torch.stack([_fingerprint_pair(tensors[i]) for i in indices]).cpu()
        for i, pair in zip(indices, pairs):
            out[i] = pair.numpy().astype("<i8").tobytes()
    return out


def fingerprint_key(tensor, digest: bytes) -> ContentKey:
    """The content key of a device tensor whose `device_fingerprints` digest is ``digest``."""
    return ContentKey(digest, dtype_name(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride()))


def same_bytes(a, b) -> bool:
    """Whether two tensors hold exactly the same bytes, compared where they live.

    Compares bits, not values: ``-0.0`` and ``0.0`` differ, a NaN equals the same NaN.  Both
    tensors must be contiguous, on one device; their dtypes and shapes may differ (only the
    bytes count).  Runs at memory bandwidth on a GPU (reads both once).
    """
    if a.numel() * a.element_size() != b.numel() * b.element_size():
        return False
    return bool((_int_view(a) == _int_view(b)).all())


def _int_view(t, widest: int = 8):
    """``t``'s bytes, without a copy, as the widest integer type of at most ``widest`` bytes
    (8, 4, 2 or 1) whose size divides their count: fewer, wider elements for torch to reduce."""
    import torch

    flat = t.detach().reshape(-1).view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if size <= widest and flat.numel() % size == 0:
            return flat.view(dtype)
    return flat
