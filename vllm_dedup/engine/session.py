"""`EngineSession`: everything one engine process knows about its sharing, in one object.

An engine's worker process holds one session (`EngineSession.current`).  The loader, the
worker hooks (`worker_hooks.py`) and the guards read and write it; nothing else keeps state
between them.  It holds:

- the registry connections this engine keeps open: its **leases** on the segments it maps
  (`registry.lease.Lease`, which re-registers them with a registry that comes back after
  dying; docs/architecture.md, "Registry");
- the GPU **start-up lock** and the **prediction** of bytes to be mapped (GPU only, below);
- the bytes of this engine's tensors that live in segments (read by the guards) and the
  **budget correction** the worker applies after loading.

Where the saved memory goes on a GPU.  How vLLM sizes the KV cache (vLLM 0.32:
``v1/worker/gpu_worker.py``, ``v1/worker/utils.py`` ``request_memory``, ``utils/mem_utils.py``
``memory_profiling``):

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
lock (`state.startup_lock_name`) from `begin_startup` (called from the loader's
``get_external_weight_memory``, just before the snapshot) until `end_startup` (after
``compile_or_warm_up_model``, which allocates the KV cache and captures CUDA graphs).  While a
device's start-up lock is held, the registry frees none of that device's segments.  The TP ranks
of one vLLM instance share the lock (one owner: the instance id), and an engine with more than
one rank takes the locks of every GPU it can see at once, all or none, so two multi-GPU engines
cannot each hold one GPU and wait for the other.  Memory that other programs allocate or free
meanwhile is outside the lock's reach.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from ..config import DedupConfig
from ..errors import RegistryUnavailable
from ..registry.lease import Lease
from ..registry.state import startup_lock_name

__all__ = ["EngineSession", "startup_devices"]

logger = logging.getLogger("vllm.dedup.session")  # under "vllm": vLLM's handlers and format apply


def startup_devices(world_size: int) -> list:
    """The torch devices whose start-up locks a worker takes: its own, or every visible GPU
    when the engine has several ranks (see the module docstring)."""
    import torch

    if world_size <= 1:
        return [torch.device("cuda", torch.cuda.current_device())]
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


class EngineSession:
    """This engine process's sharing state (see the module docstring).  Use `current`."""

    _current: ClassVar[EngineSession | None] = None

    def __init__(self):
        self.leases: list[Lease] = []  # open for the process's lifetime
        self.startup_client: Lease | None = None  # the connection `begin_startup` opened
        self.startup_device: str | None = None  # its device key
        self.startup_signature: str | None = None
        self.locks: list[str] = []  # start-up locks held now
        self.predicted: int | None = None  # bytes predicted to be mapped (accounting="external")
        self.segment_bytes = 0  # bytes of this process's tensors that live in segments
        self.correction_bytes = 0  # budget correction not yet applied to the worker

    @classmethod
    def current(cls) -> EngineSession:
        """This process's session (created on first use)."""
        if cls._current is None:
            cls._current = cls()
        return cls._current

    # the registry connection -------------------------------------------------------------
    def connect(self, config: DedupConfig, model: str, device_key: str, signature: str) -> Lease | None:
        """A registry connection that has said hello for this engine: the one `begin_startup`
        opened for this device and signature, else a new one.  None: no registry (fallback).

        Raises:
            RuntimeError: the registry cannot be reached and ``on_registry_error`` is ``fail``.
        """
        if self.startup_device == device_key and self.startup_signature == signature:
            return self.startup_client
        import functools

        from ..registry.daemon import is_daemon, start_daemon
        from ..registry.discovery import connect_registry

        try:
            client = connect_registry(config.registry_namespace, config.registry_address, config.keep_warm_s,
                                      reply_timeout_s=config.registry_timeout_s)
            # Come back the way it came: a daemon is started again by whichever engine
            # notices first; a Ray actor by whoever created it (a new engine, the Serve helper).
            # A registry that does not answer costs one `registry_timeout_s` (RegistryTimeout).
            restart = (functools.partial(start_daemon, keep_warm_s=config.keep_warm_s)
                       if is_daemon(client.stats().registry_pid) else None)
            return Lease(client, model, device_key, config.share_group, signature, restart,
                         timeout_s=config.registry_timeout_s)
        except RegistryUnavailable as e:
            if config.on_registry_error == "fail":
                raise RuntimeError(
                    f"vllm-dedup: cannot reach the weight registry ({e}). Start it or fix "
                    "registry_address, or set on_registry_error='fallback' to load without sharing."
                ) from None
            logger.warning("vllm-dedup: cannot reach the weight registry (%s); loading without sharing", e)
            return None

    def hold(self, lease: Lease, segment_bytes: int, shared_bytes: int) -> None:
        """Keep ``lease`` open as this engine's lease on the segments it now maps, and record
        what its load put in segments: ``segment_bytes`` in all, ``shared_bytes`` of them mapped
        from other engines (for the budget correction: ``shared - predicted``)."""
        self.leases.append(lease)
        self.segment_bytes += segment_bytes
        if self.predicted is not None:
            self.correction_bytes += shared_bytes - self.predicted

    # the GPU start-up ----------------------------------------------------------------------
    def begin_startup(self, config: DedupConfig, vllm_config) -> int:
        """Take the start-up lock(s) and predict the external weight bytes (GPU workers only).

        Returns:
            Bytes to report as external weight memory: the prediction in ``external`` mode, else 0.

        Raises:
            RuntimeError: the registry cannot be reached, or the lock could not be had within
                ``startup_lock_timeout_s``, and ``on_registry_error`` is ``fail``.
        """
        import torch

        if not torch.cuda.is_available() or "cuda" not in str(vllm_config.device_config.device):
            return 0
        from ..errors import SegmentError
        from ..segments.cuda import CudaSegment
        from .signature import load_signature

        pc = vllm_config.parallel_config
        try:
            device = CudaSegment.device_key(torch.cuda.current_device())
            names = sorted({startup_lock_name(CudaSegment.device_key(d))
                            for d in startup_devices(pc.tensor_parallel_size * pc.pipeline_parallel_size)})
        except SegmentError as e:  # no usable driver or cuda-bindings: the load will stay private
            if config.on_registry_error == "fail":
                raise RuntimeError(f"vllm-dedup: cannot name this GPU ({e})") from None
            logger.warning("vllm-dedup: cannot name this GPU (%s); starting without the start-up lock", e)
            return 0
        signature = load_signature(vllm_config, config.inner_load_format)
        client = self.connect(config, str(vllm_config.model_config.model), device, signature)
        if client is None:
            return 0
        self.startup_client, self.startup_device, self.startup_signature = client, device, signature
        try:
            client.lock(names, owner=f"vllm-instance:{vllm_config.instance_id}",
                        timeout_s=config.startup_lock_timeout_s)
        except TimeoutError as e:
            if config.on_registry_error == "fail":
                raise RuntimeError(f"vllm-dedup: {e}") from None
            logger.warning("vllm-dedup: starting without the start-up lock (%s); if another engine is starting "
                           "on this GPU now, both KV cache sizes may be off", e)
            return 0
        self.locks = names
        if config.accounting != "external":
            return 0
        self.predicted = client.expected_shared_bytes()
        logger.info("vllm-dedup: accounting=external: %.1f MB of weights expected to be mapped from other "
                    "engines (reported to vLLM as external weight memory)", self.predicted / 1e6)
        return self.predicted

    def end_startup(self) -> None:
        """Give the start-up lock(s) back (idempotent; the engine's KV cache is allocated)."""
        if self.locks:
            self.startup_client.unlock(self.locks)
            self.locks = []

    def correct_budget(self, worker) -> int:
        """Lower ``worker.requested_memory`` (vLLM's budget, bytes) by the pending correction
        (negative raises it) and clear it.  Returns the correction applied.

        vLLM set the budget to ``ceil(total * utilization) - predicted``; the weights really held
        outside this engine are ``shared``, so the budget becomes ``... - shared`` and the KV
        cache, ``budget - measured use``, equals a plain load's.
        """
        delta = self.correction_bytes
        if not delta or not hasattr(worker, "requested_memory"):
            return 0
        worker.requested_memory -= delta
        self.correction_bytes = 0
        logger.info("vllm-dedup: accounting=external: %+.1f MB more mapped from other engines than predicted; "
                    "engine budget now %.1f MB", delta / 1e6, worker.requested_memory / 1e6)
        return delta
