"""Tensor parallelism: every TP rank shares its own shards, and the same rank of two engines of
one model finds identical shards under identical keys.  Real vLLM engines (CPU backend,
``tensor_parallel_size=3``: SmolLM2 has 9 attention heads and 3 KV heads), one worker process
per rank, the real registry daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import wait_for
from vllm_dedup.measure import descendants, read_reply

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("tp_engine.py")
TP = 3


class TPEngine:
    def __init__(self, model: Path, load_format: str):
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(TP)),
               "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), str(model), load_format, str(TP)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)

    def tokens(self, timeout_s: float = 400) -> list[int]:
        return json.loads(read_reply(self.proc, "RESULT ", timeout_s, "TP engine"))

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


def rank_loads(registry, engine: TPEngine) -> dict[int, dict]:
    """TP rank -> the load that rank's worker reported."""
    pids = set(descendants(engine.proc.pid))
    out = {}
    for e in registry.stats()["engines"]:
        if e["pid"] in pids:
            rank = int(e["signature"].split("|tp")[1].split("|")[0].split(".")[1])
            out[rank] = e["load"]
    return out


def test_each_rank_shares_its_own_shards_with_the_same_rank_of_another_engine(smollm2, registry):
    plain = TPEngine(smollm2, "auto")
    reference = plain.tokens()
    plain.stop()

    first = TPEngine(smollm2, "dedup")
    try:
        assert first.tokens() == reference
        second = TPEngine(smollm2, "dedup")
        try:
            assert second.tokens() == reference
            one, two = rank_loads(registry, first), rank_loads(registry, second)
            assert sorted(one) == sorted(two) == list(range(TP))
            for rank in range(TP):
                held = one[rank]["published_bytes"] + one[rank]["shared_bytes"]
                # A third of the model per rank (plus replicated small tensors), all of it mapped.
                assert 0.3 * 269e6 < held < 0.4 * 269e6
                assert two[rank]["published_tensors"] == 0, two[rank]
                assert two[rank]["shared_bytes"] == held, (rank, one[rank], two[rank])
            (group,) = registry.stats()["groups"]
            assert group["engines"] == 2 * TP
            # Shards of different ranks differ: the resident bytes are one model, not one per rank.
            assert group["resident_bytes"] < 1.05 * 269e6
        finally:
            second.stop()
    finally:
        first.stop()
    assert wait_for(lambda: registry.stats()["groups"] == [], 30)
