"""`DedupModelLoader`: the loader behind ``--load-format dedup``.

It wraps an inner vLLM loader (``inner_load_format``, default ``auto``), built from a copy of
the engine's `LoadConfig` carrying the inner format and only the inner loader's own extra
config: vLLM's `DefaultModelLoader` rejects load formats and keys it does not know.

A load takes one of three paths (docs/architecture.md, "Loading only what is not resident"):

- ``full``: a recipe of this load signature matches every module of the checkpoint (its source
  keys come from the manifest cache: no tensor byte is read) and every final tensor is
  resident: the model is built on the meta device and everything is mapped (`replay.py`);
- ``modules``: some modules match: those are mapped, only the others' checkpoint tensors are
  read and loaded;
- ``none``: vLLM's own ``BaseModelLoader.load_model`` template with the inner loader's steps
  (create, load weights, ``process_weights_after_loading``), recording each checkpoint tensor's
  source key and the module it went into (`sources.py`).

Then `share.share_model` maps or publishes what is not shared yet, the engine gives the registry
a recipe of its load (`fast_path.leave_recipe`), and reports its figures (`context.LoadReport`,
`meter.py`).  One `context.LoadContext` carries what the steps need; the state of a usual
load lives in a per-load `_UsualLoad`, never in the loader.  The registry is
reached before anything else, so ``on_registry_error="fail"`` stops a misconfigured engine at
once.

On a GPU, vLLM's ``get_external_weight_memory`` call (just before its memory snapshot) is where
the engine takes its device's start-up lock and, with ``accounting="external"``, reports the
bytes it expects to map (`session.py`).  Everything this engine keeps between loading and the
worker hooks lives in its `session.EngineSession`.

On vLLM's CPU backend, linear layers follow ``cpu_linear``.  ``packed`` (the default) leaves
vLLM's own oneDNN path as it is: vLLM packs each linear weight into oneDNN memory, and the
sharing pass shares those packed weights (`packed.py`, `onednn/`), so every engine runs
vLLM's kernels, with a plain engine's numerics.  Where that cannot work here (`onednn.probe`)
the engine runs ``private``, or, where vLLM itself runs ``F.linear`` for the model's dtype
(bfloat16 on AVX2), ``vllm``: each layer runs as vLLM's own CPU dispatch makes it, ``F.linear``
on the plain weight (shared as any tensor, and marked so, which a recipe needs) where vLLM
falls back to it, oneDNN where vLLM packs (a float32 router gate in a bfloat16 model: its
packed weight shared as ``packed`` shares them, `shares_packed`); it says why once.
``plain`` keeps linear weights and the output head plain (``F.linear``), shared as any tensor:
vLLM's own ``_cpu_skip_gemm_dispatch`` mark for linear layers, and for the vocabulary embeddings
a post-processing that does not pack.
That changes the model's graph, so it enters vLLM's compile-cache key (`compile_cache`): a
compiled artifact of a plain engine is never loaded into such a model, nor the other way round.
``private`` is vLLM's oneDNN path with the packed weights left private.
"""

from __future__ import annotations

import contextlib
import gc
import os
import traceback
from collections import Counter

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.config.utils import replace
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ..config import DedupConfig
from ..content.views import dtype_name
from ..errors import CheckpointError, DedupError, RegistryUnavailable, SegmentError
from ..log import init_logger
from ..segments import segment_class
from . import onednn
from .compile_cache import allow_cpu_aot_loads, can_key_compile_cache, key_compile_cache
from .context import LoadContext, LoadReport
from .fallback import fail_or_fall_back
from .fast_path import RecordedLoad, decide, fast_path_files, leave_recipe
from .handlers import recorded_handlers
from .heap import reused_heap
from .in_place import InPlace
from .in_place_packed import PACKED_ON_HOST_ENV, PackedInPlace
from .meter import LoadMeter
from .packed import packed_and_dropped
from .meta_model import Registrations
from .post_processing import post_processing_hooks
from .recipe import RecipeDeclined
from .recipe_builder import model_attrs
from .replay import Replay
from .session import EngineSession
from .share import colliding, share_model
from .signature import load_signature, unreadable
from .staging import Staging
from .vllm_facts import private_reason, registered_load_formats

__all__ = ["DedupModelLoader"]

logger = init_logger(__name__)


class DedupModelLoader(BaseModelLoader):
    """vLLM model loader for load format ``dedup``.

    Args:
        load_config: the engine's load configuration; its ``model_loader_extra_config`` is
            parsed by `DedupConfig.from_extra_config`.

    Raises:
        ValueError: the extra config has an unknown key or a bad value, or the inner load
            format is unknown to vLLM.
    """

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.config = DedupConfig.from_extra_config(load_config.model_loader_extra_config)
        fmt = self.config.inner_load_format.lower()
        try:
            self.inner = get_model_loader(
                replace(load_config, load_format=fmt, model_loader_extra_config=dict(self.config.inner_extra_config)))
        except ValueError as e:  # vLLM's own words name neither of our keys
            formats = ", ".join(sorted(f for f in registered_load_formats() if f != "dedup")) or "unknown"
            raise ValueError(f"vllm-dedup: no inner loader for inner_load_format {fmt!r} and inner_extra_config "
                             f"{dict(self.config.inner_extra_config)!r}: {e} (this vLLM's load formats: {formats})"
                             ) from None
        self.report: LoadReport | None = None  # of the last load_model call (None: it loaded privately)
        self._cpu_linear: str | None = None  # cpu_linear as this engine runs it (`cpu_linear`)
        self.packed_declined = ""  # why packed sharing cannot work here ("" where it can, or was not asked)

    def download_model(self, model_config: ModelConfig) -> None:
        self.inner.download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        self.inner.load_weights(model, model_config)

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """The inner loader's external bytes plus, with ``accounting="external"`` on a GPU, the
        bytes predicted to be mapped from other engines.  Takes the GPU's start-up lock.

        Raises:
            DedupError: registry, device or lock trouble with ``on_registry_error="fail"``
                (`EngineSession.begin_startup`).
        """
        return (self.inner.get_external_weight_memory(vllm_config)
                + EngineSession.current().begin_startup(self.config, vllm_config))

    def cpu_linear(self, model_config: ModelConfig, vllm_config: VllmConfig | None = None) -> str:
        """``cpu_linear`` as this engine runs it on the CPU backend: the configured mode; where
        ``packed`` cannot work here (`onednn.probe`), ``vllm`` if vLLM itself runs ``F.linear``
        for the model's dtype (`onednn.vllm_packs`): each layer runs as vLLM's own dispatch
        makes it, ``F.linear`` on a plain weight (shared) where vLLM falls back to it, vLLM's
        packed copy where it packs (a float32 router gate; shared where `shares_packed`); else
        ``private`` (said once in the log and in every load report's ``private_linears``).  ``vllm`` is
        never asked for, only chosen here, and it has a load signature of its own: its final
        tensors differ from ``plain``'s wherever vLLM packs a layer.

        ``plain`` asked for in a compiled engine whose compile-cache key cannot say so
        (`compile_cache.can_key_compile_cache`: an ``additional_config`` object) runs as
        ``private`` instead, with a warning (`fallback.fail_or_fall_back`): vLLM's own graph.
        The first call decides (the load's `_context` or `create_model`, which pass
        ``vllm_config``); later calls return that decision.

        Raises:
            DedupError: that fallback, under ``on_registry_error="fail"``.
        """
        if self._cpu_linear is None:
            mode = self.config.cpu_linear
            if mode == "plain" and vllm_config is not None and not can_key_compile_cache(vllm_config):
                fail_or_fall_back(self.config, DedupError(
                    "vllm-dedup: cpu_linear='plain' changes the model's graph, and vLLM's compile cache must know "
                    f"it, but additional_config is a {type(vllm_config.additional_config).__name__}, not a dict; "
                    "pass a dict, set cpu_linear='packed', or run with enforce_eager"),
                    "linear layers keep vLLM's own private packed copies (cpu_linear=private)")
                self.packed_declined = "every linear: cpu_linear='plain' needs a compile-cache key of its own"
                mode = "private"
            if mode == "packed":
                dtype = dtype_name(model_config.dtype)
                support = onednn.probe(dtype)  # through the package: tests replace it there
                if not support.supported and not onednn.vllm_packs(dtype):
                    # vLLM itself runs F.linear here (its oneDNN matmul cannot be made for this
                    # dtype, e.g. bfloat16 on AVX2): so does this engine, on shared weights.
                    logger.info("vLLM runs F.linear for %s linears on this CPU (%s); so does this engine, on "
                                "shared weights, and a linear of a dtype vLLM packs runs vLLM's oneDNN kernel "
                                "(cpu_linear=vllm)", dtype, support.reason)
                    mode = "vllm"
                elif not support.supported:
                    # vLLM's own kernels on private packed copies: plain's speed and numerics,
                    # where F.linear on shared weights runs at a third to two thirds of it.
                    self.packed_declined = f"every linear: packed sharing cannot work here ({support.reason})"
                    logger.warning("cpu_linear=packed cannot work here (%s); linear layers keep vLLM's own "
                                   "private packed copies (cpu_linear=private). cpu_linear='plain' shares them "
                                   "instead, run by F.linear at a third to two thirds of oneDNN's speed",
                                   support.reason)
                    mode = "private"
            self._cpu_linear = mode
        return self._cpu_linear

    def shares_packed(self, model_config: ModelConfig) -> bool:
        """Whether this engine shares the packed weights of vLLM's oneDNN handlers (`packed.py`):
        with ``cpu_linear="packed"``; with ``vllm``, those vLLM still makes here (a bfloat16
        model's float32 router gate: oneDNN packs float32 on every x86 ISA) where the probe
        passes for float32 (`onednn.probe`; a handler of another dtype is checked alone and
        keeps its private copy if not understood, as under ``packed``)."""
        mode = self.cpu_linear(model_config)
        return mode == "packed" or (mode == "vllm" and onednn.probe("float32").supported)

    def create_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """The inner loader's model.  On the CPU backend, with ``cpu_linear="plain"``: plain
        linear weights (with ``vllm``: those of a dtype vLLM does not pack), and a graph change
        in vLLM's compile-cache key; and vLLM's CPU artifacts made loadable (`compile_cache`)."""
        model = self.inner.create_model(vllm_config, model_config, prefix)
        if not _is_cpu():
            return model

        allow_cpu_aot_loads()
        mode = self.cpu_linear(model_config, vllm_config)
        marked = _keep_cpu_weights_plain(model, only_where_vllm_does=mode == "vllm") if mode in ("plain", "vllm") \
            else Counter()
        key_compile_cache(vllm_config, _changes_graph(marked))
        if mode == "plain":
            logger.info("cpu_linear=plain: %d linear layers and vocabulary embeddings keep plain weights "
                        "(F.linear), shared as they are", sum(marked.values()))
        elif mode == "vllm" and not self.shares_packed(model_config):
            packs = _packed_by_vllm(model)
            if packs:  # said in every load report of this loader (`load_model`)
                self.packed_declined = (f"{sum(packs.values())} linears of a dtype vLLM packs here "
                                        f"({', '.join(sorted(packs))}) keep vLLM's private packed copies (cpu_linear=vllm)")
        return model

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """Load on the path the registry's recipes allow, then share (module docstring).  A
        load that fails, which may be vllm-dedup's own code around vLLM's (its recording,
        provenance or in-place layout around ``load_weights``, a oneDNN handler left unusable),
        is given up and the engine loads again without sharing, unless ``on_registry_error`` is
        ``fail``; if that load fails too, the error is vLLM's own.  Out of memory, and a file
        that cannot be opened, are raised at once (`_NOT_RETRIED`): a second load would fail
        the same way.

        Raises:
            RegistryUnavailable: the registry cannot be reached, or fails, and
                ``on_registry_error`` is ``fail``.
            SegmentError: shared memory cannot be made or mapped, and ``on_registry_error`` is
                ``fail``.
            Exception: under ``fail``, whatever stopped the load; otherwise whatever stopped the
                load without sharing (vLLM's own error).
        """
        self.report = None
        ctx = self._context(vllm_config, model_config, prefix)
        if ctx is None:
            if self.config.cpu_linear == "plain" and self._cpu_linear in (None, "plain"):
                # It shares nothing: vLLM's own graph and kernels, not F.linear's (the model is
                # not made yet, so nothing has keyed the compile cache for the plain graph).
                logger.info("cpu_linear=plain is for shared weights; this engine's stay private, so its linear "
                            "layers run vLLM's own kernels (cpu_linear=private)")
                self._cpu_linear = "private"
            return self._privately(vllm_config, model_config, prefix)
        report = self.report = LoadReport()
        registrations = Registrations(vllm_config)
        failed = None
        try:
            model, meter = self._load_and_share(ctx, report)
        except Exception as e:
            if ctx.failures_stop_the_engine or isinstance(e, _NOT_RETRIED):
                raise
            failed = f"{type(e).__name__}: {e}"
            # The traceback as text: a log record keeping the exception would keep the model given up.
            logger.warning("%s: the load failed (%s); loading again without sharing, in case vllm-dedup's own "
                           "code around it failed (if that load fails too, the error is vLLM's own)\n%s",
                           ctx.model_name, failed, traceback.format_exc())
        if failed is not None:  # here, not in the handler: its traceback holds the model given up
            self.report = None
            registrations.undo()  # its layers, registered by name in vLLM's config, are made again
            gc.collect()  # that model lives in reference cycles (a weight_loader is a bound method)
            with contextlib.suppress(Exception):
                segment_class(ctx.device_type).return_cached(collect=False)
            return self._privately(vllm_config, model_config, prefix)
        report.load_seconds = meter.seconds
        report.peak_bytes = meter.peak_bytes
        try:
            ctx.lease.report(report.figures())
        except RegistryUnavailable:
            pass
        session = EngineSession.current()
        # Held while the model lives: an engine of the user's own process deleted lets its
        # segments go with it (a separate engine process closes its lease as it exits anyway).
        session.hold(ctx.lease, report.segment_bytes, report.shared_bytes, model)
        ctx.lease.watch()  # re-registers what it holds with a registry that comes back
        session.describe(model)
        logger.info("%s: %s", ctx.model_name, report.summary())
        return model

    def _privately(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str) -> nn.Module:
        """The inner loader's usual load, nothing shared, its model described as a shared one's
        is (`EngineSession.describe`: with patches/ applied, vLLM reads the budget correction,
        the start-up's end and the guard's figure from the model)."""
        model = self._load_as_usual(vllm_config, model_config, prefix)
        EngineSession.current().describe(model)
        return model

    def _load_and_share(self, ctx: LoadContext, report: LoadReport):
        """`load_model`'s load through ``ctx``, its sharing pass and its recipe: ``(model, the
        load's LoadMeter)``.  A load that stops keeps no registry connection, nor what it
        published (the exception goes on)."""
        staging = self._staging(ctx)
        in_place = self._in_place(ctx, staging)

        def held() -> int:  # the segments this load made, as they exist now
            return (report.created_bytes + (staging.created_bytes if staging is not None else 0)
                    + (in_place.held_bytes if in_place is not None else 0))

        try:
            with LoadMeter(ctx.device_type, live=held) as meter, _gc_heap_frozen(), recorded_handlers(ctx.handlers):
                try:
                    model, mapped, replay, recorded, decision = self._load(ctx, report, staging, in_place)
                except BaseException:  # the sharing pass lets go of them otherwise (`share_model`)
                    _let_go(staging, in_place)
                    raise
                report.private_linears = self.packed_declined  # known once `create_model` ran; the sharing pass may say more
                self._share(model, ctx, report, mapped, staging, in_place)
                if in_place is not None and in_place.placed_bytes:
                    logger.info("%s: %s%s", ctx.model_name, in_place.summary(),
                                f" (first of what was copied: {in_place.failures[0]})" if in_place.failures else "")

                leave_recipe(ctx, model, report, recorded, replay, decision)
        except BaseException:  # a load that stops keeps no registry connection, nor what it published
            EngineSession.current().let_go(ctx.lease)
            raise
        return model, meter

    @staticmethod
    def _staging(ctx: LoadContext):
        """A `staging.Staging` for a usual load of this context (packed weights moved into
        segments as vLLM makes them), or None where nothing is staged: another device than
        the host's, or packed weights not shared."""
        if not ctx.share_packed or ctx.device_type != "cpu":
            return None

        return Staging(ctx.config.min_tensor_bytes, ctx.device_key, colliding)

    @staticmethod
    def _in_place(ctx: LoadContext, staging) -> InPlace | PackedInPlace | None:
        """Where a load of this context that reads the checkpoint loads its tensors into
        segments of its own: `in_place.InPlace` on the host (a memfd per storage; the weights
        vLLM packs and drops stay out: `packed.packed_and_dropped`, or where nothing is staged,
        `_packed_and_dropped_here`), `in_place_packed.PackedInPlace` where segments come in
        granules (CUDA); None with ``in_place`` off, or where the backend cannot say its
        granularity."""
        if not ctx.config.in_place:
            return None
        skip = packed_and_dropped if staging is not None else (_packed_and_dropped_here if ctx.device_type == "cpu"
                                                               else None)
        packed_on_host = os.environ.get(PACKED_ON_HOST_ENV)  # a test hook (in_place_packed.py)
        if ctx.device_type == "cpu" and not packed_on_host:
            return InPlace(ctx.config.min_tensor_bytes, skip=skip, huge_pages=ctx.config.huge_pages)
        try:
            seg_cls = segment_class(ctx.device_type)
            granularity = seg_cls.granularity(ctx.device) or int(packed_on_host)
        except (NotImplementedError, SegmentError) as e:
            logger.info("%s: tensors load into private memory (%s)", ctx.model_name, e)
            return None
        return PackedInPlace(seg_cls, ctx.device_key, ctx.device_type, granularity, ctx.config.min_tensor_bytes, skip)

    def _load(self, ctx: LoadContext, report: LoadReport, staging=None, in_place=None):
        """The model, by the fastest exact path: (model, tensors mapped by a recipe, the
        `replay.Replay` or None, the `fast_path.RecordedLoad` or None, the `fast_path.Decision`
        or None).  A usual load stages its packed weights into ``staging`` as it goes; what is
        read from the checkpoint (all of a usual load, a replay's unmatched modules) is loaded
        into ``in_place``'s segments."""

        files, why = fast_path_files(ctx, self.inner)
        decision = None
        if files and getattr(ctx.lease, "launching", False):  # a daemon this engine started: empty
            why = "no recipe yet: this engine started the registry"
        elif files:
            decision = decide(ctx, files)
            report.checkpoint_bytes_read += decision.bytes_hashed
            why = decision.why
            if decision.match is not None:
                replay = Replay(ctx, decision.match, decision.where, in_place, decision.identities)
                try:
                    model = replay.build()
                except RecipeDeclined as e:
                    why = f"the recipe could not be used ({e})"
                else:
                    report.checkpoint_bytes_read += replay.bytes_read
                    self._log_replay(ctx, decision.match, replay)
                    report.load_path = "modules" if decision.match.unmatched else "full"
                    ctx.lease.keep_recipe(decision.recipe_bytes)  # given again to a registry that comes back
                    return model, replay.placement, replay, None, decision
                # The model given up lives in reference cycles (each parameter's weight_loader
                # is a bound method of its layer): collected now, not after the usual load has
                # made the model again beside it (vLLM collects only after load_weights).
                del replay
                gc.collect()
        logger.info("%s: loading from the checkpoint: %s", ctx.model_name, why)
        recorded = None
        if files:
            try:
                recorded = RecordedLoad(files)
            except (CheckpointError, OSError) as e:
                logger.info("%s: this load leaves no recipe (%s)", ctx.model_name, e)
        model = self._load_as_usual(ctx.vllm_config, ctx.model_config, ctx.prefix, recorded, staging, in_place)
        if staging is not None and (staging.staged or staging.failures):
            logger.info("%s: %s while post-processing%s", ctx.model_name, staging.summary(),
                        f"; some stay with oneDNN ({staging.failures[0]})" if staging.failures else "")
        if recorded is not None:
            try:
                recorded.finish()
                report.checkpoint_bytes_read += recorded.recorder.bytes_read
            except Exception as e:  # recording never stops a load that succeeded
                logger.warning("%s: this load leaves no recipe (%s: %s)", ctx.model_name,
                               type(e).__name__, e)
                recorded = None
        return model, {}, None, recorded, decision

    @staticmethod
    def _log_replay(ctx: LoadContext, match, replay) -> None:
        if match.unmatched:
            first, reason = sorted(match.unmatched.items())[0]
            logger.info("%s: a recipe maps %d of %d modules (%.1f MB); %d loaded from the checkpoint "
                        "(%s: %s)", ctx.model_name, len(match.matched), len(match.recipe.modules),
                        replay.mapped_bytes / 1e6, len(match.unmatched), first, reason)
        else:
            logger.info("%s: a recipe maps every module (%.1f MB); no checkpoint tensor read",
                        ctx.model_name, replay.mapped_bytes / 1e6)

    def _load_as_usual(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
                       recorded=None, staging=None, in_place=None) -> nn.Module:
        """vLLM's own ``BaseModelLoader.load_model`` template with this loader's ``create_model``
        and the inner loader's ``load_weights`` (recorded when ``recorded`` is given; packed
        weights staged into ``staging`` as they are made; tensors loaded into ``in_place``'s
        segments), or the inner loader's own pipeline when it has one (the fast paths never
        record those: `fast_path.fast_path_files`)."""
        if type(self.inner).load_model is BaseModelLoader.load_model:
            return _UsualLoad(self, recorded, staging, in_place).load_model(vllm_config, model_config, prefix)
        return self.inner.load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)

    def _share(self, model, ctx: LoadContext, report: LoadReport, mapped: dict, staging=None, in_place=None) -> None:

        # The sharing pass raises only under on_registry_error="fail"; the message says what to do.
        try:
            share_model(model, ctx, report, mapped, pack_granularity=in_place and in_place.granularity,
                        staging=staging, in_place=in_place)
        except RegistryUnavailable as e:
            raise RegistryUnavailable(f"vllm-dedup: the registry failed while sharing weights: {e}") from None
        except SegmentError as e:
            raise SegmentError(
                f"vllm-dedup: shared memory for the weights could not be created or mapped ({e}); "
                "set on_registry_error='fallback' to load such tensors privately instead") from None

    def _context(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str) -> LoadContext | None:
        """This load's `LoadContext`, or None when it cannot share (no segment backend or
        driver for the device, or no registry: the load is private then, with a warning)."""

        device = torch.device(vllm_config.load_config.device or vllm_config.device_config.device)

        reason = private_reason(vllm_config)
        if reason is not None:
            logger.warning("this engine's weights stay private: %s, which shared read-only weights "
                           "cannot allow", reason)
            return None
        try:
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            device_key = segment_class(device.type).device_key(device)
        except (NotImplementedError, RuntimeError, SegmentError) as e:  # no backend, driver or cuda-bindings
            fail_or_fall_back(self.config, SegmentError(f"vllm-dedup: cannot share weights on {device}: {e}"),
                              "loading privately")
            return None
        cpu_linear = self.cpu_linear(model_config, vllm_config) if device.type == "cpu" else ""
        share_packed = device.type == "cpu" and self.shares_packed(model_config)
        try:
            signature = load_signature(vllm_config, model_config, self.config.inner_load_format, cpu_linear)
        except OSError as e:
            fail_or_fall_back(self.config, unreadable(e), "loading privately")
            return None
        lease = EngineSession.current().connect(self.config, str(model_config.model), device_key, signature)
        if lease is None:
            return None
        return LoadContext(self.config, lease, device, device_key, signature, vllm_config, model_config, prefix,
                           create_model=lambda: self.create_model(vllm_config, model_config, prefix),
                           share_packed=share_packed)


class _UsualLoad(BaseModelLoader):
    """One usual load through vLLM's ``BaseModelLoader.load_model`` template: the outer loader's
    ``create_model``, the inner loader's ``load_weights``, and, for a `fast_path.RecordedLoad`,
    its recorder around the weight iterator and the model's weight loaders; with a
    `staging.Staging`, a hook after each module's post-processing; with an `in_place.InPlace`,
    the model's tensors moved into its segments before the weights are loaded (the state of one
    load lives here, not in the long-lived loader)."""

    def __init__(self, outer: DedupModelLoader, recorded=None, staging=None, in_place=None):
        super().__init__(outer.load_config)
        self.outer, self.recorded, self.staging, self.in_place = outer, recorded, staging, in_place
        self._hooks = contextlib.ExitStack()

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        with self._hooks:  # the post-processing hooks entered by `load_weights` end with the load
            return super().load_model(vllm_config, model_config, prefix)

    def download_model(self, model_config: ModelConfig) -> None:
        self.outer.download_model(model_config)

    def create_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        return self.outer.create_model(vllm_config, model_config, prefix)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        if self.in_place is not None:  # the weight loaders then write into the segments
            self.in_place.place(model)
        self._load_weights(model, model_config)
        if self.staging is not None:  # vLLM's template post-processes next: stage as it goes

            from vllm.model_executor.layers.attention import is_deferred_attention_layer

            modules = {n: m for n, m in model.named_modules()
                       if getattr(m, "quant_method", None) is not None or is_deferred_attention_layer(m)}
            # each layer's freed buffers serve the next, however large (Note [large blocks from the heap])
            self._hooks.enter_context(reused_heap(large_blocks=True))
            self._hooks.enter_context(post_processing_hooks(modules, self.staging.after_post_processing,
                                                            before=self.staging.before_post_processing))
            self._hooks.callback(self.staging.finish)  # the last copy in flight, before the heap is trimmed

    def _load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        inner, recorded = self.outer.inner, self.recorded
        if recorded is None:
            return inner.load_weights(model, model_config)

        recorded.attrs_before = model_attrs(model)
        recorder = recorded.recorder
        recorder.wrap(model, holds_no_data=self.in_place.holds_no_data if self.in_place is not None else None)
        weights = inner.get_all_weights
        inner.get_all_weights = lambda mc, m: recorder.iterate(weights(mc, m))
        try:
            with recorder.tracing():
                return inner.load_weights(model, model_config)
        finally:
            del inner.get_all_weights  # back to the class's method
            recorder.unwrap()  # before post-processing frees what it replaces
            logger.debug("provenance: %d torch calls traced in %.3f s%s", recorder.provenance.calls,
                         recorder.provenance.overhead_s,
                         f"; unknown after {recorder.provenance.lost}" if recorder.provenance.lost else "")


def _let_go(staging, in_place) -> None:
    """Let go of a failed load's own segments: the staging thread stops, and the descriptors
    close (the pages go with the last tensor over them).  Never raises."""
    for held in (staging, in_place):
        if held is not None:
            try:
                held.release()
            except Exception as e:  # the load's own error is the one to see
                logger.warning("letting go of a failed load's segments: %s: %s", type(e).__name__, e)


# Errors a second load, without sharing, would meet again: raised at once (`load_model`).
_NOT_RETRIED = (MemoryError, torch.OutOfMemoryError, FileNotFoundError, PermissionError, IsADirectoryError)


def _packed_and_dropped_here(module, name: str) -> bool:
    """Whether vLLM's CPU post-processing packs and drops ``module``'s tensor ``name`` where the
    engine stages nothing (``cpu_linear`` ``private``, ``plain`` or ``vllm``): a linear layer's
    weight (`packed.packed_and_dropped`) of a dtype whose oneDNN matmul vLLM can make here
    (`onednn.vllm_packs`); else vLLM's dispatch falls back to ``F.linear`` and keeps it.  Such
    a weight stays out of the in-place load: loaded into a memfd, it would cost shmem's page
    faults and two descriptors for bytes vLLM drops.  (A weight vLLM packs by another kernel,
    sgl's small GEMMs or zentorch, is still placed, for nothing, as before.)"""
    return packed_and_dropped(module, name) and onednn.vllm_packs(dtype_name(getattr(module, name).dtype))


@contextlib.contextmanager
def _gc_heap_frozen():
    """Keep the objects that exist now out of the garbage collector's passes during the block
    (``gc.freeze``; ``gc.unfreeze`` after, so vLLM's own ``freeze_gc_heap`` at the end of start-up
    finds them as before).  The collections that building a model triggers would otherwise walk
    the whole heap of a vLLM process each time: about 0.45 s of a 0.9 s ``full`` load of a 1B
    model here (benchmarks/load_time.py --profile)."""
    import gc

    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _keep_cpu_weights_plain(model: nn.Module, only_where_vllm_does: bool = False) -> Counter:
    """Mark linear layers with vLLM's ``_cpu_skip_gemm_dispatch`` and give unquantized vocabulary
    embeddings (input and head) a post-processing that keeps ``F.linear`` on the plain weight
    instead of packing a oneDNN copy (their lookup never uses it; the head computes logits with
    ``layer.cpu_linear``).  A marked linear is one whose weight vLLM does not repack, which a
    recipe relies on (`recipe_builder.unreplayable_reason`).

    With ``only_where_vllm_does`` (``cpu_linear="vllm"``), only modules whose weight vLLM's own
    dispatch would leave to ``F.linear`` anyway (`_vllm_runs_f_linear`): the mark changes no
    kernel then.  A quantized layer is left alone there (vLLM's CPU FP8 kernels read the mark).

    Returns the modules changed, counted by their ``weight``'s dtype name (``""`` for a module
    without one: a quantized layer's kernel is not vLLM's dispatch)."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod, VocabParallelEmbedding

    marked = Counter()
    for module in model.modules():
        linear = isinstance(module, LinearBase)
        if not linear and not (isinstance(module, VocabParallelEmbedding)
                               and isinstance(module.quant_method, UnquantizedEmbeddingMethod)):
            continue
        weight = getattr(module, "weight", None)
        if only_where_vllm_does and (
                (linear and not isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod))
                or not isinstance(weight, torch.Tensor) or not _vllm_runs_f_linear(weight)):
            continue
        if linear:
            module._cpu_skip_gemm_dispatch = True
        else:
            module.quant_method.process_weights_after_loading = _plain_cpu_linear
        marked[dtype_name(weight.dtype) if isinstance(weight, torch.Tensor) else ""] += 1
    return marked


def _vllm_runs_f_linear(weight: torch.Tensor) -> bool:
    """Whether vLLM's CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm``, vLLM's
    ``model_executor/layers/utils.py``) ends at ``F.linear`` for an unquantized layer's
    ``weight`` (real or meta: only its shape and dtype are read): a 2-D weight neither its
    small-GEMM kernel takes (``check_cpu_sgl_kernel``: AMX, by the hardware, whatever
    ``ONEDNN_MAX_CPU_ISA`` says) nor oneDNN packs (`onednn.vllm_packs`).  A weight of another
    rank vLLM leaves as it is, but for a bfloat16 causal conv's, which it packs where the CPU
    has AVX-512-BF16: there vLLM packs bfloat16 linears too and ``vllm`` is not chosen, unless
    oneDNN is held below the hardware (``ONEDNN_MAX_CPU_ISA=AVX2`` on such a CPU; not
    modelled).  Nor is zentorch's dispatch (its platform packs bfloat16 too)."""
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

    if weight.ndim != 2:
        return True
    n, k = weight.shape
    return not check_cpu_sgl_kernel(n, k, weight.dtype) and not onednn.vllm_packs(dtype_name(weight.dtype))


def _packed_by_vllm(model: nn.Module) -> Counter:
    """Unquantized linear layers whose weight dtype vLLM packs for oneDNN here
    (`onednn.vllm_packs`), counted by dtype name: under ``cpu_linear="vllm"`` where it does
    not share packed weights (`DedupModelLoader.shares_packed`) they keep vLLM's private packed
    copies (AMX's small-GEMM packs, which vLLM decides by shape, are not
    counted)."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    out = Counter()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, LinearBase) and isinstance(module.quant_method, UnquantizedLinearMethod)
                and isinstance(weight, torch.Tensor) and onednn.vllm_packs(dtype_name(weight.dtype))):
            out[dtype_name(weight.dtype)] += 1
    return out


def _changes_graph(marked: Counter) -> bool:
    """Whether modules marked by `_keep_cpu_weights_plain` (counted by weight dtype) run another
    graph than vLLM's own: ``F.linear`` where vLLM would call oneDNN on a packed copy, i.e. where
    vLLM packs one of those dtypes (`onednn.vllm_packs`).  Where it runs ``F.linear`` itself for
    every one of them (bfloat16 on AVX2; not a float32 router gate, which it packs there) the
    graph is its own."""
    return any(onednn.vllm_packs(dtype) for dtype in marked if dtype)


def _plain_cpu_linear(layer: nn.Module) -> None:
    """Post-processing of an unquantized vocabulary embedding on the CPU, sharing-friendly: the
    head computes logits with ``F.linear`` on the (shareable) weight.  Idempotent, so it is also
    right in vLLM's pre-processed mode."""
    layer.cpu_linear = torch.nn.functional.linear


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
