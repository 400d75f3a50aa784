"""`vllm_dedup.engine.handlers` with vLLM's real W8A8 oneDNN handler and a real registry, in one
process: a handler made inside a recorded load keeps the ``weight_scale`` it reads through a raw
pointer, and the sharing pass leaves that tensor in place, even where the search through a
model's attributes cannot see the handler (Note [tensors a handler reads through raw
pointers]).  Before the record, such a layer's scales were swapped for a segment and the
private copy the handler still read was freed."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from vllm_dedup.config import DedupConfig
from vllm_dedup.engine import onednn
from vllm_dedup.engine.context import LoadContext
from vllm_dedup.engine.handlers import READS, HandlerRecord, recorded_handlers
from vllm_dedup.engine.share import share_model
from vllm_dedup.registry.client import RegistryClient
from vllm_dedup.registry.lease import Lease

ops = pytest.importorskip("vllm._custom_ops")
N, K = 384, 256


class _Kernel:
    """Holds a handler where `onednn.handlers_in` does not look (a class outside vLLM, as a
    plugin's kernel would be)."""


class _W8A8Layer(nn.Module):
    """A W8A8 int8 linear after vLLM's post-processing (``scaled_mm/cpu.py``): per-channel
    float32 ``weight_scale`` (N,), the int8 weight packed by the handler and dropped."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        weight = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        self.weight_scale = nn.Parameter(torch.rand(N, generator=g) / 100 + 1e-3, requires_grad=False)
        self.kernel = _Kernel()
        self.kernel.handler = ops.create_onednn_scaled_mm(weight.t(), self.weight_scale, torch.bfloat16,
                                                          True, False, 32)

    def outputs(self) -> torch.Tensor:
        x = torch.randn(4, K, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
        x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(x, None, None, True)
        out = torch.empty((4, N), dtype=torch.bfloat16)
        ops.onednn_scaled_mm(self.kernel.handler, x_q, out, x_s, x_zp, None, None)
        return out


def _context(sock, record: HandlerRecord) -> LoadContext:
    lease = Lease(RegistryClient(sock), "handlers-test", "cpu", "default", "handlers-test")
    return LoadContext(DedupConfig(min_tensor_bytes=1, on_registry_error="fail"), lease, torch.device("cpu"), "cpu",
                       share_packed=True, handlers=record)


def _reuse_freed_memory() -> list[torch.Tensor]:
    """Tensors of the scales' size, filled with another value: one of them would take the
    place of a freed scale tensor."""
    gc.collect()
    return [torch.full((N,), 1e4) for _ in range(64)]


def test_a_recorded_handler_keeps_its_scales_and_the_sharing_pass_leaves_them(registry_server):
    with recorded_handlers() as record:
        model = nn.Sequential(_W8A8Layer(1), _W8A8Layer(2))
    assert onednn.handlers_in(model) == []  # the search cannot see these handlers
    handlers = [layer.kernel.handler for layer in model]
    assert record.handlers() == handlers
    scales = [layer.weight_scale.data_ptr() for layer in model]
    assert [getattr(h, READS)[0].data_ptr() for h in handlers] == scales
    want = [layer.outputs() for layer in model]
    ctx = _context(registry_server.path, record)
    try:
        report = share_model(model, ctx)
        assert [layer.weight_scale.data_ptr() for layer in model] == scales  # left in place, not swapped
        assert report.private_tensors >= 2
        junk = _reuse_freed_memory()
        assert all(torch.equal(layer.outputs(), w) for layer, w in zip(model, want))
        del junk
    finally:
        ctx.lease.close()
    assert ops.create_onednn_scaled_mm.__name__ == "create_onednn_scaled_mm"  # restored after the block


def test_a_handler_outlives_a_swap_of_its_layers_scales(registry_server):
    """Made outside a recorded block and unseen by the search, a layer's scales are shared like
    any tensor; a handler made inside one still reads its own copy, which it keeps alive."""
    with recorded_handlers() as record:
        recorded = _W8A8Layer(3)
    ctx = _context(registry_server.path, HandlerRecord())  # a load that recorded nothing
    want = recorded.outputs()
    before = recorded.weight_scale.data_ptr()
    try:
        share_model(nn.Sequential(recorded), ctx)
        assert recorded.weight_scale.data_ptr() != before  # swapped: nothing told the pass to leave it
        junk = _reuse_freed_memory()
        assert torch.equal(recorded.outputs(), want)  # the handler's copy is alive: READS
        del junk
    finally:
        ctx.lease.close()
    assert len(record.handlers()) == 1
