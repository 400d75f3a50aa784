"""The dedup load format's configuration, read from ``--model-loader-extra-config`` JSON.

vLLM's convention: each load format takes its options as one JSON object,
``--model-loader-extra-config '{"inner_load_format": "safetensors"}'`` on the command line or
``LLM(..., model_loader_extra_config={...})`` in Python.  Options meant for the inner loader go
in ``inner_extra_config``, so the two loaders' keys can never be confused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = ["DedupConfig"]


@dataclass(frozen=True)
class DedupConfig:
    """Options of ``--load-format dedup``.

    Attributes:
        inner_load_format: the vLLM load format that reads the checkpoint (``auto``,
            ``safetensors``, ``pt``, ``gguf``, ``runai_streamer``, ...).  Not ``dedup``.
        inner_extra_config: the inner loader's own ``model_loader_extra_config``.
    """

    inner_load_format: str = "auto"
    inner_extra_config: dict = field(default_factory=dict)

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> DedupConfig:
        """Parse and check ``model_loader_extra_config``.

        Raises:
            ValueError: not a JSON object, an unknown key (the message lists the valid ones),
                or a value of the wrong type.
        """
        extra = {} if extra is None else extra
        if not isinstance(extra, dict):
            raise ValueError(
                f"--model-loader-extra-config for load format dedup must be a JSON object, "
                f"got {type(extra).__name__}"
            )
        valid = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join(map(repr, unknown))} in --model-loader-extra-config "
                f"for load format dedup; valid keys: {', '.join(valid)} "
                "(options for the inner loader go inside 'inner_extra_config')"
            )
        config = cls(**extra)
        if not isinstance(config.inner_load_format, str) or not config.inner_load_format:
            raise ValueError(f"inner_load_format must be a load format name, got {config.inner_load_format!r}")
        if config.inner_load_format.lower() == "dedup":
            raise ValueError("inner_load_format cannot be 'dedup' itself; use 'auto' or another vLLM load format")
        if not isinstance(config.inner_extra_config, dict):
            raise ValueError(
                f"inner_extra_config must be a JSON object, got {type(config.inner_extra_config).__name__}"
            )
        return config
