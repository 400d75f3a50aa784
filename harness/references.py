"""References: what a dedup engine's answers and final tensors must equal.  Not shipped.

The reference of a dedup engine is a plain load with the same options (`harness.oracle`).  Today
that is a dedup engine alone in a share group of its own with ``fast_path: false`` and
``in_place: false``: it maps nothing from anyone, and loads into private memory as vLLM does, with the dedup options that change the final
tensors (``cpu_linear``: with ``plain`` linear weights stay tensors on the CPU backend, where a
plain ``auto`` engine holds packed oneDNN weights outside its parameters).  With the default
``cpu_linear="packed"`` a dedup engine's tensors and packed weights are an ``auto`` engine's
(tests/e2e/test_packed_linear.py compares them with one); the reference stays one mode for all
options.  `REFERENCE_OPTIONS` is the one place that says so; change it here.

A reference engine runs with a registry of its own (a private runtime dir, shut down after), so
it never touches the registry of the engines it is the reference for.

Answers are made the way they are asked for: a dedup ``vllm serve`` soak sends one request at a
time, so its reference is a ``vllm serve`` asked one prompt per request (`serve_reference`).  On
CPUs with AVX-512 BF16 a greedy answer depends on what it is batched with.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

from vllm_dedup.registry.client import shutdown_registry
from vllm_dedup.registry.wire import DEFAULT_NAMESPACE

from .engines import PROMPTS, EngineProcess, ServeProcess

__all__ = ["REFERENCE_FORMAT", "REFERENCE_OPTIONS", "reference_options", "engine_reference", "serve_reference"]

REFERENCE_FORMAT = "dedup"
# plus a share group of its own (`reference_options`); in_place off, so that the oracle compares
# tensors loaded into segments (`vllm_dedup.engine.in_place`) with tensors loaded into private memory
REFERENCE_OPTIONS = {"fast_path": False, "in_place": False}


def reference_options(extra: dict | None = None) -> dict:
    """The ``model_loader_extra_config`` of a reference for engines loaded with ``extra``."""
    return {**(extra or {}), **REFERENCE_OPTIONS, "share_group": f"reference-{uuid.uuid4().hex[:12]}"}


class _PrivateRegistry:
    """A runtime dir of its own for one reference engine (its registry is shut down after)."""

    def __enter__(self) -> dict:
        self.dir = Path(tempfile.mkdtemp(prefix="vllm-dedup-ref-"))
        return {"VLLM_DEDUP_RUNTIME_DIR": str(self.dir / "run")}

    def __exit__(self, *exc) -> None:
        shutdown_registry(self.dir / "run" / f"{DEFAULT_NAMESPACE}.sock")  # `wire.socket_path` there
        shutil.rmtree(self.dir, ignore_errors=True)


def engine_reference(model, extra: dict | None = None, prompts: list[str] = PROMPTS, core: int | None = None,
                     dtype: str = "bfloat16") -> dict:
    """The reference of dedup ``LLM()`` engines of ``model`` loaded with ``extra``:
    ``{"ids", "texts"}`` (greedy, the prompts batched as `EngineProcess.complete` does) and
    ``"tensors"`` (`EngineProcess.final_tensors`)."""
    with _PrivateRegistry() as env:
        with EngineProcess(model, REFERENCE_FORMAT, reference_options(extra), env=env, core=core, dtype=dtype) as ref:
            ref.wait_ready(600)
            out = ref.complete(prompts)
            out["tensors"] = ref.final_tensors()
    return out


def serve_reference(model, log: Path, extra: dict | None = None, prompts: list[str] = PROMPTS,
                    core: int | None = None, started: list | None = None) -> dict:
    """The reference of dedup ``vllm serve`` engines of ``model`` loaded with ``extra``, asked one
    prompt per request: ``{"texts": [...], "tensors": [per worker, name -> digest]}``.

    ``started``: a list the server is appended to while it runs (so that a caller interrupted
    meanwhile can stop it)."""
    with _PrivateRegistry() as env:
        server = ServeProcess(model, REFERENCE_FORMAT, log, extra_config=reference_options(extra), core=core, env=env)
        if started is not None:
            started.append(server)
        try:
            server.wait_ready(600)
            texts = [server.complete([p])[0] for p in prompts]  # one prompt per request, as a soak asks
            tensors = server.final_tensors()
        finally:
            server.stop()
            if started is not None:
                started.remove(server)
    return {"texts": texts, "tensors": tensors}
