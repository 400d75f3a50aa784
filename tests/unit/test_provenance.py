"""`vllm_dedup.engine.provenance`: the checkpoint tensors each tensor made or written during a
load came from, traced through torch calls; unknown wherever it cannot be known."""

from __future__ import annotations

import threading

import pytest
import torch

from vllm_dedup.engine.provenance import Provenance, ProtectedWrite, WriteGuard


def test_views_copies_and_concatenations_carry_the_names_of_what_they_came_from():
    mode = Provenance()
    qkv, other = torch.randn(12, 4), torch.randn(4)
    mode.mark(qkv, ["qkv"])
    mode.mark(other, ["other"])
    with mode:
        shaped = qkv.view(3, 4, 4)
        fused = torch.cat([shaped.narrow(0, 0, 1), shaped[1:2], shaped.select(0, 2).unsqueeze(0)], dim=1)
        scaled = fused * 2 + other
        zeros = torch.zeros(3)
        assert fused.shape == (1, 12, 4) and fused.dtype == torch.float32  # metadata: nothing lost
    assert mode.of(fused) == {"qkv"} and mode.of(shaped) == {"qkv"}
    assert mode.of(scaled) == {"qkv", "other"}
    assert mode.of(zeros) == frozenset()  # from no checkpoint tensor: known and empty
    assert mode.lost == ""


def test_writes_into_a_parameter_reach_its_storage_through_any_view():
    mode = Provenance()
    param, a, b = torch.empty(4, 4), torch.randn(2, 4), torch.randn(4)
    mode.reset(param)
    mode.mark(a, ["a"])
    mode.mark(b, ["b"])
    writes = []
    mode.on_write = lambda t, names: writes.append(names)
    with mode:
        param.data[:2].copy_(a)
        param[3] = b
        torch.ops.aten.add_.Tensor(param.data[2], b)  # an op overload: its schema says what it writes
    assert mode.of(param) == {"a", "b"} and writes == [{"a"}, {"b"}, {"b"}]
    moved = torch.nn.Parameter(torch.empty(4), requires_grad=False)
    mode.reset(moved)
    with mode:
        moved.data = b.clone()  # the parameter now holds the clone's storage, and its provenance
    assert mode.of(moved) == {"b"}


def test_unknown_is_not_empty_and_values_through_python_lose_everything_after():
    mode = Provenance()
    seen, never = torch.randn(4), torch.randn(4)  # `never` was made outside the mode, unmarked
    mode.mark(seen, ["seen"])
    with mode:
        mixed = seen + never
        alone = seen * 3
    assert mode.of(never) is None and mode.of(mixed) is None and mode.of(alone) == {"seen"}
    with mode:
        back = torch.tensor(seen.tolist())  # values left torch and came back
    assert "tolist" in mode.lost and mode.of(back) is None and mode.of(alone) is None


def test_a_checkpoint_tensor_over_a_file_mapping_is_marked_though_the_mode_did_not_see_it_made():
    """The replay reads checkpoint tensors with ``torch.frombuffer`` over the file's mapping, a
    call no torch function mode sees: their storage is unknown until marked."""
    mode = Provenance()
    with mode:
        raw = torch.frombuffer(bytearray(64), dtype=torch.uint8)
        tensor = raw.view(torch.float32).reshape(4, 4)
    assert mode.of(tensor) is None
    mode.mark(tensor, ["w"])
    with mode:
        fused = torch.cat([tensor[:2], tensor[2:]], dim=1)
    assert mode.of(raw) == {"w"} and mode.of(fused) == {"w"}


def test_another_threads_calls_are_not_traced():
    mode = Provenance()
    with mode:
        worker = threading.Thread(target=lambda: torch.ones(2).sum().item())  # as a hashing thread's
        worker.start()
        worker.join()
    assert mode.lost == ""


def test_a_write_into_a_protected_tensor_is_refused_before_it_is_made():
    mode = Provenance()
    mapped, fresh = torch.zeros(4), torch.ones(4)
    mode.protect(mapped[1:], "layers.0.weight, which the recipe maps")
    with mode, pytest.raises(ProtectedWrite, match="copy_ would write into layers.0.weight"):
        mapped.view(2, 2)[0].copy_(fresh[:2])  # the same storage, through another view
    assert torch.equal(mapped, torch.zeros(4))
    with mode:
        fresh.add_(mapped)  # reading it is fine


def test_a_write_guard_refuses_writes_into_a_mapped_tensor_and_lets_rebinding_through():
    """What a replay's post-processing runs under: a write into a tensor mapped read-only would
    fault (SIGSEGV), so it is refused before it is made; ``.data =`` writes no byte."""
    import struct

    from vllm_dedup.segments.host import HostSegment

    seg = HostSegment.from_bytes(struct.pack("<f", 1.0))  # a published 4-byte attention scale
    scale = seg.tensor(0, torch.float32, (), ())
    other = torch.zeros(4)
    with WriteGuard([(scale, "attn._k_scale, mapped read-only from a segment")]):
        for write in (lambda: scale.fill_(1.0), lambda: scale.copy_(torch.tensor(2.0)),
                      lambda: torch.add(other[0], 1, out=scale), lambda: scale.view(1).__setitem__(0, 3.0)):
            with pytest.raises(ProtectedWrite, match="would write into attn._k_scale, mapped read-only"):
                write()
        other.fill_(5.0)  # any other tensor is written as usual
        param = torch.nn.Parameter(scale, requires_grad=False)
        param.data = torch.ones(())  # rebound: the segment's byte is not touched
        # Metadata only: no byte written, nothing refused.
        scale.requires_grad_(False)
        scale.detach().as_strided_((), ())
        scale.view(1, 1).t_()
        scale.share_memory_()
    assert scale.item() == 1.0 and torch.equal(other, torch.full((4,), 5.0)) and param.item() == 1.0


def test_a_write_guard_trusts_only_atens_schemas_to_say_what_an_op_writes():
    """vLLM's ``_C::convert_weight_packed(Tensor($0! -> ) weight)`` only reads its weight (its
    CPU embeddings call it on a mapped weight of 1 MiB or less on AMX): refusing it would
    decline every such replay.  ATen's in-place ops are refused by their schemas."""
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    weight = torch.zeros(32, 32, dtype=torch.bfloat16)
    with WriteGuard([(weight, "embed.weight, mapped read-only from a segment")]):
        try:
            torch.ops._C.convert_weight_packed(weight)
        except ProtectedWrite:
            raise
        except Exception:  # the kernel may need AMX: whether it runs is not the point
            pass
        with pytest.raises(ProtectedWrite, match="add_"):
            torch.ops.aten.add_(weight, 1)
    assert not weight.any()
