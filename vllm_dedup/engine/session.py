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
  plain load's either way.  When the correction raises the budget (the engine mapped less than
  predicted: a fine-tune), vLLM's own start-up check (``request_memory``) runs again with the
  bytes really mapped, so an engine that no longer fits fails with vLLM's message instead of
  running out of memory while allocating its KV cache.

Why ``kv_cache`` needs one exception (`plan_startup`).  In that mode the engine that created the
segments pays for them in its budget, and the engines that map them pay nothing.  When the
creator exits, the segments stay (others map them) but no budget holds them any more, so the
creator's restart (a blue/green restart) finds less free memory than its full budget: two
engines at 0.45 of an 80 GB GPU sharing 16 GB leave 28 GB free when the creator exits, and its
restart asks vLLM for 36 GB.  Yet it needs only 20 GB of its own: the 16 GB it will map are
resident.  So in ``kv_cache`` mode an engine whose full budget does not fit in the free memory,
but does once the bytes predicted to be mapped are set aside, reports those bytes as
``external`` does (its KV cache is then a plain load's); otherwise vLLM refuses it with its
message, as it would refuse a plain load.

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

import contextlib
import os
import threading
import weakref
from typing import ClassVar

from ..config import DedupConfig
from ..errors import LockTimeout, RegistryUnavailable, SegmentError
from ..log import init_logger
from ..registry.lease import Lease
from ..registry.state import startup_lock_name
from .fallback import FALLBACK_ADVICE, fail_or_fall_back
from .vllm_facts import private_reason

__all__ = ["EngineSession", "startup_devices", "startup_plan_warning"]

logger = init_logger(__name__)


def _registry_of(config: DedupConfig) -> tuple:
    """Which registry ``config`` names: (namespace, address)."""
    return config.registry_namespace, config.registry_address


def _connection_for(config: DedupConfig, model: str, device_key: str, signature: str) -> tuple:
    """Whom a registry connection said hello for: an engine of another model, group or
    registry in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) needs a connection of its
    own."""
    return (*_registry_of(config), config.share_group, model, device_key, signature)


def _world_size(pc) -> int:
    """The ranks of one vLLM instance: ``pp * tp * pcp`` (vLLM's ``ParallelConfig.world_size``)."""
    return getattr(pc, "world_size", None) or (
        pc.pipeline_parallel_size * pc.tensor_parallel_size * getattr(pc, "prefill_context_parallel_size", 1))


def startup_plan_warning(accounting: str) -> str | None:
    """What to tell a GPU engine with vLLM's start-up plan on (``VLLM_ENABLE_STARTUP_PLAN=1``)
    under ``accounting="kv_cache"``, or None.  vLLM records the KV cache size a start-up
    measured and applies it to later start-ups of the same config hash, without profiling
    again (``v1/worker/startup_plan.py``); the hash leaves the load format out.  In
    ``kv_cache`` mode that size includes the bytes this engine maps from others, so a plain
    engine of the same config, or this one when it maps less, would take that many bytes more
    than ``gpu_memory_utilization`` allows.  In ``external`` mode it is a plain load's."""
    try:
        import vllm.envs as envs

        plan = bool(getattr(envs, "VLLM_ENABLE_STARTUP_PLAN", False))
    except (ImportError, ValueError):  # ValueError: a value that is not a number (vLLM's own int())
        return None
    if accounting != "kv_cache" or not plan:
        return None
    return ("vllm-dedup: VLLM_ENABLE_STARTUP_PLAN=1 records this engine's KV cache size, which accounting=kv_cache "
            "grows by the weights mapped from other engines, under a key that leaves the load format out: a plain "
            "engine of the same config, or this one when it maps less, would reuse it and exceed "
            "gpu_memory_utilization by those bytes. Set accounting='external' or leave the start-up plan off")


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
        self.leases: list[Lease] = []  # open while the model each was held for lives (`hold`)
        self.startup_client: Lease | None = None  # the connection `begin_startup` opened, until `end_startup`
        self.startup_for: tuple | None = None  # whom it said hello for (`_connection_for`)
        # The registry (namespace, address) this start-up could not reach: its load does not
        # wait for it a second time (one `registry_timeout_s` per start-up), until `end_startup`.
        self.unreachable: tuple | None = None
        self.locks: list[str] = []  # start-up locks held now
        self.predicted: int | None = None  # bytes reported to vLLM as mapped from others (None: no correction)
        self.segment_bytes = 0  # bytes of this process's tensors that live in segments
        self.shared_bytes = 0  # of them, mapped from other engines' segments
        self.shared_before_startup = 0  # shared_bytes when this start-up began (engines before it, in-process)
        self.budget_corrected = False  # the correction was applied to the worker
        self.described = weakref.WeakSet()  # models given to `describe` since this start-up began
        self.model_bytes = weakref.WeakKeyDictionary()  # model -> bytes of it in segments (`hold`)
        self._holds = threading.RLock()  # `hold` and `release` (the garbage collector's, on any thread)
    @classmethod
    def current(cls) -> EngineSession:
        """This process's session (created on first use)."""
        if cls._current is None:
            cls._current = cls()
        return cls._current

    # the registry connection -------------------------------------------------------------
    def connect(self, config: DedupConfig, model: str, device_key: str, signature: str) -> Lease | None:
        """A registry connection that has said hello for this engine: the one `begin_startup`
        opened for the same registry, share group, model, device and signature
        (`_connection_for`), else a new one; where this call had to start the
        daemon, one that connects and says hello on first use (Note [a lease on a registry still
        starting] in `registry/lease.py`).  None: no registry (fallback).

        Raises:
            RegistryUnavailable: the registry cannot be reached and ``on_registry_error`` is
                ``fail`` (`fallback.fail_or_fall_back`).
        """
        if self.startup_client is not None and self.startup_for == _connection_for(config, model, device_key,
                                                                                    signature):
            return self.startup_client
        if self.unreachable == _registry_of(config):
            logger.info("the registry did not answer earlier in this start-up; loading without sharing")
            return None
        import functools

        from ..registry.daemon import DaemonLaunch, is_daemon, start_daemon
        from ..registry.discovery import open_registry

        try:
            found = open_registry(config.registry_namespace, config.registry_address, config.keep_warm_s,
                                  reply_timeout_s=config.registry_timeout_s)
            # Come back the way it came: a daemon is started again by whichever engine
            # notices first; a Ray actor by whoever created it (a new engine, the Serve helper).
            # A registry that does not answer costs one `registry_timeout_s` (RegistryTimeout).
            restart = functools.partial(start_daemon, keep_warm_s=config.keep_warm_s)
            if isinstance(found, DaemonLaunch):
                if config.on_registry_error != "fail":  # Note [a lease on a registry still starting]
                    return Lease(found, model, device_key, config.share_group, signature, restart,
                                 timeout_s=config.registry_timeout_s)
                found = found.connect()
            elif not is_daemon(found.registry_pid):  # no request: a stats reply may be refused as too big
                restart = None
            return Lease(found, model, device_key, config.share_group, signature, restart,
                         timeout_s=config.registry_timeout_s)
        except (RegistryUnavailable, OSError) as e:
            fail_or_fall_back(config, RegistryUnavailable(
                f"vllm-dedup: cannot reach the weight registry ({e}). Start it or fix registry_address"
                + FALLBACK_ADVICE * (config.on_registry_error == "fail")), "loading without sharing")
            return None

    def hold(self, lease: Lease, segment_bytes: int, shared_bytes: int, model=None) -> None:
        """Keep ``lease`` open as this engine's lease on the segments it now maps, and record
        what its load put in segments: ``segment_bytes`` in all, ``shared_bytes`` of them mapped
        from other engines (for the budget correction: ``shared - predicted``).  With ``model``
        (the ``nn.Module`` the load returned), the lease lives as long as the model does: once
        it is collected (an engine of the user's own process deleted), `release`."""
        with self._holds:
            self.leases.append(lease)
            self.segment_bytes += segment_bytes
            self.shared_bytes += shared_bytes
            if model is not None:
                self.model_bytes[model] = self.model_bytes.get(model, 0) + segment_bytes
        if model is not None:
            weakref.finalize(model, self.release, lease, segment_bytes, shared_bytes)

    def release(self, lease: Lease, segment_bytes: int, shared_bytes: int) -> None:
        """`hold`'s counterpart, once per hold, when its model is gone: take that hold's bytes
        off this process's figures (the guards of an engine started after it count only what
        lives), and close ``lease`` once no hold of it is left (one start-up connection may be
        held for a model and its drafter): the registry drops what it held, and frees a segment
        nobody else holds.  A lease with no hold left is left alone.  Never raises.

        The garbage collector may call it on any thread, even inside another call of this
        session's: the figures change under a reentrant lock, the list by one removal."""
        with self._holds:
            index = next((i for i, held in enumerate(self.leases) if held is lease), None)
            if index is None:
                return
            del self.leases[index]
            self.segment_bytes -= segment_bytes
            self.shared_bytes -= shared_bytes
            self.shared_before_startup = max(0, self.shared_before_startup - shared_bytes)
            last = not any(held is lease for held in self.leases)
        if last:
            with contextlib.suppress(Exception):  # at interpreter exit too: a closed socket is all it takes
                lease.close()

    def describe(self, model) -> None:
        """Set the model attributes that upstream vLLM's form of the worker hooks reads
        (``patches/0001`` and ``0002``: with them applied, vLLM needs no wrapper from
        `worker_hooks`) on ``model`` and again on every model described since this start-up
        began: ``0002`` reads the target model's ``external_weight_correction_bytes`` after
        ``Worker.load_model``, which loads a drafter after it, so the target's must count the
        drafter's load too; so must ``shared_weight_bytes``, which ``0001`` reads of the target
        only.  Both are this engine's figures, not those of other engines of the process."""
        with self._holds:
            self.described.add(model)
            engine_bytes = sum(self.model_bytes.get(each, 0) for each in self.described)  # a drafter's too
            for each in list(self.described):
                each.shared_weight_bytes = engine_bytes
                each.external_weight_correction_bytes = self.correction_bytes
                each.on_startup_done = self.end_startup

    def bytes_in_segments(self, models) -> int:
        """Bytes in segments of the held models among ``models`` and their submodules (an
        engine's model and its drafter's, as its worker has them: one may wrap a held one)."""
        with self._holds:
            if not self.model_bytes:
                return 0
            found = {id(m): b for model in models for m in model.modules() if (b := self.model_bytes.get(m))}
            return sum(found.values())

    def let_go(self, lease: Lease) -> None:
        """A load through ``lease`` stopped: close it (the registry drops what it held or
        published), unless it is the start-up connection, which `end_startup` closes (it holds
        the start-up locks until then)."""
        if lease is not self.startup_client:
            lease.close()

    @property
    def correction_bytes(self) -> int:
        """By how many bytes the worker's budget must shrink (negative: grow) so that its KV
        cache is what vLLM would give it had it known the bytes really mapped: ``shared -
        predicted`` where a prediction was reported, until `correct_budget` applies it; else 0.
        ``shared`` counts this start-up's loads only (a drafter's too), not those of engines
        started before in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).  A load that
        ended up private (no registry, a fallback) counts as 0 bytes mapped."""
        if self.predicted is None or self.budget_corrected:
            return 0
        return self.shared_bytes - self.shared_before_startup - self.predicted

    def plan_startup(self, accounting: str, predicted: int, free: int, total: int, utilization: float) -> int:
        """The bytes to report to vLLM as external weight memory before its snapshot (module
        docstring), and remember them as the prediction to correct after loading.

        Args:
            accounting: ``kv_cache`` or ``external`` (`DedupConfig.accounting`).
            predicted: bytes the registry expects this engine to map (`expected_shared_bytes`).
            free, total: the device's free and total memory now (bytes; ``cuMemGetInfo``).
            utilization: vLLM's ``gpu_memory_utilization``.

        Returns:
            ``predicted`` in ``external`` mode (kept to correct even when 0), and in ``kv_cache``
            mode when the full budget ``ceil(total * utilization)`` exceeds ``free`` but
            ``budget - predicted`` does not; else 0 (nothing reported, nothing to correct).
        """
        import math

        budget = math.ceil(total * utilization)
        report = predicted if accounting == "external" else 0
        if accounting == "kv_cache" and predicted > 0 and budget - predicted <= free < budget:
            report = predicted
            logger.warning(
                "accounting=kv_cache, but the device's free memory (%.1f MB) is less than this engine's "
                "budget (%.1f MB) and enough once the %.1f MB it will map from other engines are set aside (their "
                "creator has gone, so no budget holds them): this engine reports them as external weight memory "
                "(its KV cache is a plain load's)", free / 1e6, budget / 1e6, predicted / 1e6)
        with self._holds:
            # In external mode a prediction of 0 is one all the same (a fine-tune of a new
            # signature, a registry that lost its figures): what is mapped is still set aside.
            self.predicted = report if report > 0 or accounting == "external" else None
            self.budget_corrected = False
            self.shared_before_startup = self.shared_bytes
        return report

    # the GPU start-up ----------------------------------------------------------------------
    def take_startup_locks(self, config: DedupConfig, client: Lease, names: list[str], owner: str) -> bool:
        """Take the start-up locks ``names`` for ``owner`` through ``client``, waiting up to
        ``startup_lock_timeout_s``; whether they are held (``locks``) now.  A registry that
        cannot be reached (a daemon this engine started that did not start) drops ``client``
        as the start-up connection.

        Raises (only with ``on_registry_error="fail"``, `fallback.fail_or_fall_back`):
            RegistryUnavailable: the registry cannot be reached.
            LockTimeout: another engine held a lock past the timeout.
        """
        try:
            client.lock(names, owner=owner, timeout_s=config.startup_lock_timeout_s)
        except RegistryUnavailable as e:
            client.close()
            if self.startup_client is client:
                self.startup_client = self.startup_for = None
            self.unreachable = _registry_of(config)
            fail_or_fall_back(config, RegistryUnavailable(
                f"vllm-dedup: cannot reach the weight registry for the start-up lock ({e})"
                + FALLBACK_ADVICE * (config.on_registry_error == "fail")), "starting without the start-up lock")
            return False
        except TimeoutError as e:
            fail_or_fall_back(config, LockTimeout(f"vllm-dedup: {e}"),
                              "starting without the start-up lock: if another engine is starting on this GPU now, "
                              "both KV cache sizes may be off")
            return False
        self.locks = names
        return True

    def begin_startup(self, config: DedupConfig, vllm_config) -> int:
        """Take the start-up lock(s) and predict the external weight bytes (GPU workers only).

        Returns:
            Bytes to report as external weight memory (`plan_startup`); 0 where the engine's
            weights stay private or the registry or the device cannot say.

        Raises (only with ``on_registry_error="fail"``, `fallback.fail_or_fall_back`):
            RegistryUnavailable: the registry cannot be reached or cannot say what to map.
            SegmentError: the GPU cannot be named or measured (no usable driver).
            LockTimeout: the start-up lock could not be had within ``startup_lock_timeout_s``.
            CheckpointError: a file of the model's folder the load signature reads cannot be read.
        """
        import torch

        if self.locks or self.startup_client is not None:  # an earlier start-up that failed before the hooks ran
            self.end_startup()
        # Nothing of an earlier engine's start-up in this process is this one's to correct.
        with self._holds:
            self.predicted, self.budget_corrected, self.shared_before_startup = None, False, self.shared_bytes
            self.described = weakref.WeakSet()
        self.unreachable = None  # an earlier start-up's: the registry may be back
        if not torch.cuda.is_available() or "cuda" not in str(vllm_config.device_config.device):
            return 0
        if warning := startup_plan_warning(config.accounting):
            logger.warning(warning)
        from ..segments.cuda import CudaSegment
        from ..segments.cudadrv import memory_info as cudadrv_memory_info
        from .signature import load_signature, unreadable

        pc = vllm_config.parallel_config
        try:
            device = CudaSegment.device_key(torch.cuda.current_device())
            names = sorted({startup_lock_name(CudaSegment.device_key(d))
                            for d in startup_devices(_world_size(pc))})
        except SegmentError as e:  # no usable driver or cuda-bindings: the load will stay private
            fail_or_fall_back(config, SegmentError(f"vllm-dedup: cannot name this GPU ({e})"),
                              "starting without the start-up lock")
            return 0
        try:
            signature = load_signature(vllm_config, None, config.inner_load_format)
        except OSError as e:
            fail_or_fall_back(config, unreadable(e), "starting without the start-up lock")
            return 0
        client = self.connect(config, str(vllm_config.model_config.model), device, signature)
        if client is None:
            self.unreachable = _registry_of(config)
            return 0
        self.startup_client = client
        self.startup_for = _connection_for(config, str(vllm_config.model_config.model), device, signature)
        if not self.take_startup_locks(config, client, names, f"vllm-instance:{vllm_config.instance_id}"):
            return 0
        if private_reason(vllm_config):  # the loader will keep this engine's weights private
            return 0
        try:
            free, total = cudadrv_memory_info(torch.cuda.current_device())
            predicted = client.expected_shared_bytes()
        except (SegmentError, RegistryUnavailable) as e:
            fail_or_fall_back(config, type(e)(f"vllm-dedup: cannot predict the weights to map ({e})"),
                              "nothing reported as external")
            return 0
        report = self.plan_startup(config.accounting, predicted, free, total,
                                   vllm_config.cache_config.gpu_memory_utilization)
        if report:
            logger.info("%.1f MB of weights expected to be mapped from other engines (reported to "
                        "vLLM as external weight memory)", report / 1e6)
        return report

    def end_startup(self) -> None:
        """The KV cache is allocated and CUDA graphs are captured (or a start-up step failed):
        give the start-up lock(s) back, let go of the start-up connection (closed where no load
        holds it as its lease: the load failed or stayed private), and unmap the segment ranges
        whose release was deferred during graph capture (`segments.vmm`).  Idempotent; never
        raises for a registry that is gone (it took the locks with it)."""
        import sys

        client, locks = self.startup_client, self.locks
        self.startup_client, self.startup_for, self.locks, self.unreachable = None, None, [], None
        with self._holds:  # a start-up that failed leaves nothing to correct in the next engine's (a plain one)
            self.predicted = None
        try:
            if locks:
                client.unlock(locks)
        finally:
            if client is not None and not any(lease is client for lease in self.leases):
                client.close()
            vmm = sys.modules.get("vllm_dedup.segments.vmm")  # imported only where CUDA segments are used
            if vmm is not None:
                vmm.release_deferred()

    def correct_budget(self, worker) -> int:
        """Apply the pending correction (`correction_bytes`) to ``worker.requested_memory``
        (vLLM's budget, bytes), once.  Returns the correction applied (0 when none).

        vLLM set the budget with vLLM's ``request_memory`` from the predicted external bytes;
        it is set again the same way from the bytes really mapped, so the budget becomes
        ``ceil(total * utilization) - shared`` and the KV cache (``budget - measured use``)
        equals a plain load's.  ``request_memory`` also checks again that the free memory of
        vLLM's snapshot covers the new budget.

        Raises:
            ValueError: vLLM's own message, when the snapshot's free memory does not cover the
                budget once the bytes really mapped are known (the engine mapped less than
                predicted); starting anyway would run out of memory allocating the KV cache.
        """
        delta = self.correction_bytes
        if not delta or not hasattr(worker, "requested_memory"):
            return 0
        import math

        from vllm.v1.worker.utils import request_memory

        full = math.ceil(worker.init_snapshot.total_memory * worker.cache_config.gpu_memory_utilization)
        external = full - worker.requested_memory + delta  # what vLLM was told, corrected
        self.budget_corrected = True
        worker.requested_memory = request_memory(worker.init_snapshot, worker.cache_config, external)
        logger.info("%+.1f MB more mapped from other engines than predicted; engine budget now %.1f MB",
                    delta / 1e6, worker.requested_memory / 1e6)
        return delta


def _start_afresh_in_child() -> None:
    """Run in every child ``os.fork`` makes (`os.register_at_fork`): vLLM's engine processes on
    the CPU backend (its default start method is fork), a user's DataLoader workers.

    Note [a forked child's session]
        A child inherits this process's session: its registry connections and the
        descriptors its leases keep.  Holding their copies, it would keep the parent's
        engines registered, and their segments held, for as long as it lives (after the
        parent deleted its engine), and its guards would count the parent's engines.  So it
        closes its copies, sending nothing (the connections are the parent's), and begins a
        session of its own.  The old session gets locks of its own too: a thread of the
        parent may have held the inherited ones at the fork, and no thread survives it (the
        finalizers of the parent's models, copied into the child, still call its `release`).
    """
    session = EngineSession._current
    EngineSession._current = None
    if session is None:
        return
    session._holds = threading.RLock()
    for lease in {id(held): held for held in [*session.leases, session.startup_client] if held is not None}.values():
        lease.forget_in_child()


os.register_at_fork(after_in_child=_start_afresh_in_child)
