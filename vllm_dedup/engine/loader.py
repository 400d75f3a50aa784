"""`DedupModelLoader`: the loader behind ``--load-format dedup``.

It wraps an inner vLLM loader (``inner_load_format``, default ``auto``), built from a copy of
the engine's `LoadConfig` carrying the inner format and only the inner loader's own extra
config: vLLM's `DefaultModelLoader` rejects load formats and keys it does not know.

A load takes one of three paths (docs/architecture.md, "Loading only what is not resident"):

- ``full``: a recipe of this load signature matches every module of the checkpoint (its source
  keys come from the manifest cache: no tensor byte is read) and every final tensor is
  resident: the model is built on the meta device and everything is mapped (`mapped.py`);
- ``modules``: some modules match: those are mapped, only the others' checkpoint tensors are
  read and loaded;
- ``none``: vLLM's own ``BaseModelLoader.load_model`` template with the inner loader's steps
  (create, load weights, ``process_weights_after_loading``), recording each checkpoint tensor's
  source key and the module it went into (`sources.py`).

Then `share.share_model` maps or publishes what is not shared yet, the engine gives the registry
a recipe of its load (`recipe.py`), and reports its figures (`meter.py`).  The registry is
reached before anything else, so ``on_registry_error="fail"`` stops a misconfigured engine at
once.

On a GPU, vLLM's ``get_external_weight_memory`` call (just before its memory snapshot) is where
the engine takes its device's start-up lock and, with ``accounting="external"``, reports the
bytes it expects to map (`session.py`).  Everything this engine keeps between loading and the
worker hooks lives in its `session.EngineSession`.

On vLLM's CPU backend, ``cpu_share_linear`` (default on) keeps linear weights and the output
head plain (``F.linear``), so that they can be shared instead of being repacked into
oneDNN-owned memory: vLLM's own ``_cpu_skip_gemm_dispatch`` mark for linear layers, and for the
vocabulary embeddings a post-processing that does not pack (the input embedding's packed copy
is never used by its lookup; the head's is the one private copy of a weight left otherwise).
That changes the model's graph, so it enters vLLM's compile-cache key (`compile_cache`): a
compiled artifact of a plain engine is never loaded into such a model, nor the other way round.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.config.utils import replace
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ..config import DedupConfig
from ..errors import RegistryUnavailable, SegmentError
from .meter import LoadMeter
from .session import EngineSession
from .signature import load_signature

__all__ = ["DedupModelLoader"]

logger = logging.getLogger("vllm.dedup")  # under "vllm": vLLM's handlers and format apply


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
        self.inner = get_model_loader(
            replace(
                load_config,
                load_format=self.config.inner_load_format.lower(),
                model_loader_extra_config=dict(self.config.inner_extra_config),
            )
        )
        self.result = None
        self._recorder = None  # a `sources.SourceRecorder` while a recorded load runs
        self._attrs_before: dict = {}

    def download_model(self, model_config: ModelConfig) -> None:
        self.inner.download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """The inner loader's ``load_weights``; during a recorded load (path ``none`` with a
        registry), its weight iterator and the model's weight loaders go through a
        `sources.SourceRecorder`."""
        recorder = self._recorder
        if recorder is None:
            return self.inner.load_weights(model, model_config)
        from .recipe import model_attrs

        self._attrs_before = model_attrs(model)
        recorder.wrap(model)
        weights = self.inner.get_all_weights
        self.inner.get_all_weights = lambda mc, m: recorder.iterate(weights(mc, m))
        try:
            return self.inner.load_weights(model, model_config)
        finally:
            del self.inner.get_all_weights  # back to the class's method

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """The inner loader's external bytes plus, with ``accounting="external"`` on a GPU, the
        bytes predicted to be mapped from other engines.  Takes the GPU's start-up lock.

        Raises:
            RuntimeError: registry or lock trouble with ``on_registry_error="fail"``.
        """
        return (self.inner.get_external_weight_memory(vllm_config)
                + EngineSession.current().begin_startup(self.config, vllm_config))

    def create_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """The inner loader's model.  On the CPU backend, with ``cpu_share_linear``: plain linear
        weights, and that graph change in vLLM's compile-cache key; and vLLM's CPU artifacts
        made loadable (`compile_cache`)."""
        model = self.inner.create_model(vllm_config, model_config, prefix)
        if not _is_cpu():
            return model
        from .compile_cache import allow_cpu_aot_loads, key_compile_cache

        allow_cpu_aot_loads()
        key_compile_cache(vllm_config, self.config.cpu_share_linear)
        if self.config.cpu_share_linear:
            marked = _keep_cpu_weights_plain(model)
            logger.warning(
                "vllm-dedup: cpu_share_linear=true: %d linear layers and vocabulary embeddings keep plain "
                "weights (F.linear) so that they can be shared; on CPU that is slower than vLLM's oneDNN path "
                "(benchmarks/cpu_linear.py). Set cpu_share_linear=false to keep oneDNN and share only "
                "embeddings and norms.", marked,
            )
        return model

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """Load on the path the registry's recipes allow, then share (module docstring).

        Raises:
            RuntimeError: the registry cannot be reached, or fails, or shared memory cannot be
                made, and ``on_registry_error`` is ``fail``.
        """
        device = torch.device(vllm_config.load_config.device or vllm_config.device_config.device)
        client, device_type, device_key, signature = self._client_for(vllm_config, model_config, device)
        if client is None:
            return self._load_as_usual(vllm_config, model_config, prefix)
        from .fast_path import FastPath

        fast = FastPath(self, vllm_config, model_config, client, device, device_key, signature)
        with LoadMeter(device_type) as meter, _gc_heap_frozen():
            model = fast.build(prefix) if fast.usable else None
            if model is None:
                self._recorder = fast.recorder_for_usual_load()
                try:
                    model = self._load_as_usual(vllm_config, model_config, prefix)
                finally:
                    self._recorder = None
                fast.after_usual_load(self._attrs_before)
            self.result = self._share(model, client, device_type, device_key, fast.mapped)
            fast.give_recipe(model, self.result)
        result = self.result
        result.path, result.checkpoint_bytes_read = fast.path, fast.bytes_read
        result.load_seconds = meter.seconds
        result.peak_bytes = meter.peak_bytes(result.published_bytes + result.padding_bytes)
        try:
            client.report(result.report())
        except RegistryUnavailable:
            pass
        session = EngineSession.current()
        session.hold(client, result.segment_bytes, result.shared_bytes)
        client.watch()  # re-registers what it holds with a registry that comes back
        _describe_for_upstream_hooks(model, session)
        logger.info("vllm-dedup: %s: %s", model_config.model, result.summary())
        return model

    def _load_as_usual(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str) -> nn.Module:
        if type(self.inner).load_model is BaseModelLoader.load_model:
            return super().load_model(vllm_config, model_config, prefix)
        # the inner loader has its own pipeline: use it unchanged
        return self.inner.load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)

    def _share(self, model, client, device_type: str, device_key: str, mapped: dict[int, str]):
        from .share import share_model

        try:
            return share_model(model, client, device_type, self.config.min_tensor_bytes, self.config.verify,
                               fail=self.config.on_registry_error == "fail", device_key=device_key, mapped=mapped,
                               report=False)
        except RegistryUnavailable as e:
            raise RuntimeError(f"vllm-dedup: the registry failed while sharing weights: {e}") from None
        except SegmentError as e:
            raise RuntimeError(
                f"vllm-dedup: shared memory for the weights could not be created or mapped ({e}); "
                "set on_registry_error='fallback' to load such tensors privately instead") from None

    def _client_for(self, vllm_config: VllmConfig, model_config: ModelConfig, device):
        """(registry connection or None, device type, device key, load signature) for loading
        onto ``device``."""
        from ..segments import segment_class

        device_type = device.type
        try:
            if device_type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            device_key = segment_class(device_type).device_key(device)
        except (NotImplementedError, RuntimeError, SegmentError) as e:  # no backend, driver or cuda-bindings
            if self.config.on_registry_error == "fail":
                raise RuntimeError(f"vllm-dedup: cannot share weights on {device}: {e}") from None
            logger.warning("vllm-dedup: cannot share weights on %s (%s); loading privately", device, e)
            return None, device_type, None, None
        signature = load_signature(vllm_config, self.config.inner_load_format,
                                   self.config.cpu_share_linear and device_type == "cpu")
        client = EngineSession.current().connect(self.config, str(model_config.model), device_key, signature)
        return client, device_type, device_key, signature


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


def _describe_for_upstream_hooks(model, session: EngineSession) -> None:
    """Set the model attributes that upstream vLLM's form of the worker hooks reads
    (``patches/``): with those patches applied, vLLM needs no wrapper from `worker_hooks`."""
    model.shared_weight_bytes = session.segment_bytes
    model.external_weight_correction_bytes = session.correction_bytes
    model.on_startup_done = session.end_startup


def _keep_cpu_weights_plain(model: nn.Module) -> int:
    """Mark linear layers with vLLM's ``_cpu_skip_gemm_dispatch`` and give unquantized vocabulary
    embeddings (input and head) a post-processing that keeps ``F.linear`` on the plain weight
    instead of packing a oneDNN copy (their lookup never uses it; the head computes logits with
    ``layer.cpu_linear``).  Returns the number of modules changed."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod, VocabParallelEmbedding

    marked = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            module._cpu_skip_gemm_dispatch = True
            marked += 1
        elif isinstance(module, VocabParallelEmbedding) and isinstance(module.quant_method, UnquantizedEmbeddingMethod):
            module.quant_method.process_weights_after_loading = _plain_cpu_linear
            marked += 1
    return marked


def _plain_cpu_linear(layer: nn.Module) -> None:
    """Post-processing of an unquantized vocabulary embedding on the CPU, sharing-friendly: the
    head computes logits with ``F.linear`` on the (shareable) weight.  Idempotent, so it is also
    right in vLLM's pre-processed mode."""
    layer.cpu_linear = torch.nn.functional.linear


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
