"""Compiled engines, as users run them (torch.compile, no ``--enforce-eager``; vLLM's CPU backend
compiles with inductor and keeps AOT artifacts under ``$VLLM_CACHE_ROOT``).

With ``cpu_linear="packed"`` (the default) a dedup engine's graph is vLLM's own: its linear layers
call oneDNN on handlers whose packed weights live in segments, so it loads a plain engine's
artifact.  With ``cpu_linear="plain"`` its graph calls ``F.linear`` on shared weights where a
plain engine's calls oneDNN; vLLM's compile-cache key would not tell the two apart (its load
config hashes nothing), so the loader adds the option to it
(`vllm_dedup.engine.compile_cache`).  vLLM names the artifact it
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
    """A compiled dedup engine with ``extra`` as its loader options, given core 0 as every
    engine here is: vLLM's compile-cache key hashes its environment variables, the core binding
    (``VLLM_CPU_OMP_THREADS_BIND``) among them, so engines given other cores never share
    artifacts (whether or not vLLM binds the engine: `harness.engines.EngineProcess`)."""
    return EngineProcess(model, env=env, core=0, compiled=True, **({"extra": extra} if extra else {}))


def test_compiled_dedup_engines_share_weights_and_the_compile_cache_their_graph_allows(smollm2, registry, tmp_path):
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

    # Dedup engines (cpu_linear="packed") run vLLM's graph: both load the plain engine's
    # artifact, so their memory differs by what sharing saves, not by what compiling costs
    # (over 100 MB).  a alone holds its segments whole: two engines that shared nothing would
    # hold twice that; a and b together hold the segments once.
    start = time.monotonic()
    a = _start(smollm2, env)
    b = None
    try:
        a.wait_ready(START_S)
        alone_pss = a.own_pss()
        b = _start(smollm2, env).wait_ready(START_S)  # after a: it maps what a holds in segments
        timings["a, then b (load the artifact)"] = time.monotonic() - start
        assert a.generate() == reference and b.generate() == reference
        loads = registry.engine_loads()
        la, lb = loads[a.pid], loads[b.pid]
        assert lb["shared_bytes"] == la["published_bytes"] + la["shared_bytes"] > 0.9 * 269e6
        together_pss = a.own_pss() + b.own_pss()
        logs = [a.log(), b.log()]
    finally:
        a.stop()
        if b is not None:
            b.stop()

    for log in logs:
        assert LOAD_FAILURE not in log, log[-3000:]
        assert _artifacts(log) == ([], plain_saved), log[-3000:]
    saved = 2 * alone_pss - together_pss  # one copy of the segments instead of two
    print(f"compiled: heap+shmem PSS of a alone {alone_pss / 1e6:.0f} MB, a and b together {together_pss / 1e6:.0f} MB, "
          f"saved {saved / 1e6:.0f} MB of {la['published_bytes'] / 1e6:.0f} MB in segments; "
          + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    assert saved >= 0.9 * la["published_bytes"]

    # cpu_linear="plain" changes the graph where vLLM packs linear weights: such an engine finds
    # no artifact for it, compiles with no load failure into a key of its own, and leaves the
    # plain engine's artifact alone.  Where vLLM runs F.linear itself (bfloat16 on AVX2) the
    # graph is vLLM's own, and the plain engine's artifact is loaded.
    from vllm_dedup.engine.onednn import vllm_packs

    start = time.monotonic()
    with _start(smollm2, env, cpu_linear="plain", share_group="plain-linear") as flinear:
        flinear.wait_ready(START_S)
        timings["cpu_linear=plain (compiles)"] = time.monotonic() - start
        assert flinear.generate() == reference
        log = flinear.log()
    assert LOAD_FAILURE not in log, log[-3000:]
    flinear_saved, flinear_loaded = _artifacts(log)
    if vllm_packs("bfloat16"):
        assert len(flinear_saved) == 1 and flinear_loaded == []
        assert _key_dir(flinear_saved[0]) != _key_dir(plain_saved[0])
    else:
        assert (flinear_saved, flinear_loaded) == ([], plain_saved), log[-3000:]
    assert plain_saved[0].read_bytes() == plain_artifact  # no dedup engine wrote over it
