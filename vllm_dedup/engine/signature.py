"""The load signature: everything besides the checkpoint's bytes that decides a worker's final
tensors after ``process_weights_after_loading``.

Two engines with the same signature whose modules were fed the same checkpoint tensors end
with the same final tensors in those modules (docs/architecture.md, "Loading only what is not
resident").  So the signature covers:

- the code: the versions of vLLM, transformers (``model_impl="transformers"`` builds its
  modules) and torch, vllm-dedup's version and recipe format, the model's code (the source
  file of the class vLLM builds, which covers out-of-tree and remote-code models, and the
  folder's own ``*.py``), ``model_impl``, whether zentorch is in play;
- the model: the architecture, the dtype, quantization and its config, the KV-cache dtype
  (FP8 k/v scale buffers depend on it), a digest of the model's config without the keys that
  cannot change any tensor (names, token ids), of the processor configs some models fold
  into their modules (image mean and std), and of the sentence-transformers modules an
  embedding model's pooler loads while vLLM builds it (``modules.json`` and each module's
  subfolder: a ``Dense`` projector's config and weights, read outside ``load_weights``);
- the engine: TP, PP, DP and PCP size and this worker's rank in each (each rank holds other
  shards: a mixture of experts' too, across DP and PCP ranks, Note [data-parallel ranks hold
  other shards]), the decode-context-parallel size (``DCPGroupColumnParallelLinear`` shards by it), the model's
  maximum length (PLaMo 3 and MiniMax-M2 size their rotary caches by it, which no checkpoint
  tensor covers),
  the inner load format, this loader's options that change post-processing
  (``cpu_linear`` on the CPU backend), vLLM's kernel choices (`_kernels`: its MoE and linear
  backends and LoRA's configuration, by which it picks them), the device type, and vLLM's environment variables
  that may choose another post-processing (`env_digest`: weights laid out for DeepGEMM or Marlin,
  zentorch's prepacking), but not the cores an engine is bound to.

The model's path is not in it: a copy of a checkpoint, or a fine-tune with the same config,
has the same signature and is matched tensor by tensor.  For a drafter (EAGLE, MTP) the loader
is called with the drafter's own model config, which is what the signature describes.
"""

from __future__ import annotations

import inspect
import json
import re
from importlib import metadata
from pathlib import Path

import blake3

from ..errors import CheckpointError

__all__ = ["CONFIG_KEYS_WITHOUT_EFFECT", "ENV_NAMES_WITHOUT_EFFECT", "ENV_WITHOUT_EFFECT", "ENV_WITH_EFFECT",
           "env_digest", "load_signature", "unreadable"]

# Keys of an HF config that change no tensor of a model built from it.  ``vocab_size`` is not
# one: besides the embedding's shape, buffers with no checkpoint source can depend on it.
CONFIG_KEYS_WITHOUT_EFFECT = frozenset({
    "_name_or_path", "_commit_hash", "transformers_version", "architectures", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict",
})
# vLLM's environment variables in its compile-cache key (`env_digest`) that change no tensor
# and differ between engines sharing one machine: the CPU cores an engine is bound to, and
# (by name) where and which process it is: ports, hosts, paths, ranks, timeouts (Ray Serve
# gives each replica its own side-channel port and placement-group bundle).
ENV_WITHOUT_EFFECT = frozenset({"VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_PROCESS_NAME_PREFIX",
                                "VLLM_RAY_BUNDLE_INDICES", "VLLM_SYSTEM_START_DATE", "VLLM_USAGE_SOURCE"})
ENV_NAMES_WITHOUT_EFFECT = re.compile(r"_(PORT|HOST|HOSTNAME|IP|IPS|PATH|HOME|DIR|RANK|RANK_LOCAL|SIZE)$|TIMEOUT")
# ... and those vLLM leaves out of that key that do change post-processing (zentorch's prepacking).
ENV_WITH_EFFECT = ("VLLM_ZENTORCH_WEIGHT_PREPACK",)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
ST_MODULES = "modules.json"  # sentence-transformers' list of modules, each in a subfolder


def _rank(group: str, default: int = 0) -> int:
    """This worker's rank in vLLM's parallel group ``group`` (``tp``, ``pp``, ``dp``, ``pcp``):
    ``default`` where that group is not initialised (a single process) or unknown to vLLM."""
    try:
        from vllm.distributed import parallel_state

        return getattr(parallel_state, f"get_{group}_group")().rank_in_group
    except (AssertionError, AttributeError, ImportError):
        return default


def _parallel_ranks(pc) -> str:
    """Every parallel size and rank that decides which shard of a weight this worker holds.

    Note [data-parallel ranks hold other shards]
        Tensor and pipeline parallelism split every model.  Data and prefill-context
        parallelism split a mixture of experts' layers too, even without expert parallelism:
        vLLM shards each expert across ``dp * pcp * tp`` ranks
        (``FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp``), so two data-parallel ranks
        of one deployment hold different expert shards of equal shapes.  A recipe of one must
        never serve the other: their signatures differ by rank.
    """
    dp, pcp = getattr(pc, "data_parallel_size", 1), getattr(pc, "prefill_context_parallel_size", 1)
    dp_rank = _rank("dp", getattr(pc, "data_parallel_rank", 0)) if dp > 1 else 0
    pcp_rank = _rank("pcp") if pcp > 1 else 0
    return (f"tp{pc.tensor_parallel_size}.{_rank('tp')}|pp{pc.pipeline_parallel_size}.{_rank('pp')}"
            f"|dp{dp}.{dp_rank}|pcp{pcp}.{pcp_rank}|dcp{getattr(pc, 'decode_context_parallel_size', 1)}")


KERNEL_CHOICES = ("moe_backend", "linear_backend", "linear_backend_per_quant")


def _kernels(vllm_config) -> str:
    """vLLM's kernel choices that may lay weights out differently: `KERNEL_CHOICES` of its
    ``kernel_config`` (with ``flashinfer_cutlass`` a mixture of experts' post-processing swaps
    the halves of each ``w13`` expert weight, with ``triton`` it does not, the shapes equal
    either way), and ``lora_config`` by vLLM's own ``compute_hash`` (``--enable-lora``: vLLM
    picks MoE kernels by it, ``FusedMoEConfig``).  Not the rest of ``kernel_config``: its
    ``ir_op_priority`` picks norm and activation kernels, no weight, and on CUDA its default
    differs between eager and compiled engines, which share weights."""
    kernels = getattr(vllm_config, "kernel_config", None)
    chosen = {name: getattr(kernels, name, None) for name in KERNEL_CHOICES}
    lora = getattr(vllm_config, "lora_config", None)
    return (f"kernels:{_digest(json.dumps(chosen, sort_keys=True, default=str).encode())}"
            f"|lora:{lora.compute_hash()[:16] if lora is not None else 'none'}")


def _digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()[:16]


def env_digest() -> str:
    """A digest of this process's vLLM environment variables that may change post-processing:
    those vLLM keys its compile cache by (``vllm.envs.compile_factors``: every variable vLLM
    knows but those it lists as changing no compiled graph; ``VLLM_USE_DEEP_GEMM`` and
    ``VLLM_MARLIN_INPUT_DTYPE`` among them, which lay out weights and scales for another
    kernel), less `ENV_WITHOUT_EFFECT` and `ENV_NAMES_WITHOUT_EFFECT`, plus `ENV_WITH_EFFECT`.  A variable that changes nothing
    but is in it splits recipes between engines (each loads as usual and still shares); one that
    changes post-processing and is not would let an engine replay a recipe made for another
    kernel.  ``""`` where vLLM has no ``compile_factors``."""
    import vllm.envs as envs

    factors = getattr(envs, "compile_factors", None)
    if factors is None:
        return ""
    values = {k: v for k, v in factors().items()
              if k not in ENV_WITHOUT_EFFECT and not ENV_NAMES_WITHOUT_EFFECT.search(k)}
    values.update({k: envs.environment_variables[k]() for k in ENV_WITH_EFFECT if k in envs.environment_variables})
    return _digest(json.dumps(values, sort_keys=True, default=str).encode())


def _config_digest(hf_config) -> str:
    items = {k: v for k, v in hf_config.to_dict().items() if k not in CONFIG_KEYS_WITHOUT_EFFECT}
    return _digest(json.dumps(items, sort_keys=True, default=str).encode())


def _st_module_files(folder: Path) -> list[Path]:
    """``modules.json`` and the files of each sentence-transformers module it places in a
    subfolder of ``folder``: vLLM's pooler reads a ``Dense`` projector's config and weights
    from there while the model is built (``_load_st_projector`` in vLLM's
    ``model_executor/models/adapters.py``), so no checkpoint key covers them."""
    listing = folder / ST_MODULES
    if not listing.is_file():
        return []
    files = [listing]
    try:
        modules = json.loads(listing.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return files  # vLLM cannot read it either: its bytes are in the digest
    if isinstance(modules, dict):  # {"modules": [...]}, which vLLM reads too
        modules = modules.get("modules")
    for module in modules if isinstance(modules, list) else []:
        path = module.get("path") if isinstance(module, dict) else None
        sub = folder / path if isinstance(path, str) and path.strip("./") else None
        if sub is not None and sub.is_dir() and sub.resolve().is_relative_to(folder.resolve()):
            files += sorted(f for f in sub.iterdir() if f.is_file())
    return files


def _read(path: Path) -> bytes:
    """The bytes of ``path``.

    Raises:
        OSError: it cannot be read; always with ``filename``, which Python leaves out where
            ``read`` fails (EIO) rather than ``open``.
    """
    try:
        return path.read_bytes()
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise


def _code_digest(model_config) -> str:
    """The model's code: the source of the class vLLM resolves for it, and any ``*.py`` and
    processor config in its folder (remote code, folded processor constants); and the files
    of the sentence-transformers modules it lists (`_st_module_files`)."""
    parts: list[bytes] = []
    try:
        from vllm.model_executor.model_loader.utils import get_model_architecture

        cls, _ = get_model_architecture(model_config)
        parts.append(Path(inspect.getfile(cls)).read_bytes())
    except Exception as e:  # noqa: BLE001  (any failure to resolve: say so in the digest itself)
        parts.append(f"unresolved:{type(e).__name__}".encode())
    folder = Path(str(model_config.model))
    if folder.is_dir():
        for f in sorted([*folder.glob("*.py"), *(folder / name for name in PROCESSOR_FILES)]):
            if f.is_file():
                parts.append(f.name.encode() + b"\0" + _read(f))
        for f in _st_module_files(folder):
            parts.append(str(f.relative_to(folder)).encode() + b"\0" + _read(f))
    return _digest(b"\0\0".join(parts))


def _zentorch() -> bool:
    try:
        import torch
        from vllm.platforms import current_platform

        return bool(current_platform.is_zen_cpu() and hasattr(torch.ops, "zentorch"))
    except Exception:  # noqa: BLE001
        return False


def unreadable(error: OSError) -> CheckpointError:
    """What `load_signature` raising ``error`` means to an engine: a file of the model's folder
    it digests (remote code, a processor config, a sentence-transformers module) cannot be
    read.  vLLM may not need that file, so the caller loads privately (`fallback`)."""
    return CheckpointError(error.filename or "the model's folder",
                           f"vllm-dedup cannot read it for the load signature ({error.strerror or error}); "
                           "make it readable for this engine to share its weights")


def load_signature(vllm_config, model_config=None, inner_load_format: str = "auto",
                   cpu_linear: str = "") -> str:
    """This worker's load signature (see the module docstring), readable and stable across
    processes: ``arch|dtype|quant|kv:...|lenN|tpN.r|ppN.r|dcpN|format|device|...|cfg:<digest>|code:<digest>``.

    Args:
        vllm_config: vLLM's ``VllmConfig`` of the engine.
        model_config: the model config ``load_model`` was called with (a drafter's own); by
            default the engine's.
        inner_load_format: the vLLM load format that reads the checkpoint.
        cpu_linear: how linear layers run on the CPU backend (`config.DedupConfig.cpu_linear`,
            as the engine runs it: ``packed``, ``plain``, ``private`` or ``vllm``,
            `loader.DedupModelLoader.cpu_linear`); part of the signature only there.

    Raises:
        OSError: a file of the model's folder it digests cannot be read (`unreadable` says it).
    """
    import torch
    import vllm

    from .. import __version__ as dedup_version
    from .recipe import VERSION as RECIPE_VERSION

    mc = model_config or vllm_config.model_config
    pc = vllm_config.parallel_config
    try:  # vLLM brings it; not imported here (the wheel does not name it)
        transformers = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers = "none"
    device = vllm_config.device_config.device_type
    quant = mc.quantization or ""
    quant_config = getattr(mc.hf_config, "quantization_config", None)
    if quant_config:
        quant += ":" + _digest(json.dumps(quant_config, sort_keys=True, default=str).encode())
    arch = ",".join(getattr(mc.hf_config, "architectures", None) or [type(mc.hf_config).__name__])
    kv = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    linear = f"|cpu_linear={cpu_linear or 'private'}" if "cpu" in device else ""
    zen = "|zentorch" if "cpu" in device and _zentorch() else ""
    return (f"{arch}|{mc.dtype}|{quant}|kv:{kv}|impl:{getattr(mc, 'model_impl', 'auto')}|len{mc.max_model_len}"
            f"|{_parallel_ranks(pc)}"
            f"|{inner_load_format}|{device}{linear}{zen}|{_kernels(vllm_config)}|vllm{vllm.__version__}|transformers{transformers}"
            f"|torch{torch.__version__}|dedup{dedup_version}.r{RECIPE_VERSION}"
            f"|cfg:{_config_digest(mc.hf_config)}|code:{_code_digest(mc)}|env:{env_digest()}")
