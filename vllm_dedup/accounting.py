"""Where the saved memory goes on a GPU, and the per-device start-up lock that keeps it right.

How vLLM sizes the KV cache (vLLM 0.32: ``v1/worker/gpu_worker.py``, ``v1/worker/utils.py``
``request_memory``, ``utils/mem_utils.py`` ``memory_profiling``):

1. ``Worker.init_device`` asks the loader ``get_external_weight_memory(vllm_config)`` (= E),
   then takes a memory snapshot (free and total device memory, ``cudaMemGetInfo``);
2. the budget is ``B = ceil(total * gpu_memory_utilization)``, or ``B - E`` when E > 0, and
   start-up fails unless the snapshot's free memory covers it;
3. after loading and one profiling forward pass, ``KV cache = budget - (free at the snapshot -
   free now) - transient activation peak``.

A tensor mapped from another engine's segment lowers no one's free memory, so it never enters
step 3.  Hence the two accounting modes (config ``accounting``):

- ``kv_cache`` (default): report nothing; the KV cache grows by the bytes mapped from others.
- ``external``: report the bytes expected to be mapped as E; the KV cache is then what a plain
  load would get and the engine's footprint shrinks by E, leaving room for more engines.  E is
  needed before loading, so it is predicted by the registry from the last engine with the same
  load signature (`Registry.expected_shared_bytes`); an engine of a model never loaded before
  is predicted 0 and so behaves as ``kv_cache`` for that load.  Any misprediction moves the KV
  cache, never the footprint beyond the budget.

Step 3 reads the whole device's free memory, so anything another process allocates or frees
between the snapshot and the KV cache allocation lands in this engine's figures: N engines
started at once on one GPU would each under- or over-size their KV cache (or trip vLLM's
"free memory grew during profiling" assertion).  So each engine holds its device's start-up
lock (`registry.startup_lock_name`) from `begin_startup` (called from the loader's
``get_external_weight_memory``, just before the snapshot) until `end_startup` (after
``compile_or_warm_up_model``, which allocates the KV cache and captures CUDA graphs).  While a
device's start-up lock is held, the registry frees none of that device's segments.  The TP ranks
of one vLLM instance share the lock (one owner: the instance id), and an engine with more than
one rank takes the locks of every GPU it can see at once, all or none, so two multi-GPU engines
cannot each hold one GPU and wait for the other.

Memory that other programs allocate or free meanwhile is outside the lock's reach.
"""

from __future__ import annotations

import functools
import logging

__all__ = ["begin_startup", "end_startup", "install", "load_signature", "session_client"]

logger = logging.getLogger("vllm.dedup.accounting")

# This process's start-up state: one worker process, one device, one registry connection.
_session: dict = {}


def load_signature(vllm_config) -> str:
    """What decides the bytes of a worker's tensors: model and revision, dtype, quantization,
    and the TP/PP rank and size (each rank holds other shards)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except (AssertionError, ImportError):  # distributed state not initialised (single process)
        tp_rank = pp_rank = 0
    return (f"{mc.model}@{mc.revision or ''}|{mc.dtype}|{mc.quantization or ''}"
            f"|tp{pc.tensor_parallel_size}.{tp_rank}|pp{pc.pipeline_parallel_size}.{pp_rank}")


def startup_devices(world_size: int) -> list:
    """The torch devices whose start-up locks a worker takes: its own, or every visible GPU
    when the engine has several ranks (see the module docstring)."""
    import torch

    if world_size <= 1:
        return [torch.device("cuda", torch.cuda.current_device())]
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def begin_startup(config, vllm_config, connect) -> int:
    """Take the start-up lock(s) and predict the external weight bytes (GPU workers only).

    Args:
        config: the engine's `DedupConfig`.
        vllm_config: vLLM's ``VllmConfig``.
        connect: ``connect(device_key, signature) -> BrokerClient | None``, a connection that
            has said hello (None: no registry, load privately).

    Returns:
        Bytes to report as external weight memory: the prediction in ``external`` mode, else 0.

    Raises:
        RuntimeError: the lock could not be had within ``startup_lock_timeout_s`` and
            ``on_registry_error`` is ``fail``.
    """
    import torch

    if not torch.cuda.is_available() or "cuda" not in str(vllm_config.device_config.device):
        return 0
    from .registry import startup_lock_name
    from .segments.cuda import CudaSegment

    device = CudaSegment.device_key(torch.cuda.current_device())
    signature = load_signature(vllm_config)
    client = connect(device, signature)
    if client is None:
        return 0
    _session.update(client=client, device=device, signature=signature, locks=[])
    pc = vllm_config.parallel_config
    names = sorted({startup_lock_name(CudaSegment.device_key(d))
                    for d in startup_devices(pc.tensor_parallel_size * pc.pipeline_parallel_size)})
    try:
        client.lock(names, owner=f"vllm-instance:{vllm_config.instance_id}", timeout_s=config.startup_lock_timeout_s)
    except TimeoutError as e:
        if config.on_registry_error == "fail":
            raise RuntimeError(f"vllm-dedup: {e}") from None
        logger.warning("vllm-dedup: starting without the start-up lock (%s); if another engine is starting on "
                       "this GPU now, both KV cache sizes may be off", e)
        return 0
    _session["locks"] = names
    if config.accounting != "external":
        return 0
    predicted = client.expected_shared_bytes()
    _session["predicted"] = predicted
    logger.info("vllm-dedup: accounting=external: %.1f MB of weights expected to be mapped from other engines "
                "(reported to vLLM as external weight memory)", predicted / 1e6)
    return predicted


def session_client(device: str, signature: str):
    """The connection `begin_startup` opened for this device and signature, or None."""
    if _session.get("device") == device and _session.get("signature") == signature:
        return _session["client"]
    return None


def check_prediction(shared_bytes: int) -> None:
    """Log how far ``external`` mode's prediction was from the bytes actually mapped."""
    predicted = _session.get("predicted")
    if predicted is not None and predicted != shared_bytes:
        logger.warning("vllm-dedup: accounting=external predicted %.1f MB shared, %.1f MB were; the KV cache is "
                       "%.1f MB larger than a plain load's", predicted / 1e6, shared_bytes / 1e6,
                       (shared_bytes - predicted) / 1e6)


def end_startup() -> None:
    """Give the start-up lock(s) back (idempotent; the engine's KV cache is allocated)."""
    names = _session.get("locks")
    if names:
        _session["client"].unlock(names)
        _session["locks"] = []


def install() -> bool:
    """Call `end_startup` after ``Worker.compile_or_warm_up_model`` (vLLM's GPU worker), which
    allocates nothing more for the KV cache afterwards.  Idempotent; returns whether it wrapped
    the method now.  ``patches/0002-...`` is the upstream form of this hook."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError:
        return False
    method = Worker.__dict__.get("compile_or_warm_up_model")
    if method is None:
        logger.warning("vllm-dedup: Worker.compile_or_warm_up_model not found; the start-up lock is released "
                       "only when the engine exits")
        return False
    if getattr(method, "__vllm_dedup_startup__", False):
        return False

    @functools.wraps(method)
    def compile_or_warm_up_model(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            end_startup()

    compile_or_warm_up_model.__vllm_dedup_startup__ = True
    Worker.compile_or_warm_up_model = compile_or_warm_up_model
    return True
