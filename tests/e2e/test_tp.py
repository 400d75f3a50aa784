"""Tensor parallelism: every TP rank shares its own shards, and the same rank of two engines of
one model finds identical shards under identical keys.  Real vLLM engines (CPU backend,
``tensor_parallel_size=3``: SmolLM2 has 9 attention heads and 3 KV heads), one worker process
per rank, the real registry daemon."""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.oracle import differences
from harness.references import REFERENCE_FORMAT, reference_options
from harness.procs import PeerProcess, descendants
from helpers import PEERS, wait_for

SCRIPT = PEERS / "tp_engine.py"
TP = 3


class TPEngine(PeerProcess):
    """``tests/peers/tp_engine.py``: a TP engine that answers its greedy tokens once loaded."""

    def __init__(self, model: Path, load_format: str, extra: dict | None = None):
        env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(TP)),
               "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
        super().__init__([SCRIPT, model, load_format, TP, json.dumps(extra or {})], f"TP engine {load_format}", env)
        self._tokens = None

    def tokens(self, timeout_s: float = 400) -> list[int]:
        if self._tokens is None:
            self._tokens = self.read_json("RESULT ", timeout_s)
        return self._tokens

    def final_tensors(self) -> list[dict[str, str]]:
        """Per TP rank, the oracle's digests of its final tensors (`harness.oracle`)."""
        self.tokens()
        return json.loads(self.read("TENSORS ", 120))

    def stop(self) -> None:
        self.end(timeout_s=120)


EMBEDDING = 49152 * 576 * 2  # SmolLM2's, bf16

def rank_loads(registry, engine: TPEngine) -> dict[int, dict]:
    """TP rank -> the load that rank's worker reported."""
    pids = set(descendants(engine.pid))
    out = {}
    for e in registry.stats().engines:
        if e.pid in pids:
            rank = int(e.signature.split("|tp")[1].split("|")[0].split(".")[1])
            out[rank] = e.load
    return out


def test_each_rank_shares_its_own_shards_with_the_same_rank_of_another_engine(smollm2, registry):
    # The reference (`harness.references`): a plain load's final tensors per rank and its tokens
    # (tests/e2e/test_packed_linear.py holds such an engine against an `auto` one).
    alone = TPEngine(smollm2, REFERENCE_FORMAT, reference_options())
    reference = alone.tokens()
    shards = alone.final_tensors()  # each rank's final tensors, as a plain load makes them
    alone.stop()
    assert len(shards) == TP and all(shards), f"{len(shards)} ranks answered, not {TP}"

    # Six rank workers on two CPUs, beside another test's engines in CI: the registry may take
    # longer than its default 10 s to answer, and a rank would then load on without it (as it
    # should: tests/e2e/test_registry_faults.py), which is not what this test is about.
    patient = {"registry_timeout_s": 120}
    first = TPEngine(smollm2, "dedup", patient)
    try:
        assert first.tokens() == reference
        second = TPEngine(smollm2, "dedup", patient)
        try:
            assert second.tokens() == reference
            one, two = rank_loads(registry, first), rank_loads(registry, second)
            assert sorted(one) == sorted(two) == list(range(TP)), (sorted(one), sorted(two), first.log()[-4000:])
            # What one engine holds in segments: the model (269 MB), with cpu_linear="packed" also
            # the embedding's packed copy, once more for the tied head's (56.6 MB each); a third per
            # rank (plus replicated small tensors), all of it mapped by the second.
            helds = [one[rank]["published_bytes"] + one[rank]["shared_bytes"] for rank in range(TP)]
            assert 0.95 * 269e6 < sum(helds) < 1.05 * (269e6 + 2 * EMBEDDING), helds
            for rank in range(TP):
                held = helds[rank]
                assert 0.9 * sum(helds) / TP < held < 1.1 * sum(helds) / TP, helds
                assert two[rank]["published_tensors"] == 0, two[rank]
                assert two[rank]["shared_bytes"] == held, (rank, one[rank], two[rank])
                # Each rank of the second engine maps its shards from its rank's recipe.
                assert (one[rank]["load_path"], two[rank]["load_path"]) == ("none", "full"), (one[rank], two[rank])
                assert two[rank]["checkpoint_bytes_read"] == 0
            for engine in (first, second):
                workers = engine.final_tensors()
                assert len(workers) == TP and all(workers), f"{len(workers)} ranks answered, not {TP}"
                for rank, tensors in enumerate(workers):
                    assert not differences(tensors, shards[rank]), (rank, differences(tensors, shards[rank])[:5])
            (group,) = registry.stats().groups
            assert group.engines == 2 * TP
            # Shards of different ranks differ: the resident bytes are one model, not one per rank.
            assert group.resident_bytes < 1.05 * (269e6 + EMBEDDING)  # the tied head's packed copy is found once
        finally:
            second.stop()
    finally:
        first.stop()
    assert wait_for(lambda: registry.stats().groups == [], 30)
