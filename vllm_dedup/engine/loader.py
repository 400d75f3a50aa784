"""`DedupModelLoader`: the loader behind ``--load-format dedup``.

It wraps an inner vLLM loader (``inner_load_format``, default ``auto``), built from a copy of
the engine's `LoadConfig` carrying the inner format and only the inner loader's own extra
config: vLLM's `DefaultModelLoader` rejects load formats and keys it does not know.

Loading runs vLLM's own `BaseModelLoader.load_model` template (create the model, load weights,
``process_weights_after_loading``) with the inner loader's steps, then `share.share_model`
swaps every tensor whose content is already resident in another engine for that resident copy
and publishes the rest.  The registry is reached before loading starts, so
``on_registry_error="fail"`` stops a misconfigured engine at once.

On a GPU, vLLM's ``get_external_weight_memory`` call (just before its memory snapshot) is where
the engine takes its device's start-up lock and, with ``accounting="external"``, reports the
bytes it expects to map (`session.py`).  Everything this engine keeps between loading and the
worker hooks lives in its `session.EngineSession`.

On vLLM's CPU backend, ``cpu_share_linear`` (default on) marks linear layers with vLLM's own
``_cpu_skip_gemm_dispatch`` before post-processing, so their weights stay plain tensors
(``F.linear``) that can be shared instead of being repacked into oneDNN-owned memory.
"""

from __future__ import annotations

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
from .session import EngineSession, load_signature

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

    def download_model(self, model_config: ModelConfig) -> None:
        self.inner.download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        self.inner.load_weights(model, model_config)

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """The inner loader's external bytes plus, with ``accounting="external"`` on a GPU, the
        bytes predicted to be mapped from other engines.  Takes the GPU's start-up lock.

        Raises:
            RuntimeError: registry or lock trouble with ``on_registry_error="fail"``.
        """
        return (self.inner.get_external_weight_memory(vllm_config)
                + EngineSession.current().begin_startup(self.config, vllm_config))

    def create_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        model = self.inner.create_model(vllm_config, model_config, prefix)
        if self.config.cpu_share_linear and _is_cpu():
            from vllm.model_executor.layers.linear import LinearBase

            marked = 0
            for module in model.modules():
                if isinstance(module, LinearBase):
                    module._cpu_skip_gemm_dispatch = True
                    marked += 1
            logger.warning(
                "vllm-dedup: cpu_share_linear=true: %d linear layers keep plain weights (F.linear) so that "
                "they can be shared; on CPU that is slower than vLLM's oneDNN path (benchmarks/cpu_linear.py "
                "measured 0.63x decode throughput on a 2-core AVX2 machine). Set cpu_share_linear=false to keep "
                "oneDNN and share only embeddings, norms and untied heads.", marked,
            )
        return model

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """Load through the inner loader, then share resident tensors (module docstring).

        Raises:
            RuntimeError: the registry cannot be reached and ``on_registry_error`` is ``fail``.
        """
        device = torch.device(vllm_config.load_config.device or vllm_config.device_config.device)
        client, device_type, device_key = self._client_for(vllm_config, model_config, device)
        if type(self.inner).load_model is BaseModelLoader.load_model:
            model = super().load_model(vllm_config, model_config, prefix)
        else:  # the inner loader has its own pipeline: use it unchanged
            model = self.inner.load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        if client is None:
            return model
        from .share import share_model

        try:
            self.result = share_model(
                model, client, device_type, self.config.min_tensor_bytes, self.config.verify,
                fail=self.config.on_registry_error == "fail", device_key=device_key,
            )
        except RegistryUnavailable as e:
            raise RuntimeError(f"vllm-dedup: the registry failed while sharing weights: {e}") from None
        except SegmentError as e:
            raise RuntimeError(
                f"vllm-dedup: shared memory for the weights could not be created or mapped ({e}); "
                "set on_registry_error='fallback' to load such tensors privately instead") from None
        session = EngineSession.current()
        session.hold(client, self.result.segment_bytes, self.result.shared_bytes)
        _describe_for_upstream_hooks(model, session)
        logger.info("vllm-dedup: %s: %s", model_config.model, self.result.summary())
        return model

    def _client_for(self, vllm_config: VllmConfig, model_config: ModelConfig, device):
        """(registry connection or None, device type, device key) for loading onto ``device``."""
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
            return None, device_type, None
        client = EngineSession.current().connect(self.config, str(model_config.model), device_key,
                                                 load_signature(vllm_config))
        return client, device_type, device_key


def _describe_for_upstream_hooks(model, session: EngineSession) -> None:
    """Set the model attributes that upstream vLLM's form of the worker hooks reads
    (``patches/``): with those patches applied, vLLM needs no wrapper from `worker_hooks`."""
    model.shared_weight_bytes = session.segment_bytes
    model.external_weight_correction_bytes = session.correction_bytes
    model.on_startup_done = session.end_startup


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
