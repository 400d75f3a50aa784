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
