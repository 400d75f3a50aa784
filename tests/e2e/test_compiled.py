"""Compiled engines, as users run them (torch.compile, no ``--enforce-eager``; vLLM's CPU backend
compiles with inductor and keeps AOT artifacts under ``$VLLM_CACHE_ROOT``).

With ``cpu_share_linear`` (the default on the CPU backend) a dedup engine's graph calls
``F.linear`` on shared weights where a plain engine's calls oneDNN on its private packed copy.
vLLM's compile-cache key would not tell the two apart (its load config hashes nothing), so the
loader adds the option to it (`vllm_dedup.engine.compile_cache`).  vLLM names the artifact it
saves ("saved AOT compiled function to PATH") and the one it loads ("Directly load AOT
compilation from path PATH"), and says when a load fails ("Compiling model again due to a load
failure"): the assertions below read those lines.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from harness.engines import EngineProcess

SAVED = re.compile(r"saved AOT compiled function to (\S+)")
LOADED = re.compile(r"Directly load AOT compilation from path (\S+)")
LOAD_FAILURE = "Compiling model again due to a load failure"
START_S = 600  # a cold compile takes 60 to 120 s here, more while other engines compile


def _artifacts(log: str) -> tuple[list[Path], list[Path]]:
    """The AOT artifacts an engine's log says it saved, and those it loaded."""
    return [Path(p) for p in SAVED.findall(log)], [Path(p) for p in LOADED.findall(log)]


def _key_dir(artifact: Path) -> Path:
    """``.../torch_aot_compile/<key>`` of ``.../torch_aot_compile/<key>/rank_0_0/model``."""
    return artifact.parents[1]


def _start(model, env: dict, **extra) -> EngineProcess:
    """A compiled dedup engine with ``extra`` as its loader options, bound to core 0 as every
    engine here is: vLLM's compile-cache key hashes its environment variables, the core binding
    (``VLLM_CPU_OMP_THREADS_BIND``) among them, so engines on other cores never share artifacts."""
    return EngineProcess(model, env=env, core=0, compiled=True, **({"extra": extra} if extra else {}))


def test_compiled_dedup_engines_share_weights_and_a_compile_cache_of_their_own(smollm2, registry, tmp_path):
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    timings = {}

    # A plain engine compiles first into the cache; its greedy tokens are the reference.
    start = time.monotonic()
    with EngineProcess(smollm2, "auto", env=env, core=0, compiled=True) as plain:
        plain.wait_ready(START_S)
        timings["plain (compiles)"] = time.monotonic() - start
        reference = plain.generate()
        plain_saved, plain_loaded = _artifacts(plain.log())
    assert len(plain_saved) == 1 and plain_loaded == [] and plain_saved[0].is_file()
    plain_artifact = plain_saved[0].read_bytes()

    # The first dedup engine finds no artifact for its graph: it compiles, with no load failure,
    # into a key of its own, and leaves the plain engine's artifact alone.
    start = time.monotonic()
    with _start(smollm2, env) as first:
        first.wait_ready(START_S)
        timings["first dedup (compiles)"] = time.monotonic() - start
        assert first.generate() == reference
        log = first.log()
    assert LOAD_FAILURE not in log, log[-3000:]
    dedup_saved, dedup_loaded = _artifacts(log)
    assert len(dedup_saved) == 1 and dedup_loaded == []
    assert _key_dir(dedup_saved[0]) != _key_dir(plain_saved[0])

    # Every later dedup engine loads that artifact: two in share groups of their own (nothing
    # shared: the baseline), then two in one group.  All four load rather than compile, so the
    # two pairs' memory differs by what sharing saves, not by what compiling costs (over 100 MB).
    start = time.monotonic()
    apart = [_start(smollm2, env, share_group="x"), _start(smollm2, env, share_group="y")]
    try:
        for e in apart:
            e.wait_ready(START_S)
        timings["x and y, started together (load the artifact)"] = time.monotonic() - start
        for e in apart:
            assert e.generate() == reference
        loads = registry.engine_loads()
        assert [loads[e.pid]["shared_bytes"] for e in apart] == [0, 0]
        apart_pss = sum(e.pss() for e in apart)
        apart_logs = [e.log() for e in apart]
    finally:
        for e in apart:
            e.stop()

    start = time.monotonic()
    a = _start(smollm2, env)
    b = None
    try:
        a.wait_ready(START_S)
        b = _start(smollm2, env).wait_ready(START_S)  # after a: it maps what a published
        timings["a, then b (load the artifact)"] = time.monotonic() - start
        assert a.generate() == reference and b.generate() == reference
        loads = registry.engine_loads()
        la, lb = loads[a.pid], loads[b.pid]
        assert lb["shared_bytes"] == la["published_bytes"] > 0.9 * 269e6
        together_pss = a.pss() + b.pss()
        logs = apart_logs + [a.log(), b.log()]
    finally:
        a.stop()
        if b is not None:
            b.stop()

    for log in logs:
        assert LOAD_FAILURE not in log, log[-3000:]
        assert _artifacts(log) == ([], dedup_saved), log[-3000:]
    assert plain_saved[0].read_bytes() == plain_artifact  # no dedup engine wrote over it
    saved = apart_pss - together_pss
    print(f"compiled: PSS apart {apart_pss / 1e6:.0f} MB, together {together_pss / 1e6:.0f} MB, saved "
          f"{saved / 1e6:.0f} MB of {lb['shared_bytes'] / 1e6:.0f} MB shared; "
          + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    assert saved >= 0.9 * lb["shared_bytes"]
