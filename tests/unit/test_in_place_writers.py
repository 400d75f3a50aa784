"""In-place writers of weights in vLLM 0.32 (docs/architecture.md, "In-place writers"): an
engine configured for one keeps its weights private; the operations themselves are refused
while an engine holds weights in segments."""

from __future__ import annotations

import pytest
from vllm.config import VllmConfig
from vllm.config.load import LoadConfig

from vllm_dedup.engine import vllm_facts, worker_hooks
from vllm_dedup.engine.loader import DedupModelLoader
from vllm_dedup.engine.session import EngineSession
from vllm_dedup.errors import SharedWeightsError


def eplb(c):
    c.parallel_config.enable_eplb = True


def uva_offload(c):
    c.offload_config.uva.cpu_offload_gb = 4


def prefetch_offload(c):
    c.offload_config.prefetch.offload_group_size = 8


def weight_transfer(c):
    from vllm.config.weight_transfer import WeightTransferConfig

    c.weight_transfer_config = WeightTransferConfig()


@pytest.mark.parametrize("configure, words", [(eplb, "move_from_buffer"), (uva_offload, "offloading"),
                                              (prefetch_offload, "offloading"), (weight_transfer, "RLHF")],
                         ids=["eplb", "uva-offload", "prefetch-offload", "weight-transfer"])
def test_an_engine_configured_to_write_its_weights_keeps_them_private(configure, words, caplog):
    config = VllmConfig()
    assert vllm_facts.private_reason(config) is None
    configure(config)
    assert words in vllm_facts.private_reason(config)
    loader = DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config={"on_registry_error": "fail"}))
    # No registry is reached, no device is named: the load goes the plain way, with a warning
    # (even with on_registry_error="fail": nothing failed, the configuration asked for it).
    assert loader._context(config, None, "") is None
    assert any("stay private" in r.getMessage() and words in r.getMessage() for r in caplog.records)


def test_sleep_mode_keeps_weights_private():
    class Model:  # the one field private_reason reads of vLLM's ModelConfig (which needs a checkpoint)
        enable_sleep_mode = True

    config = VllmConfig()
    config.model_config = Model()
    assert "sleep mode" in vllm_facts.private_reason(config)


def test_expert_rebalancing_and_draft_weight_updates_are_refused_while_weights_are_shared(monkeypatch):
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.v1.worker.gpu_worker import Worker

    worker_hooks.install()
    for method in (EplbState.rearrange, Worker.start_draft_weight_update):
        assert getattr(method, "__vllm_dedup_hook__", False), method
    session = EngineSession()
    monkeypatch.setattr(EngineSession, "_current", session)
    session.segment_bytes = 64 << 20
    with pytest.raises(SharedWeightsError, match="rearrange is refused: expert load balancing"):
        EplbState.rearrange(object())
    with pytest.raises(SharedWeightsError, match="start_draft_weight_update is refused"):
        Worker.start_draft_weight_update(object())
    session.segment_bytes = 0  # nothing shared: the call reaches vLLM (which wants a MoE model's state)
    with pytest.raises(AssertionError, match="expert parallel group is not initialized"):
        EplbState.rearrange(object())


def test_the_guards_refuse_only_the_engine_whose_model_maps_shared_weights(monkeypatch):
    """Two engines in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a ``dedup`` one that
    maps shared weights, and an ``auto`` one beside it, which writes its own weights freely.
    Only the first is refused; a worker whose model cannot be found counts every engine's (a
    refusal is safe, a write into a segment is not); once the dedup model is gone, none is."""
    import gc
    from types import SimpleNamespace

    from torch import nn
    from vllm.v1.worker.gpu_worker import Worker

    worker_hooks.install()
    session = EngineSession()
    monkeypatch.setattr(EngineSession, "_current", session)
    lease = SimpleNamespace(close=lambda: None)
    shared, own, drafter = nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2), nn.Linear(2, 2)
    session.hold(lease, 64 << 20, 64 << 20, shared)
    session.hold(lease, 1 << 20, 0, drafter)

    def worker(model, drafter=None):
        runner = SimpleNamespace(get_model=lambda: model, drafter=SimpleNamespace(model=drafter))
        return SimpleNamespace(model_runner=runner)

    dedup, auto = worker(shared, drafter), worker(own)
    assert worker_hooks.shared_weight_bytes(dedup) == 65 << 20  # the drafter's too
    v2 = SimpleNamespace(get_model=lambda: own, get_draft_model=lambda held=drafter: held)  # vLLM's V2 GPU runner
    assert worker_hooks.shared_weight_bytes(SimpleNamespace(model_runner=v2)) == 1 << 20
    assert worker_hooks.shared_weight_bytes(worker(nn.Sequential(shared))) == 64 << 20  # a wrapper of it
    assert worker_hooks.shared_weight_bytes(auto) == 0
    assert worker_hooks.shared_weight_bytes(SimpleNamespace()) == 65 << 20  # no model to show: all of them
    with pytest.raises(SharedWeightsError, match="reload_weights is refused"):
        Worker.reload_weights(dedup)
    with pytest.raises(SharedWeightsError, match="with --enable-sleep-mode .its weights then stay private"):
        Worker.sleep(dedup)  # the refusal names the setting that makes the operation work
    with pytest.raises(AttributeError):  # past the guard: vLLM's own method, on a stand-in worker
        Worker.reload_weights(auto)
    del dedup, shared, drafter, v2
    gc.collect()
    assert session.segment_bytes == 0 and worker_hooks.shared_weight_bytes(SimpleNamespace()) == 0
