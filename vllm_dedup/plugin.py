"""vLLM plugin entry point (group ``vllm.general_plugins``).

vLLM calls `register` once in every process it starts (front end, engine core, each worker),
without catching what it raises: a failure here would stop every engine of the environment,
plain ones too, so it is logged instead.  The load format must be known in the worker, where
the loader is built; vLLM's CLI accepts any ``--load-format`` string and only the worker checks
it (docs/architecture.md, "vLLM facts").
"""

from __future__ import annotations

from .log import init_logger

LOAD_FORMAT = "dedup"

logger = init_logger(__name__)


def register() -> None:
    """Register `DedupModelLoader` as load format ``dedup`` and install the Worker wrappers
    (`engine.worker_hooks.install`: guards and the GPU start-up hooks).  In a process on a Ray
    node (a Ray Serve replica), also leave the node in the environment for the engine processes
    vLLM starts next (`registry.nodes.export_node`).  Idempotent; never raises: where something
    fails, the load format is left unregistered (an engine asking for it is told vLLM does not
    know it) and every other engine runs as without the plugin."""
    try:
        _register()
    except Exception:
        logger.exception("the plugin could not register; --load-format %s is unavailable in this "
                         "process, and other engines run as without it", LOAD_FORMAT)


def _register() -> None:
    from vllm.model_executor import model_loader

    from .engine import worker_hooks
    from .engine.loader import DedupModelLoader
    from .engine.vllm_facts import registered_load_formats
    from .registry.nodes import export_node

    export_node()
    worker_hooks.install()  # first: the load format never goes without its guards
    # register_model_loader warns when a format is registered twice; plugins may load more
    # than once per process (LLM() in a process that already imported them).
    if registered_load_formats().get(LOAD_FORMAT) is not DedupModelLoader:
        model_loader.register_model_loader(LOAD_FORMAT)(DedupModelLoader)
