"""Content keys: what names a weight tensor's bytes and layout.

A content key is a digest of a tensor's bytes together with its dtype, shape and stride.  Two
kinds, told apart by the digest's length:

- **content keys** of the tensors an engine holds (`content_key`, `tensor_key`): XXH3-128,
  16 bytes.  Fast, not collision-resistant: wherever such a key decides that memory is
  swapped, the bytes are compared exactly first (docs/architecture.md, "Invariants"), so a
  collision, even a crafted one, costs time, never correctness;
- **source keys** of checkpoint tensors (`source_key`): BLAKE3-256, 32 bytes.  The fast path
  trusts them without reading the bytes (a recipe matches a checkpoint by its source keys), and
  a checkpoint is untrusted input, so they must be collision-resistant: nobody can make a
  checkpoint whose tensors claim another checkpoint's keys.  BLAKE3 runs at about a quarter
  of XXH3's rate and four times SHA-256's here (``benchmarks/scan_throughput.py``).

A tensor in memory is hashed where it lies: the digest is taken over a memoryview of host
memory, never over a copy (a copy first cuts xxhash's rate to about a quarter).  A checkpoint
file's tensors are hashed as ``pread`` reads them, a MiB at a time (`source_key_of_chunks`;
Note [reading, not mapping, to hash] in `checkpoint/readers.py`).  `content_keys` hashes many
buffers in parallel threads; xxhash and BLAKE3 release the GIL while they hash, so threads
overlap reads with hashing.

On a GPU the bytes are not copied to the host to be hashed: `fingerprint.py` computes keys on
the device instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from .views import contiguous_stride, dtype_name, tensor_bytes

__all__ = ["SOURCE_DIGEST_BYTES", "ContentKey", "content_key", "content_keys", "source_key", "source_key_of_chunks",
           "tensor_key"]

CONTENT_DIGEST_BYTES = 16  # XXH3-128
SOURCE_DIGEST_BYTES = 32  # BLAKE3-256


@dataclass(frozen=True, slots=True)
class ContentKey:
    """The identity of a tensor's content.

    Attributes:
        digest: of the tensor's bytes in memory order: 16 bytes of XXH3-128 (a content key)
            or 32 bytes of BLAKE3-256 (a source key); see the module docstring.
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
            if len(raw) not in (CONTENT_DIGEST_BYTES, SOURCE_DIGEST_BYTES):
                raise ValueError(f"digest is {len(raw)} bytes, not {CONTENT_DIGEST_BYTES} or {SOURCE_DIGEST_BYTES}")
            return cls(raw, dtype, ints(dims), ints(strides[:-1]))
        except ValueError as e:
            raise ValueError(f"not a content key: {text!r} ({e})") from None


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


def source_key(data, dtype: str, shape: Sequence[int]) -> ContentKey:
    """Source key of one checkpoint tensor as stored (row-major): BLAKE3-256 of its bytes, with
    its dtype and shape (module docstring: why a cryptographic hash here).

    Args:
        data: any object exposing the buffer protocol over the tensor's bytes; read in place
            (BLAKE3's binding releases the GIL while it hashes, so threads overlap).
        dtype: element type name (see `ContentKey.dtype`).
        shape: shape in elements.
    """
    return source_key_of_chunks([data], dtype, shape)


def source_key_of_chunks(chunks: Iterable, dtype: str, shape: Sequence[int]) -> ContentKey:
    """`source_key` of a tensor whose bytes come in ``chunks`` (buffer-protocol objects, in
    order; each may be reused once the next is asked for: `readers.WeightFile.chunks`)."""
    import blake3  # here: the lent GPU machines have no blake3, and gpu_check reads no checkpoint

    hasher = blake3.blake3()
    for chunk in chunks:
        hasher.update(chunk)
    shape = tuple(int(d) for d in shape)
    return ContentKey(hasher.digest(), dtype, shape, contiguous_stride(shape))


def tensor_key(tensor) -> ContentKey:
    """Key of a contiguous CPU torch tensor: its bytes (zero-copy), dtype, shape and stride.

    Raises:
        ValueError: see `tensor_bytes`.
    """
    return content_key(tensor_bytes(tensor), dtype_name(tensor.dtype), tensor.shape, tensor.stride())


def content_keys(
    loaders: Iterable[Callable[[], ContentKey]],
    threads: int | None = None,
    on_done: Callable[[int], None] | None = None,
) -> list[ContentKey]:
    """Run key computations in parallel threads, keeping their order (those no thread can be
    started for, under a pids limit, in the caller's).

    Args:
        loaders: callables, each computing one key (typically ``content_key`` over an
            mmapped tensor).  Exceptions propagate to the caller.
        threads: worker threads; default ``min(8, os.cpu_count())``.
        on_done: called with each finished key's index, in index order (progress bars).
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
        futures = []
        for fn in loaders:
            try:
                futures.append(pool.submit(fn))
            except RuntimeError:  # no thread to be had (a pids limit): this one in the caller's
                futures.append(None)
        out = []
        for i, (fn, fut) in enumerate(zip(loaders, futures)):
            out.append(fut.result() if fut is not None else fn())
            if on_done:
                on_done(i)
        return out
