"""The plugin's wrappers around vLLM's Worker methods, installed once per process (`install`).

vLLM's ``worker_extension_cls`` cannot override Worker methods, so the plugin wraps them.  Two
kinds, both reading this process's `session.EngineSession`:

- **guards**: refuse the operations that would write into shared weights (sleep mode, weight
  reload, weight updates, weight reset, expert rebalancing).  A shared tensor is mapped
  read-only in several engines: an in-place write would fault (host segments are sealed; on a
  GPU, an illegal-address error that poisons the CUDA context, which no fallback can catch) or,
  on a device without read-only mappings, silently change every other engine's model.  Each
  guard refuses with a clear error while this engine holds tensors in segments (its model or
  its drafter's: `shared_weight_bytes`) and passes through otherwise.  An engine whose configuration says it will write its weights in place
  (`vllm_facts.private_reason`: EPLB, weight offloading, RLHF weight transfer, sleep mode) never shares
  them in the first place: the loader keeps them private.  Where the engine core stops serving
  before it reaches the workers (``EngineCore.sleep`` pauses the scheduler first), it asks the
  workers up front (`vllm_facts.GUARDED_BEFORE_PAUSING`), so a refused call leaves the engine
  serving as before; and where it calls a guarded method on every worker at once
  (``EngineCore.collective_rpc``, `vllm_facts.GUARDED_RPC`), it asks them all before any
  writes, so that no rank writes while another refuses.
- **start-up hooks** (GPU accounting, `session.py`): after ``Worker.load_model`` the engine's
  budget is corrected by the bytes mapped beyond the prediction; after
  ``Worker.compile_or_warm_up_model`` (KV cache allocated) the start-up lock is given back,
  even when warm-up fails, and so it is when any start-up step after the lock was taken fails:
  ``init_device`` (which takes it, then may find too little free memory), the load or its
  correction, ``determine_available_memory`` and ``initialize_from_config``, and the engine
  core's own steps between them (``EngineCore.__init__``: its KV cache check) (a process that
  lives on, an engine in the user's own process, would otherwise keep it from every other
  engine of the GPU for ``startup_lock_timeout_s``).

Note [hooks on import]
    The plugin loads in every process vLLM starts, and many import few of these modules: the API
    server of ``vllm serve`` imports neither worker module, a GPU engine never imports
    ``cpu_worker``.  So each class is wrapped when vLLM imports its module
    (``wrapt.register_post_import_hook``; at once where vLLM has imported it already), and the
    plugin imports none itself.  Importing them made the plugin's load in the API server's
    process 0.48 s instead of 0.24 s (after vLLM's own imports; 2 cores, AVX-512-BF16), and one
    import changes the process: ``vllm.v1.worker.cpu_worker`` imports ``vllm.v1.worker.cpu.shm``
    first, which replaces torch's CUDA events and streams, ``torch.accelerator.synchronize`` and
    ``get_memory_info`` (host memory) for the whole process; on a GPU it would break every
    engine of the process.  A hook runs inside vLLM's import: it never raises.

Each wrapper is tied to the vLLM versions it was checked against (`vllm_facts.CHECKED_VLLM_VERSIONS`); on
another version a method that no longer exists is skipped with a warning, never guessed at.
``patches/`` holds the upstream-vLLM form of the guards, the budget correction and the lock's
release after warm-up: a method whose source already carries the patch's hook
(`vllm_facts.PATCHED_BY`) is not wrapped, so that nothing (the budget correction above all) is
applied twice.  The release after a failed step has no upstream form yet and is always
wrapped (giving the lock back twice is harmless: `session.EngineSession.end_startup` is
idempotent).
"""

from __future__ import annotations

import functools
import importlib
import sys

from ..errors import SharedWeightsError
from ..log import init_logger
from .session import EngineSession
from .vllm_facts import (CHECKED_VLLM_VERSIONS, GUARD_MARKER, GUARDED, GUARDED_BEFORE_PAUSING, GUARDED_RPC,
                         KEEPS_WEIGHTS_PRIVATE, PATCHED_BY)

__all__ = ["STARTUP_HOOKS", "install", "shared_weight_bytes"]

logger = init_logger(__name__)

def _after_load(worker, failed: bool) -> None:
    session = EngineSession.current()
    if failed:
        session.end_startup()
        return
    try:
        session.correct_budget(worker)
    except BaseException:  # the engine stops: nobody else gives the lock back
        session.end_startup()
        raise


def _after_a_step(worker, failed: bool) -> None:
    if failed:  # the engine stops between the lock and the warm-up: nobody else gives it back
        EngineSession.current().end_startup()


# (module, class, method, what runs after it: (worker, whether the method raised) -> None), in
# the order vLLM's start-up calls them
STARTUP_HOOKS = (
    ("vllm.v1.worker.gpu_worker", "Worker", "init_device", _after_a_step),
    ("vllm.v1.worker.gpu_worker", "Worker", "load_model", _after_load),
    ("vllm.v1.worker.gpu_worker", "Worker", "determine_available_memory", _after_a_step),
    ("vllm.v1.worker.gpu_worker", "Worker", "initialize_from_config", _after_a_step),
    ("vllm.v1.worker.gpu_worker", "Worker", "compile_or_warm_up_model",
     lambda worker, failed: EngineSession.current().end_startup()),
    # Around them all: the engine core fails between the workers' steps too (its KV cache
    # check, ``get_kv_cache_configs``: "needs more KV cache than available"), and no worker
    # method sees that (vllm/v1/engine/core.py, ``EngineCore.__init__``).  It matters where
    # the worker shares the engine core's process, which lives on (an engine in the user's own
    # process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); elsewhere this process holds no lock.
    ("vllm.v1.engine.core", "EngineCore", "__init__", _after_a_step),
)

_MARK = "__vllm_dedup_hook__"


def install() -> list[str]:
    """Wrap every method of `GUARDED`, `GUARDED_BEFORE_PAUSING`, `GUARDED_RPC` and `STARTUP_HOOKS` that
    exists, each when vLLM imports its module (Note [hooks on import]).  Idempotent.

    Returns:
        the methods wrapped now, in modules imported already (``"Class.method"``).
    """
    import vllm
    import wrapt

    if vllm.__version__ not in CHECKED_VLLM_VERSIONS:
        logger.warning("worker hooks were checked against vLLM %s, this is %s",
                       ", ".join(CHECKED_VLLM_VERSIONS), vllm.__version__)
    wrapped = []
    for module_name, hooks in _hooks_by_module().items():
        if module_name in sys.modules:
            wrapped += _on_import(sys.modules[module_name], hooks)
        else:  # imported meanwhile: wrapt runs the hook at once (`_on_import` waits for that import)
            wrapt.register_post_import_hook(functools.partial(_on_import, hooks=hooks), module_name)
    return wrapped


def _hooks_by_module() -> dict[str, list[tuple]]:
    """module -> [(class, method, make the wrapper from the method, patches/' marker or None)]."""
    hooks: dict[str, list[tuple]] = {}
    for module_name, cls_name, name, why in GUARDED:
        hooks.setdefault(module_name, []).append(
            (cls_name, name, functools.partial(_guard, name=name, why=why), GUARD_MARKER))
    for module_name, cls_name, name, level, why in GUARDED_BEFORE_PAUSING:
        hooks.setdefault(module_name, []).append(
            (cls_name, name, functools.partial(_guard_before_pausing, name=name, from_level=level, why=why), None))
    module_name, cls_name, name = GUARDED_RPC
    whys = {method: why for _, cls, method, why in GUARDED if cls in ("Worker", "CPUWorker")}
    hooks.setdefault(module_name, []).append((cls_name, name, functools.partial(_guard_rpc, whys=whys), None))
    for module_name, cls_name, name, after in STARTUP_HOOKS:
        hooks.setdefault(module_name, []).append(
            (cls_name, name, functools.partial(_run_after, after=after), PATCHED_BY.get((cls_name, name))))
    return hooks


def _on_import(module, hooks: list[tuple]) -> list[str]:
    """Wrap ``hooks``' methods in ``module``, just imported; returns those wrapped.  Never
    raises: it runs inside vLLM's import of ``module``."""
    try:  # an import under way in another thread (wrapt calls a hook registered meanwhile at once): wait for it
        module = importlib.import_module(module.__name__)
    except Exception:  # ours to wrap as it is
        pass
    wrapped = []
    for cls_name, name, make, marker in hooks:
        try:
            if _wrap(module, cls_name, name, make, marker):
                wrapped.append(f"{cls_name}.{name}")
        except Exception as e:
            logger.warning("%s.%s.%s could not be hooked (%s: %s); it runs unguarded",
                           module.__name__, cls_name, name, type(e).__name__, e)
    return wrapped


def _patched(method, marker: str | None) -> bool:
    """Whether ``method``'s source carries ``marker`` (patches/ applied to this vLLM)."""
    import inspect

    if marker is None:
        return False
    try:
        return marker in inspect.getsource(method)
    except (OSError, TypeError):  # no source (compiled): assume the unpatched form
        return False


def _wrap(module, cls_name: str, name: str, make, marker: str | None) -> bool:
    """Replace ``module.cls_name.name`` by ``make(method)`` unless missing, already wrapped or
    already hooked by patches/ (its source holds ``marker``)."""
    cls = getattr(module, cls_name, None)
    if cls is None:
        logger.warning("%s has no %s; its %s hook is skipped", module.__name__, cls_name, name)
        return False
    method = cls.__dict__.get(name)
    if method is None:
        if not any(name in base.__dict__ for base in cls.__mro__):
            logger.warning("%s.%s has no %s; its hook is skipped", module.__name__, cls_name, name)
        return False
    if getattr(method, _MARK, False):
        return False
    if _patched(method, marker):
        logger.debug("%s.%s carries patches/' hook; not wrapped", cls_name, name)
        return False
    wrapper = make(method)
    setattr(wrapper, _MARK, True)
    setattr(cls, name, wrapper)
    return True


def _guard(method, name: str, why: str):
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        held = shared_weight_bytes(self)
        if held:
            raise _refusal(name, why, held)
        return method(self, *args, **kwargs)

    return guarded


def _guard_before_pausing(method, name: str, from_level: int, why: str):
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        level = kwargs.get("level", args[0] if args else from_level)
        if level >= from_level:
            held = _workers_shared_weight_bytes(self)
            if held:
                raise _refusal(name, why, held)
        return method(self, *args, **kwargs)

    return guarded


def _guard_rpc(method, whys: dict[str, str]):
    """``EngineCore.collective_rpc`` asking every worker before it calls one of ``whys``'
    methods (method name -> what it does to weights) on all of them (`vllm_facts.GUARDED_RPC`)."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        name = kwargs.get("method", args[0] if args else None)
        if isinstance(name, str) and name in whys:
            held = _workers_shared_weight_bytes(self)
            if held:
                raise _refusal(name, whys[name], held)
        return method(self, *args, **kwargs)

    return guarded


def shared_weight_bytes(worker=None) -> int:
    """Bytes of weights ``worker``'s engine holds in segments (read-only, shared or publishable):
    its model's and its drafter's (`session.EngineSession.bytes_in_segments`), not those of
    another engine of this process (an ``auto`` engine beside a ``dedup`` one writes its own
    weights freely).  Where the worker's model cannot be found (none loaded yet, a worker of
    another shape, ``EplbState``), every engine's of this process: refusing is safe, a write
    into a segment is not.  Run in each worker by the engine core (``collective_rpc``: a module
    function travels by name)."""
    session = EngineSession.current()
    models = _models_of(worker)
    return session.segment_bytes if models is None else session.bytes_in_segments(models)


def _models_of(worker) -> list | None:
    """The models ``worker`` runs (vLLM 0.32: ``model_runner.get_model()`` and
    ``get_draft_model()``, in both GPU runners, the drafter's at ``drafter.model`` or
    ``speculator.model``; ``drafter.model`` where a runner has no ``get_draft_model``), or
    None where it cannot show them all."""
    runner = getattr(worker, "model_runner", None)
    try:
        model = runner.get_model()
        drafter = (runner.get_draft_model() if hasattr(runner, "get_draft_model")
                   else getattr(getattr(runner, "drafter", None), "model", None))
    except Exception:  # no runner, or no model loaded yet ("Cannot get model before ...")
        return None
    if not hasattr(model, "modules"):
        return None
    return [model] + ([drafter] if hasattr(drafter, "modules") else [])


def _workers_shared_weight_bytes(engine_core) -> int:
    """Bytes of weights ``engine_core``'s workers hold in segments, all together; 0 where they
    cannot be asked (each worker's own guard still refuses then)."""
    try:
        return sum(engine_core.model_executor.collective_rpc(shared_weight_bytes))
    except Exception as e:  # never the reason a plain engine cannot sleep
        logger.warning("the workers could not be asked whether they share weights (%s: %s)",
                       type(e).__name__, e)
        return 0


def _refusal(name: str, why: str, held: int) -> SharedWeightsError:
    setting = KEEPS_WEIGHTS_PRIVATE.get(name)
    way = (f"Start this engine with {setting} (its weights then stay private) or with another --load-format "
           "(e.g. auto) to use it." if setting else
           "Start this engine with another --load-format (e.g. auto) to use it.")
    return SharedWeightsError(
        f"vllm-dedup: {name} is refused: {why}, and this engine maps {held / 1e6:.1f} MB of weights shared "
        f"read-only with other engines. {way}"
    )


def _run_after(method, after):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            result = method(self, *args, **kwargs)
        except BaseException:
            try:
                after(self, True)
            except Exception:  # the method's own error is the one to see
                logger.warning("after %s failed", method.__name__, exc_info=True)
            raise
        after(self, False)
        return result

    return wrapper
