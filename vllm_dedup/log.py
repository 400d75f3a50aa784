"""The loggers of vllm-dedup, as vLLM's own are made.

`init_logger(__name__)` in every module.  A module ``vllm_dedup.engine.loader`` logs to
``vllm.dedup.engine.loader``: under the ``vllm`` logger, whose handlers and format vLLM
configures in every process it starts (``VLLM_LOGGING_LEVEL``, ``VLLM_CONFIGURE_LOGGING``), so
vllm-dedup's lines appear with vLLM's and obey the same settings.  In a process without vLLM (the
standalone registry daemon, the ``vllm-dedup`` command) they propagate to the root logger.

Every message starts with ``vllm-dedup:``: vLLM's format names the file (``loader.py``), which
vLLM has too, not the logger.  The adapter adds the prefix; messages are written without it.
"""

from __future__ import annotations

import logging

__all__ = ["PREFIX", "init_logger"]

PREFIX = "vllm-dedup: "


class _Prefixed(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return PREFIX + str(msg), kwargs


def init_logger(name: str) -> logging.LoggerAdapter:
    """The logger of module ``name`` (``__name__``), under vLLM's ``vllm`` logger (module
    docstring)."""
    tail = name.removeprefix("vllm_dedup").lstrip(".")
    return _Prefixed(logging.getLogger("vllm.dedup" + (f".{tail}" if tail else "")), {})
