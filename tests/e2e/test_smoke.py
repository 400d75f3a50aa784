"""The fast suite's one real engine (`bash tests/run.sh --fast`): a dedup vLLM engine of SmolLM2
on the CPU backend loads through the plugin, publishes its weights into segments, answers,
refuses an in-place write into them, and leaves nothing behind.  The other end-to-end tests
check every answer and final tensor against plain references; this one is the quick check
that the plugin, the registry and vLLM still meet."""

from __future__ import annotations

import pytest

from harness.engines import PROMPTS, EngineProcess
from harness.procs import memfd_holders


@pytest.mark.smoke
def test_one_dedup_engine_publishes_answers_and_leaves_nothing(smollm2, registry):
    with EngineProcess(smollm2, "dedup", graceful_exit=True) as engine:
        engine.wait_ready()
        ids = engine.generate(max_tokens=8)
        assert len(ids) == len(PROMPTS) and all(len(i) == 8 for i in ids)
        load = registry.engine_loads()[engine.pid]
        assert load["load_path"] == "none" and load["collisions"] == 0
        # It started the registry and connected once it needed it: no recipe asked of an empty
        # registry (Note [a lease on a registry still starting] in vllm_dedup/registry/lease.py).
        assert "loading from the checkpoint: no recipe yet: this engine started the registry" in engine.log()
        assert load["published_bytes"] > 0.95 * 269e6  # all of SmolLM2's weights but small tensors
        assert registry.stats().engine(engine.pid).segments > 0, "the registry knows no segment of the engine's"
        reply = engine.rpc("reset_weights")
        assert reply.startswith("error") and "reset_weights is refused" in reply, reply
        assert engine.generate(max_tokens=8) == ids  # the refusal changed nothing
        pid = engine.pid
    registry.shutdown()
    assert memfd_holders() == [], f"segments still held after engine {pid} and the registry stopped"
