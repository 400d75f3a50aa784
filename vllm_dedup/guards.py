"""Guards: refuse the vLLM operations that would write into shared weights.

A shared tensor is mapped read-only in several engines.  Any path that writes weights in place
would fault (host segments are sealed) or, worse on a device without read-only mappings,
silently change every other engine's model.  vLLM's ``worker_extension_cls`` cannot override
Worker methods, so the plugin wraps them here; each wrapper refuses with a clear error while
this process holds shared tensors and is a plain pass-through otherwise.

Each patch is tied to the vLLM versions it was checked against (`CHECKED_VLLM_VERSIONS`); on
another version a method that no longer exists is skipped with a warning, never guessed at.
``patches/`` holds the upstream-vLLM form of the same hook, which would make this module
unnecessary.
"""

from __future__ import annotations

import functools
import logging

from .share import shared_bytes_in_process

__all__ = ["CHECKED_VLLM_VERSIONS", "GUARDED", "install", "SharedWeightsError"]

logger = logging.getLogger("vllm.dedup.guards")  # under "vllm", as in loader.py

CHECKED_VLLM_VERSIONS = ("0.32.0",)

# (module, class, method, what the operation does to weights)
GUARDED = (
    ("vllm.v1.worker.gpu_worker", "Worker", "sleep", "sleep mode offloads or discards the weights"),
    ("vllm.v1.worker.cpu_worker", "CPUWorker", "sleep", "sleep mode offloads or discards the weights"),
    ("vllm.v1.worker.gpu_worker", "Worker", "reload_weights", "weight reload writes new weights in place"),
    ("vllm.v1.worker.gpu_worker", "Worker", "start_weight_update", "weight updates write weights in place"),
    ("vllm.v1.worker.gpu_worker", "Worker", "update_weights", "weight updates write weights in place"),
    ("vllm.v1.worker.gpu_worker", "Worker", "reset_weights", "weight reset zeroes the weights in place"),
)


class SharedWeightsError(RuntimeError):
    """An operation that writes weights in place was asked of an engine with shared weights."""


def _guard(method, name: str, why: str):
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        shared = shared_bytes_in_process()
        if shared:
            raise SharedWeightsError(
                f"vllm-dedup: {name} is refused: {why}, and this engine maps {shared / 1e6:.1f} MB of "
                "weights shared read-only with other engines. Start this engine with another "
                "--load-format (e.g. auto) to use it."
            )
        return method(self, *args, **kwargs)

    guarded.__vllm_dedup_guard__ = True
    return guarded


def install() -> list[str]:
    """Wrap every method in `GUARDED` that exists.  Idempotent.  Returns the ones wrapped now."""
    import importlib

    import vllm

    if vllm.__version__ not in CHECKED_VLLM_VERSIONS:
        logger.warning(
            "vllm-dedup: guards were checked against vLLM %s, this is %s",
            ", ".join(CHECKED_VLLM_VERSIONS), vllm.__version__,
        )
    wrapped = []
    for module_name, cls_name, name, why in GUARDED:
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            logger.warning("vllm-dedup: %s.%s not found; its guard is skipped", module_name, cls_name)
            continue
        method = cls.__dict__.get(name)
        if method is None:
            if not any(name in base.__dict__ for base in cls.__mro__):
                logger.warning("vllm-dedup: %s.%s has no %s; its guard is skipped", module_name, cls_name, name)
            continue
        if getattr(method, "__vllm_dedup_guard__", False):
            continue
        setattr(cls, name, _guard(method, name, why))
        wrapped.append(f"{cls_name}.{name}")
    return wrapped
