"""vLLM plugin entry point (group ``vllm.general_plugins``).

vLLM calls `register` once in every process it starts (front end, engine core, each worker).
The load format must be known in the worker, where the loader is built; vLLM's CLI accepts any
``--load-format`` string and only the worker checks it (docs/architecture.md, "vLLM facts").
"""

from __future__ import annotations

LOAD_FORMAT = "dedup"


def register() -> None:
    """Register `DedupModelLoader` as load format ``dedup`` and install the Worker wrappers
    (`engine.worker_hooks.install`: guards and the GPU start-up hooks).  In a process on a Ray
    node (a Ray Serve replica), also leave the node in the environment for the engine processes
    vLLM starts next (`registry.nodes.export_node`).  Idempotent."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, register_model_loader

    from .engine import worker_hooks
    from .engine.loader import DedupModelLoader
    from .registry.nodes import export_node

    export_node()

    # register_model_loader warns when a format is registered twice; plugins may load more
    # than once per process (LLM() in a process that already imported them).
    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not DedupModelLoader:
        register_model_loader(LOAD_FORMAT)(DedupModelLoader)
    worker_hooks.install()
