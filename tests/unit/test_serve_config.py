"""`vllm_dedup.serve.dedup_llm_config`: the ``LLMConfig`` Ray Serve builds a deployment from.

Read back through Ray Serve's own engine config (``LLMConfig.get_engine_config``), which makes
the placement group's bundles the replica's engine starts in; no cluster is needed for that.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (2, 2)])
def test_every_worker_of_an_engine_gets_a_bundle(smollm2, tp, pp):
    """One bundle per worker (``tensor_parallel_size * pipeline_parallel_size``), each the share
    of a device ``replicas_per_device`` gives: a single bundle made vLLM's Ray executor refuse
    an engine of more than one worker."""
    from vllm_dedup.serve import dedup_llm_config

    kwargs = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    cpu = dedup_llm_config("m", smollm2, engine_kwargs=kwargs, node=None)
    assert cpu.get_engine_config().placement_bundles == [{"CPU": 1.0}] * (tp * pp)
    gpu = dedup_llm_config("m", smollm2, engine_kwargs=kwargs, node=None, device="gpu", replicas_per_device=4)
    assert gpu.get_engine_config().placement_bundles == [{"CPU": 1.0, "GPU": 0.25}] * (tp * pp)


def test_a_placement_or_accelerator_given_replaces_the_one_made(smollm2):
    """The user's ``placement_group_config`` and ``accelerator_config`` win (they were passed
    twice to ``LLMConfig``: a TypeError)."""
    from vllm_dedup.serve import dedup_llm_config

    config = dedup_llm_config("m", smollm2, node=None, placement_group_config={"bundles": [{"CPU": 2}]},
                              accelerator_config={"kind": "cpu"})
    assert config.get_engine_config().placement_bundles == [{"CPU": 2.0}]


@pytest.mark.parametrize("keep_warm_s", [float("inf"), float("nan"), -1, "10", None])
def test_ensure_registry_refuses_a_keep_warm_s_no_registry_could_keep(keep_warm_s):
    """The actor it makes is the node's, for every engine: ``inf`` made its stats unsendable
    (JSON has no infinity) and a string broke every engine's exit (``drop_engine``).  Refused
    before Ray is asked anything."""
    from vllm_dedup.serve import ensure_registry

    with pytest.raises(ValueError, match="keep_warm_s must be a finite number >= 0"):
        ensure_registry("t", keep_warm_s=keep_warm_s)


def test_replicas_are_not_pinned_to_a_node_without_the_device_they_need(smollm2, monkeypatch):
    """Pinned by default to the driver's node: where that node has no GPU (a CPU-only head),
    Serve would wait for room there for ever, saying nothing."""
    import ray

    import vllm_dedup.serve as serve

    monkeypatch.setattr(serve, "_pinned_node", lambda node: "f" * 56)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "f" * 56, "Alive": True, "Resources": {"CPU": 16.0}}])
    with pytest.raises(ValueError, match="this driver's node ffffffffffffffff has no GPU in Ray's node table"):
        serve.dedup_llm_config("m", smollm2, device="gpu", loader_config={"registry_address": "local"})
    config = serve.dedup_llm_config("m", smollm2, device="cpu", loader_config={"registry_address": "local"})
    assert config.deployment_config["placement_group_bundle_label_selector"] == [{serve.NODE_ID_LABEL: "f" * 56}]
