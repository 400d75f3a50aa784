"""A checkpoint is untrusted input (README, "Trust"): a checkpoint crafted so that its tensors'
content keys collide with another checkpoint's never gets its bytes into the other's engine,
nor the other's into its own.

The collision is made with a test-only weakened hash (`share.FORCE_COLLISIONS_ENV`: every
content key's digest zeroed, so every tensor of a dtype and shape claims the same key), and the
crafted checkpoint is a full fine-tune of SmolLM2 (`harness.variants`, ``retrained``): same
names, dtypes and shapes, other bytes.  What keeps the engines apart: the exact compare before a
tensor is swapped, and on the fast path the BLAKE3 source keys (not weakened: a recipe of one
checkpoint never matches the other) and the segments a recipe names (a key claimed by another
segment is not mapped).  The oracle checks the final tensors themselves; a control run with
``verify: false``, which trusts keys alone, shows that the check would see a wrong weight.
"""

from __future__ import annotations

from harness.engines import EngineProcess
from harness.oracle import differences
from harness.references import engine_reference
from harness.variants import cached_variant
from vllm_dedup.engine.share import FORCE_COLLISIONS_ENV

WEAK = {FORCE_COLLISIONS_ENV: "1"}


def test_a_checkpoint_crafted_to_collide_is_never_mapped_into_another_engine(smollm2, registry):
    def digests_of(model, extra: dict | None = None, env: dict | None = None) -> tuple[dict, dict]:
        """(final tensors, load report) of one dedup engine, stopped after."""
        with EngineProcess(model, "dedup", extra=extra, env=env) as engine:
            engine.wait_ready()
            (tensors,) = engine.final_tensors()
            return tensors, registry.engine_loads()[engine.pid]

    crafted = cached_variant(smollm2, "retrained")
    reference = {"victim": engine_reference(smollm2)["tensors"][0], "crafted": engine_reference(crafted)["tensors"][0]}
    assert differences(reference["victim"], reference["crafted"])  # other bytes, same layout

    # The victim loads first and leaves a recipe; it exits, and its segments go with it.
    victim, load = digests_of(smollm2, env=WEAK)
    assert load["load_path"] == "none" and not differences(victim, reference["victim"])
    # The crafted checkpoint finds the victim's recipe and colliding keys: it loads its own bytes,
    # maps none of the victim's, and publishes segments that claim the victim's keys.
    with EngineProcess(crafted, "dedup", env=WEAK) as attacker:
        attacker.wait_ready()
        (tensors,) = attacker.final_tensors()
        assert not differences(tensors, reference["crafted"]), differences(tensors, reference["crafted"])[:5]
        assert registry.engine_loads()[attacker.pid]["published_bytes"] > 0
        # The victim again: its recipe names segments that are gone; keys claimed by the crafted
        # checkpoint's segments are compared and refused.
        again, load = digests_of(smollm2, env=WEAK)
        assert not differences(again, reference["victim"]), differences(again, reference["victim"])[:5]
        assert load["collisions"] > 0, load
        # Control: trusting keys alone (verify: false) maps the crafted bytes, and the oracle sees it.
        trusting, _ = digests_of(smollm2, {"verify": False}, env=WEAK)
        assert differences(trusting, reference["victim"])
