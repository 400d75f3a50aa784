"""Fail or fall back: the one place that decides what a failure inside vllm-dedup does to an engine.

A failure inside vllm-dedup never stops an engine that could have loaded privately, unless the
user asked for it with ``on_registry_error="fail"`` (`config.DedupConfig`).  `fail_or_fall_back`
applies that rule at every site where the engine can go on without sharing: under ``fail`` it
raises the error, a `errors.DedupError` of the kind that failed, with a message that says what
to do; otherwise it logs the error and what the engine does instead, once, and returns.
"""

from __future__ import annotations

from ..errors import DedupError
from ..log import init_logger

__all__ = ["FALLBACK_ADVICE", "fail_or_fall_back"]

logger = init_logger(__name__)

# What an error raised under ``fail`` may add; logged under ``fallback``, it would advise what is set.
FALLBACK_ADVICE = ", or set on_registry_error='fallback' to load without sharing"
_PREFIX = "vllm-dedup: "  # a raised error's own; the logger adds its own prefix


def fail_or_fall_back(config, error: DedupError, fallback: str) -> None:
    """Raise ``error`` when ``config.on_registry_error`` is ``"fail"``; else log one warning,
    ``"<error>; <fallback>"`` (without the error's own ``"vllm-dedup: "``: the logger says
    it), and return (the caller then goes on without sharing).

    Args:
        config: the load's `config.DedupConfig`.
        error: what failed, as its `errors.DedupError` type, its message saying what to do.
        fallback: what the engine does instead, e.g. ``"loading without sharing"``.

    Raises:
        DedupError: ``error`` itself, under ``on_registry_error="fail"``.
    """
    if config.on_registry_error == "fail":
        raise error
    message = str(error)
    logger.warning("%s; %s", message[len(_PREFIX):] if message.startswith(_PREFIX) else message, fallback)
