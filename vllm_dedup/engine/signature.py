"""The load signature: everything besides the checkpoint's bytes that decides a worker's final
tensors after ``process_weights_after_loading``.

Two engines with the same signature whose modules were fed the same checkpoint tensors end
with the same final tensors in those modules (docs/architecture.md, "Loading only what is not resident").  So the
signature covers: vLLM's version, the architecture, the dtype, quantization and its config, the
TP and PP size and this worker's rank in each (each rank holds other shards), the inner load
format, the options of this loader that change post-processing (``cpu_share_linear`` on the CPU
backend), the device type, and a digest of the model's config without the keys that cannot
change any tensor's layout or value (names, token ids, the vocabulary size, whose effect is in
the embedding's own shape).  The model's path is not in it: a copy of a checkpoint, or a
fine-tune with the same config, has the same signature and is matched tensor by tensor.
"""

from __future__ import annotations

import json

import xxhash

__all__ = ["CONFIG_KEYS_WITHOUT_EFFECT", "load_signature"]

# Keys of an HF config that change no tensor of a model built from it.  ``vocab_size`` changes
# the embedding's and the head's shapes, and so their checkpoint tensors' keys: those modules
# never match across vocabularies anyway.
CONFIG_KEYS_WITHOUT_EFFECT = frozenset({
    "_name_or_path", "_commit_hash", "transformers_version", "architectures", "torch_dtype", "dtype",
    "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict",
})


def _ranks() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except (AssertionError, ImportError):  # distributed state not initialised (single process)
        return 0, 0


def _config_digest(hf_config) -> str:
    items = {k: v for k, v in hf_config.to_dict().items() if k not in CONFIG_KEYS_WITHOUT_EFFECT}
    return xxhash.xxh3_64_hexdigest(json.dumps(items, sort_keys=True, default=str).encode())


def load_signature(vllm_config, inner_load_format: str = "auto", cpu_share_linear: bool = False) -> str:
    """This worker's load signature (see the module docstring), readable and stable across
    processes: ``arch|dtype|quant|tpN.r|ppN.r|format|...|cfg:<digest>``.

    Args:
        vllm_config: vLLM's ``VllmConfig`` of the engine.
        inner_load_format: the vLLM load format that reads the checkpoint.
        cpu_share_linear: whether linear layers keep plain weights (only meaningful, and only
            part of the signature, on the CPU backend).
    """
    import vllm

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    tp_rank, pp_rank = _ranks()
    device = vllm_config.device_config.device_type
    quant = mc.quantization or ""
    quant_config = getattr(mc.hf_config, "quantization_config", None)
    if quant_config:
        quant += ":" + xxhash.xxh3_64_hexdigest(json.dumps(quant_config, sort_keys=True, default=str).encode())
    arch = ",".join(getattr(mc.hf_config, "architectures", None) or [type(mc.hf_config).__name__])
    linear = f"|cpu_share_linear={int(cpu_share_linear)}" if "cpu" in device else ""
    return (f"{arch}|{mc.dtype}|{quant}|tp{pc.tensor_parallel_size}.{tp_rank}|pp{pc.pipeline_parallel_size}.{pp_rank}"
            f"|{inner_load_format}|{device}{linear}|vllm{vllm.__version__}|cfg:{_config_digest(mc.hf_config)}")
