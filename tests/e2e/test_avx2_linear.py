"""The AVX2 branch of ``cpu_linear`` on vLLM's CPU backend, held to AVX2 on any x86 machine
(``ONEDNN_MAX_CPU_ISA=AVX2``, ``ATEN_CPU_CAPABILITY=avx2``).  There vLLM runs ``F.linear`` for
bfloat16 linears (oneDNN has no bfloat16 matmul) but packs float32 ones for oneDNN, so a
bfloat16 model's float32 router gates (glm4_moe's, `harness.zoo`) run on packed copies.

The default ``cpu_linear="packed"`` cannot share packed bfloat16 weights there, and the engine
runs ``vllm``: each layer runs as vLLM's own dispatch makes it, ``F.linear`` on shared weights
for the bfloat16 layers (marked so, which lets a recipe replay them) and oneDNN on vLLM's packed
copy for each float32 gate, shared as ``packed`` shares packed weights (and, on an AMX CPU,
whose small-GEMM kernel vLLM picks by the hardware whatever ``ONEDNN_MAX_CPU_ISA`` says, that
kernel for each small bfloat16 layer).  A plain (``auto``) engine is the reference: the first
dedup engine (it publishes, the gates' packed weights too) and a second (it maps everything
from the first's recipe, through a replay that makes the model on the meta device; on AMX only
what a recipe can replay) hold
exactly its final tensors, its packed gates included, and answer exactly as it does.  Before, the engine
marked the gates plain too (``F.linear``: another kernel than vLLM's), and the second engine
crashed in oneDNN (Note [probes under a device context] in vllm_dedup/engine/onednn/probe.py).
"""

from __future__ import annotations

import torch

from harness.engines import EngineProcess
from harness.oracle import differences
from harness.zoo import checkpoint

AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
# Each gate's packed weight is 64 KiB (8 experts padded to 64 columns x 256 x 4 bytes), the
# default min_tensor_bytes exactly: a lower threshold keeps them shared whatever block oneDNN picks.
EXTRA = {"min_tensor_bytes": 4096}


def test_held_to_avx2_every_layer_runs_as_vllm_runs_it_on_the_first_and_the_nth_engine(registry):
    model = checkpoint("glm4_moe")
    with EngineProcess(model, "auto", env=AVX2, core=0) as plain:
        plain.wait_ready()
        (reference,) = plain.final_tensors()
        ids = plain.generate()
    packed = sorted(k.removeprefix("packed:") for k in reference if k.startswith("packed:"))
    assert packed and all(name.endswith(".mlp.gate") for name in packed), packed  # oneDNN: the float32 gates alone
    checkpoint_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))

    with EngineProcess(model, extra=EXTRA, env=AVX2, core=0) as first:
        first.wait_ready()
        assert "cpu_linear=vllm" in first.log()
        load = registry.engine_loads()[first.pid]
        assert (load["packed_tensors"], load["private_linears"]) == (len(packed), ""), load  # the gates, published
        (tensors,) = first.final_tensors()
        assert not differences(tensors, reference), differences(tensors, reference)[:5]
        assert first.generate() == ids
        amx = torch.cpu._is_amx_tile_supported()  # see below
        assert amx or load["published_bytes"] > 0.9 * checkpoint_bytes, load
        with EngineProcess(model, extra=EXTRA, env=AVX2, core=1) as second:
            second.wait_ready()
            load = registry.engine_loads()[second.pid]
            if not amx:
                assert (load["load_path"], load["checkpoint_bytes_read"]) == ("full", 0), load
                assert (load["packed_tensors"], load["published_tensors"]) == (len(packed), 0), load  # mapped
                assert load["shared_bytes"] > 0.9 * checkpoint_bytes, load
            # else vLLM's small-GEMM kernel (chosen by the hardware, whatever ONEDNN_MAX_CPU_ISA
            # says) packs and drops the small bfloat16 weights, which no recipe replays: the
            # second engine loads those modules, and only its tensors and tokens are asserted.
            (tensors,) = second.final_tensors()
            assert not differences(tensors, reference), differences(tensors, reference)[:5]
            assert second.generate() == ids
