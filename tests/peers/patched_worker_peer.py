"""One ``Worker.load_model`` of vLLM's GPU worker, as the dedup loader drives it, with the
plugin's worker hooks installed, for tests/unit/test_patches.py.

    python tests/peers/patched_worker_peer.py GPU_WORKER_PY|-

``GPU_WORKER_PY`` is a copy of ``vllm/v1/worker/gpu_worker.py`` with patches/ applied, loaded
in place of the installed one (``-``: the installed one).  The worker is vLLM's class; what it
loads is not a model: its model runner does what `DedupModelLoader.load_model` does to the
engine's session and model (a prediction reported before loading, the bytes really mapped,
the attributes patches/ reads), for a target model and then its drafter (vLLM's runner loads
the drafter inside ``load_model``).  The budget before and after comes from vLLM's own
``request_memory``.  Prints ``OK {wrapped, requested, expected}`` (bytes).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from types import SimpleNamespace

GIB = 1 << 30
TOTAL, FREE, UTILIZATION = 80 * GIB, 60 * GIB, 0.5
PREDICTED, SHARED, DRAFTER_SHARED = 10 * GIB, 12 * GIB, 1 * GIB


class Model:
    """What the hooks read of a model: attributes (and a weak reference, as an nn.Module)."""


def main() -> None:
    if sys.argv[1] != "-":
        spec = importlib.util.spec_from_file_location("vllm.v1.worker.gpu_worker", sys.argv[1])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    from vllm.config import VllmConfig
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.utils import request_memory

    from vllm_dedup.engine import worker_hooks
    from vllm_dedup.engine.session import EngineSession

    wrapped = worker_hooks.install()
    worker = object.__new__(Worker)
    worker.vllm_config = VllmConfig()
    # The memory pools of sleep mode and the allocator's split limit need a GPU: none here.
    worker._maybe_get_memory_pool_context = lambda tag: contextlib.nullcontext()
    worker._scoped_allocator_max_split = lambda **kwargs: contextlib.nullcontext()
    session = EngineSession.current()
    external = session.plan_startup("external", PREDICTED, FREE, TOTAL, UTILIZATION)  # begin_startup's figure
    snapshot = MemorySnapshot(total_memory=TOTAL, free_memory=FREE, device="cpu", auto_measure=False)
    worker.init_snapshot, worker.cache_config = snapshot, SimpleNamespace(gpu_memory_utilization=UTILIZATION)
    worker.external_weight_memory = external  # what the patched init_device keeps
    worker.requested_memory = request_memory(snapshot, worker.cache_config, external)
    model, drafter = Model(), Model()

    def load_model(load_dummy_weights: bool = False) -> None:
        session.hold(object(), SHARED, SHARED)
        session.describe(model)
        session.hold(object(), DRAFTER_SHARED, DRAFTER_SHARED)  # the drafter, loaded after the target
        session.describe(drafter)

    worker.model_runner = SimpleNamespace(load_model=load_model, get_model=lambda: model)
    Worker.load_model(worker)
    print("OK " + json.dumps({"wrapped": wrapped, "requested": worker.requested_memory,
                              "expected": request_memory(snapshot, worker.cache_config, SHARED + DRAFTER_SHARED)}),
          flush=True)


if __name__ == "__main__":
    main()
