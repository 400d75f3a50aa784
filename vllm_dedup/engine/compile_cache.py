"""The dedup loader and vLLM's torch.compile cache (docs/architecture.md, "vLLM facts").

vLLM 0.32 keeps a compiled model (an AOT artifact) under
``$VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<key>/rank_<r>_<dp>/model``
(`vllm.compilation.decorators`, the ``__call__`` that ``support_torch_compile`` installs).
``<key>`` hashes `vllm.compilation.caching.aot_compile_hash_factors` (vLLM's environment
variables, ``VllmConfig.compute_hash()``, and with ``VLLM_USE_MEGA_AOT_ARTIFACT`` inductor's
own factors) and the model's ``forward`` (vLLM's version, its qualified name and first line).
``LoadConfig.compute_hash`` hashes nothing, so neither the load format nor
``model_loader_extra_config`` is in the key: a dedup engine and a plain engine of one model
find each other's artifacts.

That is right where the loader leaves vLLM's graph as it is (on a GPU; on the CPU backend with
``cpu_linear`` ``packed``, ``private`` or ``vllm``, which marks only layers vLLM runs by
``F.linear`` itself) and wrong where the loader changes it: with
``cpu_linear="plain"`` on the CPU backend, linear layers and the head call ``F.linear`` on a (shared) weight where a plain
engine calls oneDNN with a handle to its private packed copy (where vLLM packs the dtype: with
bfloat16 on AVX2 vLLM itself runs ``F.linear``, and the graph is its own; a plain artifact run on such a
model fails at its first forward: its graph reads each layer's handle from the closure of the
layer's ``cpu_linear``).  `key_compile_cache` adds that choice to
``VllmConfig.additional_config``, which ``VllmConfig.compute_hash`` hashes and which vLLM keeps
for information that must enter the hash from outside its own configs (vLLM puts its own kernel
choices there too, e.g. ``gdn_prefill_backend``).

`allow_cpu_aot_loads` fixes the failure behind the warning "Compiling model again due to a load
failure": vLLM 0.32 cannot load any AOT artifact its CPU backend saves, so a dedup engine that
found a plain engine's artifact (same key) failed to load it, compiled its own graph and saved
it over the plain one's; two dedup engines never reused a compilation either.
"""

from __future__ import annotations

__all__ = ["COMPILE_KEY", "allow_cpu_aot_loads", "can_key_compile_cache", "key_compile_cache"]

# The entry of ``VllmConfig.additional_config`` that carries the loader's share of the key.
COMPILE_KEY = "vllm_dedup"


def can_key_compile_cache(vllm_config) -> bool:
    """Whether `key_compile_cache` can put a graph change in this engine's compile-cache key:
    ``additional_config`` is a dict (an object's own ``compute_hash`` cannot be extended), or
    nothing is compiled (``CompilationMode.NONE``: nothing is cached either)."""
    from vllm.config import CompilationMode

    return (isinstance(vllm_config.additional_config, dict)
            or vllm_config.compilation_config.mode == CompilationMode.NONE)


def key_compile_cache(vllm_config, plain_linear: bool) -> None:
    """Make the engine's compile-cache key say what the loader changed in the model's graph.

    Call before the first forward (vLLM computes the key there), in the worker that compiles.
    Only graph changes enter the key, so engines whose graph is vLLM's own keep sharing
    compiled artifacts with plain engines.

    Args:
        vllm_config: the engine's ``VllmConfig`` (the model holds the same object).
        plain_linear: whether linear layers and vocabulary embeddings keep plain weights
            (``F.linear``) on the CPU backend where vLLM's own would call oneDNN
            (``cpu_linear="plain"`` where `onednn.vllm_packs`; ``packed`` runs vLLM's own
            graph, and so does ``plain`` where vLLM itself runs ``F.linear``: bfloat16 on AVX2).

    Raises:
        ValueError: the graph is changed and compiled, but ``additional_config`` is an object
            rather than a dict, so the key cannot say so (`can_key_compile_cache`; the loader
            asks it first and keeps vLLM's graph then).
    """
    if not plain_linear:
        return
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        if can_key_compile_cache(vllm_config):
            return  # nothing is compiled, nothing cached
        raise ValueError(
            "vllm-dedup: cpu_linear='plain' changes the model's graph, and vLLM's compile cache must know it, "
            f"but additional_config is a {type(extra).__name__}, not a dict; set cpu_linear='packed', or "
            "run with enforce_eager")
    # A new dict: the one in the config may be the caller's own object.
    vllm_config.additional_config = {**extra, COMPILE_KEY: {"cpu_linear": "plain"}}


def _nothing_to_finalize(self, vllm_config) -> None:
    """``finalize_loading`` of torch's inductor artifact: deserializing it already built its
    callable, so there is nothing left to do."""


def allow_cpu_aot_loads() -> bool:
    """Let vLLM load the AOT artifacts its CPU backend saves.

    On the CPU backend vLLM compiles with torch's own inductor backend (``platforms/cpu.py``:
    mode ``DYNAMO_TRACE_ONCE``, ``backend="inductor"``), so an artifact's compiled function is
    torch's ``BundledAOTAutogradSerializableCallable``, complete once deserialized.  vLLM's
    ``decorators._try_load_aot_compiled_fn`` calls ``finalize_loading`` on it, which only vLLM's
    own ``VllmSerializableFunction`` has; the lookup falls through to the wrapped function and
    raises, and vLLM compiles again.  This gives that class a ``finalize_loading`` that does
    nothing (the upstream form is ``patches/0004-aot-load-without-finalize-loading.patch``).
    Only on the vLLM versions it was checked against; idempotent.

    Returns:
        whether it was installed now (False: another vLLM, or a torch without that class).
    """
    import vllm

    from .vllm_facts import CHECKED_VLLM_VERSIONS

    if vllm.__version__ not in CHECKED_VLLM_VERSIONS:
        return False
    try:  # a private module of torch's: another torch may not have it
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled
    except ImportError:
        return False
    if "finalize_loading" in vars(Bundled):
        return False
    Bundled.finalize_loading = _nothing_to_finalize
    return True
