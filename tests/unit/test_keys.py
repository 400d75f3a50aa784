"""Content keys: what makes two keys equal, zero-copy hashing, and the parallel path."""

from __future__ import annotations

import pytest
import torch
import xxhash

from vllm_dedup.content.keys import ContentKey, content_key, content_keys
from vllm_dedup.content.keys import tensor_key as key_of
from vllm_dedup.content.views import contiguous_stride, tensor_bytes


def test_equal_bytes_and_layout_give_equal_keys():
    a = torch.randn(64, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    assert key_of(a) == key_of(a.clone())


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.view(torch.float16),  # same bytes, other dtype
        lambda t: t.reshape(32, 64),  # same bytes, other shape
        lambda t: t.reshape(-1),
        lambda t: torch.where(torch.arange(t.numel()).reshape(t.shape) == 7, t + 1, t),  # one element
    ],
)
def test_any_change_of_bytes_dtype_or_shape_changes_the_key(change):
    a = torch.randn(64, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    assert key_of(a) != key_of(change(a).contiguous())


def test_stride_is_part_of_the_key():
    data = memoryview(bytes(range(16)))
    assert content_key(data, "uint8", (4, 4), (4, 1)) != content_key(data, "uint8", (4, 4), (1, 4))


def test_digest_is_xxh3_128_of_the_bytes_in_memory_order():
    t = torch.arange(10, dtype=torch.int32)
    assert key_of(t).digest == xxhash.xxh3_128_digest(t.numpy().tobytes())


def test_tensor_bytes_is_zero_copy():
    t = torch.zeros(8, dtype=torch.float32)
    view = tensor_bytes(t)
    t[0] = 1.0
    assert bytes(view[:4]) == torch.tensor([1.0]).numpy().tobytes()


def test_tensor_bytes_handles_scalars_and_empty_tensors():
    assert tensor_bytes(torch.tensor(3.0)).nbytes == 4
    assert tensor_bytes(torch.empty(0, 5)).nbytes == 0


def test_tensor_bytes_refuses_a_non_contiguous_tensor():
    with pytest.raises(ValueError, match="contiguous"):
        tensor_bytes(torch.zeros(4, 4).t())


def test_tensor_bytes_refuses_a_view_whose_bytes_are_not_its_values():
    """A conjugate or negative view reads its storage's bytes as other values: keyed by them, it
    would share a key (and a segment) with the tensor it views."""
    z = torch.randn(4, dtype=torch.complex64)
    for view in (z.conj(), torch._neg_view(z)):
        with pytest.raises(ValueError, match="conjugate or negative"):
            tensor_bytes(view)


def test_key_string_round_trips():
    k = content_key(memoryview(b"abc"), "gguf:Q4_1", (3,), None)
    assert ContentKey.parse(str(k)) == k
    scalar = content_key(memoryview(b"abcd"), "float32", (), ())
    assert ContentKey.parse(str(scalar)) == scalar
    with pytest.raises(ValueError, match="not a content key"):
        ContentKey.parse("float32[2]:zz")


def test_contiguous_stride():
    assert contiguous_stride((2, 3, 4)) == (12, 4, 1)
    assert contiguous_stride(()) == ()


def test_parallel_keys_equal_sequential_keys_in_order():
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(n, 17, generator=gen) for n in range(1, 40)]
    loaders = [lambda t=t: key_of(t) for t in tensors]
    done = []
    parallel = content_keys(loaders, threads=4, on_done=done.append)
    assert parallel == content_keys(loaders, threads=1)
    assert parallel == [key_of(t) for t in tensors]
    assert sorted(done) == list(range(len(tensors)))


# Device-side fingerprints: the same function runs on a GPU; here it runs on CPU tensors.
import subprocess  # noqa: E402
import sys  # noqa: E402


from vllm_dedup.content.fingerprint import device_fingerprints, same_bytes  # noqa: E402


def _weight(rows=300, cols=1000, seed=0, dtype=torch.bfloat16):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("nbytes", [1, 3, 6, 4096, 4 * 1024 + 2, 4 * 1024 * 7 + 4, 1 << 20])
def test_fingerprint_of_equal_bytes_is_equal_and_one_changed_byte_changes_it(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    copy = data.clone()
    changed = data.clone()
    changed[nbytes // 2] ^= 1
    a, b, c = device_fingerprints([data, copy, changed])
    assert len(a) == 16 and a == b and a != c


def test_fingerprint_sees_moved_rows_columns_and_words():
    w = _weight()
    moved = {
        "rows swapped": w[[1, 0, *range(2, w.shape[0])]],
        "columns swapped": w[:, [1, 0, *range(2, w.shape[1])]],
        "transposed bytes": w.t().contiguous().view(w.shape),
        "words swapped in a row": torch.cat([w.view(-1)[2:4], w.view(-1)[0:2], w.view(-1)[4:]]).view(w.shape),
    }
    base = device_fingerprints([w])[0]
    for name, t in moved.items():
        assert not torch.equal(t, w), name
        assert device_fingerprints([t.contiguous()])[0] != base, name


def test_fingerprint_does_not_depend_on_dtype_view_or_process():
    w = _weight(seed=3)
    assert device_fingerprints([w])[0] == device_fingerprints([w.view(torch.int16)])[0]
    code = ("import torch; from vllm_dedup.content.fingerprint import device_fingerprints; "
            "w = torch.randn(300, 1000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16); "
            "print(device_fingerprints([w])[0].hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == device_fingerprints([w])[0].hex()


def test_fingerprints_of_fine_tuned_weights_do_not_collide():
    base = [_weight(seed=s) for s in range(20)]
    tuned = [w + 0.01 * _weight(seed=100 + i) for i, w in enumerate(base)]
    prints = device_fingerprints(base + tuned)
    assert len(set(prints)) == 40


def test_fingerprints_refuse_non_contiguous_tensors():
    with pytest.raises(ValueError, match="contiguous"):
        device_fingerprints([_weight().t()])


def test_same_bytes_compares_bits_not_values():
    w = _weight()
    assert same_bytes(w, w.clone()) and same_bytes(w, w.view(torch.int16))
    changed = w.clone()
    changed.view(-1)[-1] = -changed.view(-1)[-1]
    assert not same_bytes(w, changed)
    assert not same_bytes(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal values, other bits
    nan = torch.tensor([float("nan")])
    assert same_bytes(nan, nan.clone())  # unequal values, same bits
    assert not same_bytes(w, w[:10].contiguous())


def test_a_view_at_a_negative_offset_is_refused_not_counted_from_the_end():
    """A registry's hit is another process's data: ``raw[-1024:]`` would read the segment's
    last bytes as the tensor."""
    import torch

    from vllm_dedup.content.views import typed_view

    raw = torch.arange(4096, dtype=torch.int64).view(torch.uint8)
    with pytest.raises(ValueError, match="offset -1024 is negative"):
        typed_view(raw, -1024, torch.int64, (64,), (1,))
    assert typed_view(raw, 1024, torch.int64, (64,), (1,))[0] == 128


@pytest.mark.parametrize("changed_at", [None, 0, 5, 6, 11, 12])
def test_same_bytes_compares_slice_by_slice(monkeypatch, changed_at):
    from vllm_dedup.content import fingerprint

    monkeypatch.setattr(fingerprint, "_SLICE_BYTES", 24)  # 13 int64 words: five slices, the last short
    a = torch.arange(13, dtype=torch.int64)
    b = a.clone()
    if changed_at is not None:
        b[changed_at] += 1
    assert same_bytes(a, b) is (changed_at is None)


@pytest.mark.parametrize("slice_rows", [1, 3, 10])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16])  # int16: 2-byte words, cast a slice at a time
def test_a_fingerprint_does_not_depend_on_the_slices(monkeypatch, slice_rows, dtype):
    from vllm_dedup.content import fingerprint

    gen = torch.Generator().manual_seed(5)  # full-range words: the int32 sums wrap
    info = torch.iinfo(dtype)
    w = torch.randint(info.min, info.max, (80 * 1024 + 7,), dtype=dtype, generator=gen)
    whole = device_fingerprints([w])[0]
    monkeypatch.setattr(fingerprint, "_SLICE_BYTES", slice_rows * 1024 * 4 * (1 if dtype == torch.int32 else 8))
    assert device_fingerprints([w])[0] == whole
