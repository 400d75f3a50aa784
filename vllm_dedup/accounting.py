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
- ``external``: report the bytes mapped from others as E; the KV cache is then what a plain
  load would get and the engine's footprint shrinks by E, leaving room for more engines.  vLLM
  asks for E before loading, so the loader answers with the registry's prediction from the last
  engine with the same load signature (`Registry.expected_shared_bytes`; 0 for a model never
  loaded before), which is what vLLM's start-up check of free memory uses.  Once loaded, the
  worker's budget is corrected by the difference between the bytes actually mapped and the
  prediction (`correct_budget`, run after ``Worker.load_model``), so the KV cache is exactly a
  plain load's either way.

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

__all__ = ["begin_startup", "correct_budget", "correction", "end_startup", "install", "load_signature",
           "session_client"]

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


def correction(shared_bytes: int) -> int:
    """Bytes by which the engine's budget must shrink now that ``shared_bytes`` were really
    mapped from other engines: ``shared - predicted`` in ``external`` mode, else 0."""
    predicted = _session.get("predicted")
    return 0 if predicted is None else shared_bytes - predicted


def correct_budget(worker) -> int:
    """Lower ``worker.requested_memory`` (vLLM's budget, bytes) by the model's
    ``external_weight_correction_bytes`` (set by the loader from `correction`; negative raises
    it).  Returns the correction applied.

    vLLM set the budget to ``ceil(total * utilization) - predicted``; the weights really held
    outside this engine are ``shared``, so the budget becomes ``... - shared`` and the KV cache,
    ``budget - measured use``, equals a plain load's.
    """
    runner = getattr(worker, "model_runner", None)
    try:
        model = runner.get_model() if runner is not None else None
    except Exception:  # load_model failed: nothing to correct
        return 0
    delta = int(getattr(model, "external_weight_correction_bytes", 0) or 0)
    if delta and hasattr(worker, "requested_memory"):
        worker.requested_memory -= delta
        logger.info("vllm-dedup: accounting=external: %+.1f MB more mapped from other engines than predicted; "
                    "engine budget now %.1f MB", delta / 1e6, worker.requested_memory / 1e6)
        return delta
    return 0


def end_startup() -> None:
    """Give the start-up lock(s) back (idempotent; the engine's KV cache is allocated)."""
    names = _session.get("locks")
    if names:
        _session["client"].unlock(names)
        _session["locks"] = []


def install() -> list[str]:
    """Wrap vLLM's GPU ``Worker``: `correct_budget` after ``load_model``, and `end_startup` after
    ``compile_or_warm_up_model`` (which allocates nothing more for the KV cache afterwards).
    Idempotent; returns the methods wrapped now.  ``patches/0002-...`` is the upstream form."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError:
        return []
    wrapped = []
    for name, after in (("load_model", correct_budget), ("compile_or_warm_up_model", lambda worker: end_startup())):
        method = Worker.__dict__.get(name)
        if method is None:
            logger.warning("vllm-dedup: Worker.%s not found; GPU accounting may be off (start-up lock released "
                           "only when the engine exits)", name)
            continue
        if getattr(method, "__vllm_dedup_startup__", False):
            continue
        setattr(Worker, name, _run_after(method, after))
        wrapped.append(f"Worker.{name}")
    return wrapped


def _run_after(method, after):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            after(self)

    wrapper.__vllm_dedup_startup__ = True
    return wrapper
