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
