"""Device fingerprints and the exact byte compare: content keys where the tensor lives.

On a GPU, copying every weight to the host to hash it would cost a PCIe transfer of the whole
model.  `device_fingerprints` computes a 16-byte fingerprint with torch reductions on the
tensor's own device instead, and `same_bytes` compares two tensors exactly there.  Such keys are
only ever looked up among keys of the same device (the registry indexes by device key), so they
never meet the XXH3-128 keys of `keys.py`.

The tensor's bytes are read as 32-bit words (16- or 8-bit when the size is not a multiple of
4), laid out as a [rows, 1024] matrix plus a tail.  Row sums and column sums are taken in the
words' own integer type, so torch reads the tensor in place (a wider accumulator would make it
cast a copy first) and the sums wrap modulo 2**32.  Each vector of sums is then folded with
odd per-position weights into one int64 (wrapping modulo 2**64).  Integer addition modulo a
power of two is associative, so the result does not depend on the order in which a GPU's
reduction adds: equal bytes give equal fingerprints in every process, on every run.  One
changed word changes its row sum and its column sum; moving rows or columns around changes
the weighted folds.  Different bytes can still collide, and not only by chance: sums are
linear, so four changes in a rectangle (+d, -d at two elements of one row, -d, +d in another
row, same columns) leave every row and column sum as it was.  A fingerprint only proposes a
candidate, and `same_bytes` decides (``verify: false`` gives that up).  Cost: two reads of each slice of the tensor
(row sums, column sums; Note [slices]); on an H200 a 2 GiB tensor's fingerprint ran at
1118 GB/s, a copy at 2099.
"""

from __future__ import annotations

from .keys import ContentKey
from .views import dtype_name, int_view

__all__ = ["device_fingerprints", "fingerprint_key", "same_bytes"]

_FP_COLUMNS = 1024
_SLICE_BYTES = 256 << 20  # bytes of a tensor reduced or compared at once (Note [slices])
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # 2**64 / golden ratio, as a signed int64


def _weights(n: int, salt: int, device):
    """``n`` odd int64 weights, a fixed function of position and ``salt`` (wrapping)."""
    import torch

    idx = torch.arange(1, n + 1, dtype=torch.int64, device=device) + salt * 0x51ED27
    return (idx * _GOLDEN) | 1


def _fingerprint_pair(t):
    """Two int64 scalars (a [2] tensor on ``t``'s device) fingerprinting ``t``'s bytes."""
    import torch

    words = int_view(t, widest=4)
    rows = words.numel() // _FP_COLUMNS
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    if rows:
        main = words[: rows * _FP_COLUMNS].view(rows, _FP_COLUMNS)
        acc = words.dtype if words.dtype == torch.int32 else torch.int32
        # Narrower words are cast to int32 a slice at a time: that copy is then the temporary.
        step = max(1, (_SLICE_BYTES if words.dtype == acc else _SLICE_BYTES // 8) // (_FP_COLUMNS * 4))
        row_parts, col_sums = [], None
        for start in range(0, rows, step):  # Note [slices]; the sums wrap alike either way
            part = main[start:start + step]
            row_parts.append(part.sum(dim=1, dtype=acc))
            cols = part.sum(dim=0, dtype=acc)
            col_sums = cols if col_sums is None else col_sums.add_(cols)
        row_sums = row_parts[0] if len(row_parts) == 1 else torch.cat(row_parts)
        out[0] = (row_sums.to(torch.int64) * _weights(rows, 1, t.device)).sum()
        out[1] = (col_sums.to(torch.int64) * _weights(_FP_COLUMNS, 2, t.device)).sum()
    tail = words[rows * _FP_COLUMNS :]
    if tail.numel():
        out[0] += (tail.to(torch.int64) * _weights(tail.numel(), 3, t.device)).sum()
    return out


def device_fingerprints(tensors) -> list[bytes]:
    """16-byte fingerprints of tensors' bytes, computed on the tensors' own device.

    Nothing but the 16 bytes per tensor crosses to the host: one transfer per device for the
    whole list.  The module docstring says how it is computed and why it is deterministic.

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
    bytes count).  Runs at memory bandwidth on a GPU (reads both once), a slice at a time
    (Note [slices]); the slices' verdicts are combined on the device and read once.
    """
    import torch

    if a.numel() * a.element_size() != b.numel() * b.element_size():
        return False
    x, y = int_view(a), int_view(b)
    step = max(1, _SLICE_BYTES // x.element_size())
    equal = torch.ones((), dtype=torch.bool, device=x.device)
    for start in range(0, x.numel(), step):
        equal &= torch.eq(x[start:start + step], y[start:start + step]).all()
    return bool(equal)


# Note [slices]
# ~~~~~~~~~~~~~
# A whole-tensor ``==`` holds one bool per 8-byte word (256 MiB for a 2 GiB embedding), and
# torch's reductions of a whole 2 GiB tensor held 260 MiB of temporaries (measured), on top of a
# load.  ``_SLICE_BYTES`` at a time, measured on an H200 for a 2 GiB tensor (gpu_check.py,
# docs/gpu-results.md): the compare's temporaries 32 MiB at 1601 GB/s (1719 whole; 64 MiB slices
# gave 1294: per-call overhead); the fingerprint's 136 MiB at 1118 GB/s (1825 whole), when it made
# about eight torch calls a slice, where it makes three now (not measured on a GPU since).  Memory
# before speed: a fingerprint is under 3% of a load either way.  A tensor of one slice makes the
# calls it made unsliced.  Words narrower than 4 bytes are cast to int32 a slice at a time, so
# their slices are an eighth as big.  Integer sums modulo 2**32 and 2**64 do not depend on how
# the rows are split: a fingerprint is what it was unsliced.
