"""Ray Serve deployments of several models that share weights on one device (per node).

A few lines deploy several fine-tunes of one model family behind one OpenAI-compatible route
(Ray Serve LLM's ``build_openai_app``; the request's ``model`` field picks the deployment)::

    import ray
    from ray import serve
    from vllm_dedup.serve import build_dedup_app

    ray.init()
    app = build_dedup_app({"base": "/models/base", "chat": "/models/chat-ft"},
                          engine_kwargs={"max_model_len": 4096})
    serve.run(app)

What the helpers add to plain Ray Serve LLM configs:

- engine arguments: ``load_format="dedup"`` and its ``model_loader_extra_config``
  (`config.DedupConfig`), with ``registry_address`` set to the current Ray cluster, so every
  replica's engine uses the cluster's registry actor;
- the registry actor of each node the replicas may use, created before any replica starts
  (`ensure_registry`), so that replicas find it on their node's socket instead of each
  connecting to Ray to look for it;
- placement: by default every replica's bundle is pinned to the driver's node (Ray's
  ``ray.io/node-id`` label, exact even when several nodes share an IP address), or to a node
  given by id, or left to Ray (``node=None``); on GPUs each takes ``1 / replicas_per_device``
  of a GPU, so the replicas sit on one device;
- the registry's environment (``VLLM_DEDUP_*`` variables of this process, less the node-local
  ones of `registry.nodes.NODE_ENV`) in the replicas' ``runtime_env``, so that they look for
  the registry where it is.

Sharing stays within a node: a replica's engine uses its own node's registry
(`registry.nodes`), so replicas of one model on two nodes hold one copy per node.

Requires ``ray[serve]`` and ``pyarrow`` (what ``ray.serve.llm`` imports) and vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .registry.nodes import ray_node, registry_env
from .registry.wire import DEFAULT_NAMESPACE

__all__ = ["DRIVER_NODE", "build_dedup_app", "dedup_engine_kwargs", "dedup_llm_config", "ensure_registry"]

DRIVER_NODE = "driver"  # the ``node`` that means: the node this process (the driver) runs on
NODE_ID_LABEL = "ray.io/node-id"  # Ray's default label of every node: its node id


def ensure_registry(namespace: str = DEFAULT_NAMESPACE, node_id: str | None = None,
                    keep_warm_s: float = 0.0) -> Path:
    """Create the registry actor of node ``node_id`` (default: this driver's node) in the current
    Ray cluster, or find it; returns its socket path.  Call after ``ray.init``.  ``keep_warm_s``
    (seconds; `config.DedupConfig.keep_warm_s`) is the setting of an actor this call creates:
    one running already keeps its own, as does a standalone daemon already serving the node's
    socket, whose socket is returned then (`registry.ray_actor.ensure_actor`).

    Raises:
        RuntimeError: Ray is not initialized in this process.
        ValueError: ``keep_warm_s`` is not a finite number >= 0 (the actor is the node's, for
            every engine: ``inf`` made its stats unsendable, a string broke every engine's exit).
        RegistryUnavailable: the actor could not be created, or ``node_id`` is no alive node.
    """
    import ray

    from .config import is_finite_number
    from .registry.ray_actor import ensure_actor

    if not (is_finite_number(keep_warm_s) and keep_warm_s >= 0):
        raise ValueError(f"ensure_registry: keep_warm_s must be a finite number >= 0 (seconds), got {keep_warm_s!r}")
    if not ray.is_initialized():
        raise RuntimeError("vllm_dedup.serve.ensure_registry needs a Ray connection: call ray.init() first")
    return Path(ensure_actor(namespace, keep_warm_s=keep_warm_s, node_id=node_id))


def dedup_engine_kwargs(engine_kwargs: Mapping | None = None, loader_config: Mapping | None = None) -> dict:
    """vLLM engine arguments (``AsyncEngineArgs`` fields) that load with the dedup loader.

    Args:
        engine_kwargs: the engine's other arguments (``max_model_len``, ``dtype``, ...).
        loader_config: `config.DedupConfig` keys (``share_group``, ``min_tensor_bytes``, ...).
            ``registry_address`` defaults to the Ray cluster this process is connected to.

    Raises:
        ValueError: an unknown loader config key (the message lists the valid ones), an inner
            loader vLLM cannot make (``inner_load_format``, ``inner_extra_config``), or
            ``engine_kwargs`` sets ``load_format`` or ``model_loader_extra_config``, which this
            sets (the loader's keys go in ``loader_config``).
    """

    if clash := sorted({"load_format", "model_loader_extra_config"} & set(engine_kwargs or {})):
        raise ValueError(f"engine_kwargs sets {' and '.join(clash)}, which the dedup loader sets: pass the "
                         "loader's keys as loader_config (e.g. loader_config={'share_group': 'x'})")
    loader = dict(loader_config or {})
    if "registry_address" not in loader:
        address = _ray_address()
        if address:
            loader["registry_address"] = address
    # Fail here, in the driver, not in every replica: the loader checks its keys, and vLLM the
    # inner loader's (inner_load_format, inner_extra_config).
    from vllm.config.load import LoadConfig

    from .engine.loader import DedupModelLoader

    DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config=loader))
    return {**dict(engine_kwargs or {}), "load_format": "dedup", "model_loader_extra_config": loader}


def dedup_llm_config(model_id: str, model_source: str | os.PathLike, *, dedup: bool = True,
                     engine_kwargs: Mapping | None = None, loader_config: Mapping | None = None,
                     replicas_per_device: int = 1, device: str = "cpu", node: str | None = DRIVER_NODE,
                     **llm_config):
    """A ``ray.serve.llm.LLMConfig`` for one model, placed to share one device with others.

    Args:
        model_id: the name clients put in the request's ``model`` field.
        model_source: a model folder or a Hugging Face id.
        dedup: use the dedup loader (``False`` gives the same deployment with vLLM's default
            loader, for comparison).
        engine_kwargs: other vLLM engine arguments.
        loader_config: `config.DedupConfig` keys.
        replicas_per_device: how many engines share one GPU (each bundle takes that fraction
            of a GPU; ``gpu_memory_utilization`` defaults to 0.9 divided among them).  An
            engine gets one bundle per worker (tensor times pipeline parallel size); Ray may
            place fractional bundles of one engine on one GPU, so for tensor parallelism
            across shared GPUs pass a ``placement_group_config`` of your own (not tried on a
            GPU here).
        device: ``"cpu"`` (vLLM's CPU backend) or ``"gpu"``.
        node: where the replicas run: `DRIVER_NODE` (the default: this process's node; not
            pinned when this process is not connected to Ray), a Ray node id (hex), or None
            (wherever Ray finds room: replicas on several nodes hold one copy per node).
            Pinning uses the deployment's ``placement_group_bundle_label_selector``, unless
            ``deployment_config`` sets one.
        llm_config: further ``LLMConfig`` fields (``deployment_config``, ``runtime_env``, ...);
            a ``placement_group_config`` or ``accelerator_config`` given here replaces the one
            made from ``device`` and ``replicas_per_device``.

    Raises:
        ValueError: bad ``device`` or ``replicas_per_device``, an unknown loader config key, a
            ``node`` that is no alive Ray node or lacks the bundle's resources (a driver's node
            without a GPU), or ``engine_kwargs`` that set the load format or its config
            (`dedup_engine_kwargs`).
        RuntimeError: ``node`` is a node id but this process is not connected to Ray.
    """
    from ray.serve.llm import LLMConfig

    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
    if replicas_per_device < 1:
        raise ValueError(f"replicas_per_device must be >= 1, got {replicas_per_device}")
    kwargs = dict(engine_kwargs or {})
    bundle = {"CPU": 1}
    if device == "gpu":
        bundle["GPU"] = 1 / replicas_per_device
        kwargs.setdefault("gpu_memory_utilization", round(0.9 / replicas_per_device, 4))
    if (node_id := _pinned_node(node)) is not None:
        if "placement_group_config" not in llm_config:
            _check_node_has(node_id, bundle, node)
        deployment = dict(llm_config.pop("deployment_config", None) or {})
        deployment.setdefault("placement_group_bundle_label_selector", [{NODE_ID_LABEL: node_id}])
        llm_config["deployment_config"] = deployment
    if dedup:
        kwargs = dedup_engine_kwargs(kwargs, loader_config)
    runtime_env = dict(llm_config.pop("runtime_env", None) or {})
    # The node's own socket directory is not the replicas': each finds its node (registry.nodes).
    runtime_env["env_vars"] = {**registry_env(), **runtime_env.get("env_vars", {})}
    # One bundle per worker: Ray Serve repeats it tensor_parallel_size * pipeline_parallel_size times.
    llm_config.setdefault("placement_group_config", {"bundle_per_worker": bundle})
    llm_config.setdefault("accelerator_config", {"kind": device})
    return LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": str(model_source)},
        engine_kwargs=kwargs,
        runtime_env=runtime_env,
        **llm_config,
    )


def build_dedup_app(models: Mapping[str, str | os.PathLike], *, dedup: bool = True, device: str = "cpu",
                    engine_kwargs: Mapping | None = None, loader_config: Mapping | None = None,
                    namespace: str | None = None, node: str | None = DRIVER_NODE, **llm_config):
    """One Ray Serve application: a deployment per model, one OpenAI-compatible route.

    Connects to Ray (``ray.init()``) if this process is not connected yet and, with ``dedup``
    (and no ``registry_address`` in ``loader_config`` other than this cluster's), creates the
    registry actors before returning: on the node the replicas are pinned to, or
    with ``node=None`` on every alive node (a node that joins later gets its registry from its
    first engine).

    Args:
        models: model id -> model folder or Hugging Face id.
        dedup, device, engine_kwargs, loader_config, node, llm_config: see `dedup_llm_config`
            (``replicas_per_device`` is the number of models).
        namespace: the registry namespace (``loader_config["registry_namespace"]``).

    Returns:
        the application for ``serve.run``.

    Raises:
        ValueError: see `dedup_llm_config`.
        RegistryUnavailable: a registry actor could not be created.
    """
    import ray
    from ray.serve.llm import build_openai_app

    from .config import DedupConfig

    if not ray.is_initialized():
        ray.init()
    loader = dict(loader_config or {})
    if namespace is not None:
        loader["registry_namespace"] = namespace
    configs = [
        dedup_llm_config(model_id, source, dedup=dedup, engine_kwargs=engine_kwargs, loader_config=loader,
                         replicas_per_device=len(models), device=device, node=node, **llm_config)
        for model_id, source in models.items()
    ]  # first: they check ``node``
    # Engines told to use the standalone daemon ("local") or another cluster's registry do not
    # look for this cluster's actors: none is made for them.
    if dedup and loader.get("registry_address") in (None, "auto", _ray_address()):
        nodes = [_pinned_node(node)] if node is not None else [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        keep_warm_s = DedupConfig.from_extra_config(loader).keep_warm_s
        for node_id in nodes:
            ensure_registry(loader.get("registry_namespace", DEFAULT_NAMESPACE), node_id, keep_warm_s)
    return build_openai_app({"llm_configs": configs})


def _ray_address() -> str | None:
    import ray

    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


def _check_node_has(node_id: str, bundle: dict[str, float], node: str) -> None:
    """Refuse to pin replicas to a node whose resources (Ray's node table) hold no ``bundle``:
    Serve would wait for room there for ever, saying nothing.

    Raises:
        ValueError: the node lacks one of the bundle's resources (the message says which).
    """
    import ray

    have = next((n.get("Resources", {}) for n in ray.nodes() if n.get("NodeID") == node_id), {})
    lacking = [k for k, v in bundle.items() if have.get(k, 0) < v]
    if lacking:
        named = "this driver's node" if node == DRIVER_NODE else "node"
        raise ValueError(f"{named} {node_id[:16]} has no {' or '.join(lacking)} in Ray's node table, so replicas "
                         "pinned there would never start: pass node=None (wherever Ray finds room) or the id of a "
                         "node that has it")


def _pinned_node(node: str | None) -> str | None:
    """The id of the node ``node`` names (see `dedup_llm_config`), checked against Ray's node
    table; None when the replicas are not to be pinned.

    Raises:
        ValueError: ``node`` is no alive node's id.
        RuntimeError: ``node`` is an id but this process is not connected to Ray.
    """
    import ray

    if node is None or (node == DRIVER_NODE and not ray.is_initialized()):
        return None
    return ray_node(None if node == DRIVER_NODE else node).node_id
