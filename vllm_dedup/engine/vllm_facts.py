"""What vllm-dedup relies on in vLLM, in one place: the versions checked, the Worker methods
that write weights in place (guarded while weights are shared), the hooks ``patches/`` adds,
and the engine configurations that keep weights private.

When vLLM moves, this is the module to re-read against its source: each fact names the file
it comes from.  `worker_hooks.py` wraps what is listed here; the loader and `session.py` ask
`private_reason`.
"""

from __future__ import annotations

__all__ = ["CHECKED_VLLM_VERSIONS", "CPU_UNPACKED_CONV_WEIGHT", "GUARDED", "GUARDED_BEFORE_PAUSING", "GUARDED_RPC",
           "GUARD_MARKER", "KEEPS_WEIGHTS_PRIVATE", "PATCHED_BY", "private_reason", "registered_load_formats"]

CHECKED_VLLM_VERSIONS = ("0.32.0",)

# (module, class, method, what the operation does to weights)
GUARDED = (
    ("vllm.v1.worker.gpu_worker", "Worker", "sleep", "sleep mode offloads or discards the weights"),
    ("vllm.v1.worker.cpu_worker", "CPUWorker", "sleep", "sleep mode offloads or discards the weights"),
    ("vllm.v1.worker.gpu_worker", "Worker", "reload_weights", "weight reload writes new weights in place"),
    ("vllm.v1.worker.gpu_worker", "Worker", "start_weight_update", "weight updates write weights in place"),
    ("vllm.v1.worker.gpu_worker", "Worker", "start_draft_weight_update", "weight updates write weights in place"),
    ("vllm.v1.worker.gpu_worker", "Worker", "update_weights", "weight updates write weights in place"),
    ("vllm.v1.worker.gpu_worker", "Worker", "reset_weights", "weight reset zeroes the weights in place"),
    ("vllm.distributed.eplb.eplb_state", "EplbState", "rearrange",
     "expert load balancing moves expert weights in place"),
)

# Engine-core methods that stop serving before they reach a guarded worker method: (module,
# class, method, the lowest level that reaches the workers, what it does to weights).
# vllm/v1/engine/core.py: ``EngineCore.sleep(level)`` pauses the scheduler (clearing the prefix
# cache; under the default mode ``"abort"`` aborting the requests in flight) and only then calls
# the workers' ``sleep``; a worker's refusal would leave the engine paused, every later request
# waiting, until ``wake_up``.  Level 0 pauses scheduling only and touches no weight.
GUARDED_BEFORE_PAUSING = (
    ("vllm.v1.engine.core", "EngineCore", "sleep", 1, "sleep mode offloads or discards the weights"),
)

# The engine core's call of a worker method on every worker at once, by name: (module, class,
# method).  vllm/v1/engine/core.py: ``EngineCore.collective_rpc`` is how ``reload_weights``,
# ``start_weight_update``, ``update_weights`` and ``reset_weights`` reach the workers
# (async_llm.py, entrypoints/rl/, snapshot/server.py).  Each worker's own guard refuses only for
# itself: with tensor parallelism, a rank that loaded privately (its registry call timed out)
# would write while a rank that shares refuses, leaving a model half old and half new.  So the
# engine core asks every worker first, for the methods of `GUARDED` (Worker and CPUWorker).
GUARDED_RPC = ("vllm.v1.engine.core", "EngineCore", "collective_rpc")

# What a method's source holds once patches/ is applied to it: (class, method) -> marker.  The
# guards' marker is the check the patch adds to every guarded method.
PATCHED_BY = {("Worker", "load_model"): "external_weight_correction_bytes",
              ("Worker", "compile_or_warm_up_model"): "on_startup_done"}
GUARD_MARKER = "_check_weights_writable("

# On an AVX-512-BF16 (or Arm bf16) CPU, vLLM's CPU linear dispatch packs a bf16 causal-conv weight
# of shape (dim, 1, 4) for its conv kernel: the layer's ``weight`` becomes the packed tensor and
# this attribute keeps a (dim, 4) contiguous copy of the weight it had before
# (vllm/model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm).
CPU_UNPACKED_CONV_WEIGHT = "_cpu_unpacked_conv_weight"


def registered_load_formats() -> dict:
    """vLLM's load formats, name -> loader class: its private ``_LOAD_FORMAT_TO_MODEL_LOADER``
    (vllm/model_executor/model_loader/__init__.py), only read, and ``{}`` where a vLLM has none
    (no public way to list them; ``register_model_loader`` is the public way to add one)."""
    from vllm.model_executor import model_loader

    return getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {})


# Guarded method -> the setting an engine starts with to use it: each keeps the engine's
# weights private under --load-format dedup (`private_reason`), which a refusal names.
KEEPS_WEIGHTS_PRIVATE = {"sleep": "--enable-sleep-mode", "start_weight_update": "a weight_transfer_config",
                         "start_draft_weight_update": "a weight_transfer_config",
                         "update_weights": "a weight_transfer_config", "rearrange": "--enable-eplb"}


def private_reason(vllm_config) -> str | None:
    """Why an engine must keep its weights private, from its configuration, or None: the
    features that write into weights in place (or move them out of the device) after loading.
    The list of every in-place writer of vLLM 0.32 is in docs/architecture.md ("In-place
    writers")."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel, "enable_eplb", False):
        return ("expert parallel load balancing (--enable-eplb, also under elastic EP) moves expert weights in "
                "place (vllm/distributed/eplb/rebalance_execute.py: move_from_buffer)")
    offload = getattr(vllm_config, "offload_config", None)  # vLLM 0.32: uva and prefetch sub-configs
    if ((getattr(getattr(offload, "uva", None), "cpu_offload_gb", 0) or 0) > 0
            or (getattr(getattr(offload, "prefetch", None), "offload_group_size", 0) or 0) > 0):
        return "weight offloading (--cpu-offload-gb, --offload-group-size) moves weights to host memory"
    if getattr(vllm_config, "weight_transfer_config", None) is not None:
        return "RLHF weight transfer (weight_transfer_config) writes new weights in place"
    if getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False):
        return "sleep mode (--enable-sleep-mode) offloads or discards the weights and restores them in place"
    return None
