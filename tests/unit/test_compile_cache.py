"""The dedup loader's share of vLLM's compile-cache key, measured with vLLM's own key function
(`aot_compile_hash_factors`, what names the AOT cache directory), and the CPU AOT-load fix.
Real compiled engines reusing (or not) each other's artifacts: tests/e2e/test_compiled.py."""

from __future__ import annotations

import pytest
from vllm.compilation.caching import aot_compile_hash_factors
from vllm.config import VllmConfig

from vllm_dedup.engine.compile_cache import COMPILE_KEY, allow_cpu_aot_loads, key_compile_cache


def test_plain_cpu_linear_enters_vllms_compile_cache_key_and_nothing_else_does():
    plain = aot_compile_hash_factors(VllmConfig())

    shared = VllmConfig()
    key_compile_cache(shared, plain_linear=True)
    assert aot_compile_hash_factors(shared) != plain

    again = VllmConfig()
    key_compile_cache(again, plain_linear=True)
    assert aot_compile_hash_factors(again) == aot_compile_hash_factors(shared)  # dedup engines share

    kept = VllmConfig()  # cpu_linear packed or private leaves vLLM's graph, and its key, as they are
    key_compile_cache(kept, plain_linear=False)
    assert aot_compile_hash_factors(kept) == plain and kept.additional_config == {}


def test_the_users_additional_config_is_kept_and_not_mutated():
    user = {"gdn_prefill_backend": "triton"}
    config = VllmConfig(additional_config=user)
    key_compile_cache(config, plain_linear=True)
    assert config.additional_config == {**user, COMPILE_KEY: {"cpu_linear": "plain"}}
    assert user == {"gdn_prefill_backend": "triton"}


def test_an_additional_config_object_cannot_carry_the_key():
    class Opaque:
        def compute_hash(self) -> str:
            return "x"

    config = VllmConfig(additional_config=Opaque())
    with pytest.raises(ValueError, match="cpu_linear='packed'"):
        key_compile_cache(config, plain_linear=True)


def test_torchs_inductor_artifact_gets_a_finalize_loading_that_does_nothing():
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    class Entry:  # what the wrapper needs of a compiled entry
        @staticmethod
        def serialize():
            return b""

    artifact = Bundled(Entry())
    allow_cpu_aot_loads()
    assert artifact.finalize_loading(VllmConfig()) is None
    assert allow_cpu_aot_loads() is False  # installed once


def test_a_torch_without_the_aot_artifact_class_loads_as_it_would_without_the_fix(monkeypatch):
    """``torch._dynamo.aot_compile_types`` is private to torch: where it is missing the fix is
    not installed, and model creation goes on (it used to raise ImportError there)."""
    import sys

    monkeypatch.setitem(sys.modules, "torch._dynamo.aot_compile_types", None)  # import raises ImportError
    assert allow_cpu_aot_loads() is False


def test_plain_weights_change_the_graph_where_vllm_packs_any_weight_dtype_marked(monkeypatch):
    """A bfloat16 model's float32 router gate (glm4_moe's, minimax_m2's): vLLM packs float32 for
    oneDNN on every x86 ISA, so marking it plain changes the graph even where vLLM runs
    ``F.linear`` itself for bfloat16 (AVX2); a model of bfloat16 layers alone changes it exactly
    where vLLM packs bfloat16."""
    import torch
    from torch import nn
    from vllm.model_executor.layers.linear import LinearBase

    from vllm_dedup.engine.loader import _changes_graph, _keep_cpu_weights_plain
    from vllm_dedup.engine.onednn import vllm_packs

    class Linear(LinearBase):  # only the class matters here; LinearBase's own state is not used
        def __init__(self, dtype):
            nn.Module.__init__(self)
            self.weight = nn.Parameter(torch.zeros(4, 4, dtype=dtype), requires_grad=False)

    dense = nn.Sequential(Linear(torch.bfloat16), Linear(torch.bfloat16))
    marked = _keep_cpu_weights_plain(dense)
    assert marked == {"bfloat16": 2} and all(m._cpu_skip_gemm_dispatch for m in dense)
    assert _changes_graph(marked) == vllm_packs("bfloat16")

    gated = nn.Sequential(Linear(torch.bfloat16), Linear(torch.float32))
    assert vllm_packs("float32")
    assert _changes_graph(_keep_cpu_weights_plain(gated))

    # cpu_linear="vllm" (the fallback where vLLM runs F.linear for the model's dtype) marks
    # only what vLLM's own dispatch leaves to F.linear: the graph stays vLLM's, and where packed
    # weights are not shared the load report counts the layers vLLM packs (private copies).
    # As on AVX2, on every machine: oneDNN packs float32 only, and AMX's small-GEMM kernel as told.
    import vllm.model_executor.layers.utils as vllm_utils
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from vllm_dedup.engine import onednn
    from vllm_dedup.engine.loader import _packed_by_vllm

    def gated_model():
        layers = nn.Sequential(Linear(torch.bfloat16), Linear(torch.float32), Linear(torch.bfloat16))
        for layer in layers:
            layer.quant_method = UnquantizedLinearMethod()
        layers[2].quant_method = object()  # a quantized layer: vLLM's FP8 kernels read the mark
        return layers

    monkeypatch.setattr(onednn, "vllm_packs", lambda dtype: dtype == "float32")
    monkeypatch.setattr(vllm_utils, "check_cpu_sgl_kernel", lambda n, k, dtype: False)
    gated = gated_model()
    marked = _keep_cpu_weights_plain(gated, only_where_vllm_does=True)
    assert marked == {"bfloat16": 1} and not _changes_graph(marked)
    assert [hasattr(m, "_cpu_skip_gemm_dispatch") for m in gated] == [True, False, False]
    assert _packed_by_vllm(gated) == {"float32": 1}
    monkeypatch.setattr(vllm_utils, "check_cpu_sgl_kernel", lambda n, k, dtype: dtype == torch.bfloat16)
    assert _keep_cpu_weights_plain(gated_model(), only_where_vllm_does=True) == {}  # AMX packs it
