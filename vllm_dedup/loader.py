"""`DedupModelLoader`: the loader behind ``--load-format dedup``.

It wraps an inner vLLM loader (``inner_load_format``, default ``auto``), built from a copy of
the engine's `LoadConfig` carrying the inner format and only the inner loader's own extra
config: vLLM's `DefaultModelLoader` rejects load formats and keys it does not know.

Status: this version delegates every step to the inner loader and stores weights privately,
exactly as the inner format would.  Sharing resident tensors between engines (content keys,
registry, segments) is added on top of `load_model` by the next stage of the project; the
plugin, the configuration and the CLI surface are already the final ones.
"""

from __future__ import annotations

from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.config.utils import replace
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from .config import DedupConfig

__all__ = ["DedupModelLoader"]


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

    def download_model(self, model_config: ModelConfig) -> None:
        self.inner.download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        self.inner.load_weights(model, model_config)

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        return self.inner.get_external_weight_memory(vllm_config)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """Load the model through the inner loader (vLLM's whole pipeline, unchanged)."""
        return self.inner.load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)

