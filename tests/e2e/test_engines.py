"""Several real vLLM engines (CPU backend) sharing their common weights through the registry.

Every engine is a real vLLM engine in its own process (`harness.engines.EngineProcess`); the registry is the
real daemon, or the real Ray actor on a real Ray cluster on loopback.  Counts come from the
registry; expected counts are derived here from the checkpoints, independently.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from harness.engines import PROMPTS, EngineProcess, ServeProcess, start_engines
from harness.procs import fd_targets, free_port, memfd_holders, processes_matching
from vllm_dedup.registry.state import MAX_RECIPES
from vllm_dedup.segments.host import RECIPE_MEMFD_NAME
from helpers import wait_for

def test_same_model_outputs_match_and_the_second_engine_saves_90_percent(smollm2, plain_smollm2, registry):
    reference = plain_smollm2

    # Baseline: the same code path with nothing shared (two share groups), so that the
    # difference below is what sharing saves and nothing else.
    apart = start_engines([{"model": smollm2, "extra": {"share_group": "x"}},
                           {"model": smollm2, "extra": {"share_group": "y"}}])
    for e in apart:
        assert e.generate() == reference
    apart_pss = sum(e.own_pss() for e in apart)  # both phases measured after the same work
    for e in apart:
        e.stop()

    a, b = start_engines([{"model": smollm2}, {"model": smollm2}])
    try:
        assert a.generate() == reference and b.generate() == reference
        loads = registry.engine_loads()
        # The publisher (a: start_engines starts them in turn) and the one that mapped.
        la, lb = sorted((loads[a.pid], loads[b.pid]), key=lambda load: -load["published_tensors"])
        # The publisher maps one segment of its own at most: its tied head's oneDNN packed copy is
        # its embedding's (cpu_linear="packed").  The other maps all the publisher holds.
        assert la["shared_tensors"] <= 1 and la["published_tensors"] > 0 and la["collisions"] == 0
        assert lb["shared_tensors"] == la["published_tensors"] + la["shared_tensors"]
        assert lb["published_tensors"] == 0
        assert lb["shared_bytes"] == la["published_bytes"] + la["shared_bytes"]
        assert la["published_bytes"] > 0.95 * 269e6  # all but small tensors
        together_pss = a.own_pss() + b.own_pss()
        saved = apart_pss - together_pss  # one copy of the segments instead of two
        print(f"heap+shmem PSS apart {apart_pss / 1e6:.0f} MB, together {together_pss / 1e6:.0f} MB, "
              f"saved {saved / 1e6:.0f} MB of {la['published_bytes'] / 1e6:.0f} MB in segments")
        assert saved >= 0.9 * la["published_bytes"]

        # Guards: in-place weight writers are refused while weights are shared.
        for op in ("reset_weights", "sleep", "reload_weights"):
            reply = b.rpc(op)
            assert reply.startswith("error") and f"{op} is refused" in reply, reply
        assert b.generate() == reference and a.generate() == reference
        # A user's sleep is refused before the engine core pauses its scheduler (which it does
        # before asking the workers): the engine serves on without a wake_up.  Level 0 pauses
        # scheduling only and is not refused.
        reply = b.call("sleep", level=1)
        assert reply.startswith("error") and "sleep is refused" in reply, reply
        assert b.generate() == reference
        assert b.call("sleep", level=0) == "ok" and b.call("wake_up", tags=["scheduling"]) == "ok"
        assert b.generate() == reference

        # An engine deleted in its own process (a user's `del llm`) lets its lease go with its
        # model while the process lives: the registry drops it; what b maps stays resident.
        a.delete()  # the registry drops it once it has read the hang-up (its own thread, soon)
        assert wait_for(lambda: [e.pid for e in registry.stats().engines] == [b.pid], 30), registry.stats()
        assert sum(g.resident_bytes for g in registry.stats().groups) >= la["published_bytes"]
        assert b.generate() == reference
        b.delete()  # the last holder gone: nothing is resident (keep_warm_s is 0)
        assert wait_for(lambda: (s := registry.stats()).engines == [] and sum(g.resident_bytes for g in s.groups) == 0,
                        30), registry.stats()
        assert a.proc.poll() is None and b.proc.poll() is None  # both processes live on
    finally:
        a.stop()
        b.stop()


def _linear_bytes(model_dir: Path, layers: tuple[int, ...]) -> tuple[int, int]:
    """Bytes of the checkpoint's linear weights in ``layers``, and how many fused vLLM
    parameters they become (qkv_proj, o_proj, gate_up_proj, down_proj per layer)."""
    tensors = load_file(model_dir / "model.safetensors")
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    total = sum(t.numel() * t.element_size() for n, t in tensors.items()
                if any(f".layers.{i}." in n for i in layers) and any(f".{p}." in n for p in names))
    return total, 4 * len(layers)


def test_variants_share_exactly_their_unchanged_tensors(smollm2, variants, registry, plain_tokens):
    """Counted against the checkpoints' own tensors, so with ``cpu_linear="plain"``, where the
    final tensors are the checkpoint's (fused); the packed weights of the default are counted
    in tests/e2e/test_packed_linear.py."""
    last, vocab = variants["last-layers"], variants["vocab-extended"]
    plain_out = plain_tokens(last)
    extra = {"cpu_linear": "plain"}
    engines = start_engines([{"model": m, "extra": extra} for m in (smollm2, last, vocab)])
    try:
        base_e, last_e, vocab_e = engines
        assert last_e.generate() == plain_out
        loads = registry.engine_loads()
        n = loads[base_e.pid]["published_tensors"]

        changed_bytes, changed_tensors = _linear_bytes(last, (28, 29))
        ll = loads[last_e.pid]
        assert (ll["published_tensors"], ll["published_bytes"]) == (changed_tensors, changed_bytes)
        assert ll["shared_tensors"] == n - changed_tensors
        assert ll["shared_bytes"] == loads[base_e.pid]["published_bytes"] - changed_bytes

        lv = loads[vocab_e.pid]
        vocab_size = json.loads((vocab / "config.json").read_text())["vocab_size"]
        padded = math.ceil(vocab_size / 64) * 64  # vLLM pads the embedding to 64 rows
        assert (lv["published_tensors"], lv["published_bytes"]) == (1, padded * 576 * 2)
        assert lv["shared_tensors"] == n - 1
        assert registry.stats().collisions == 0
    finally:
        for e in engines:
            e.stop()


def test_sigkill_of_the_first_engine(smollm2, registry, plain_smollm2):
    a, b = start_engines([{"model": smollm2}, {"model": smollm2}])
    try:
        reference = plain_smollm2  # a plain engine's: b and c read what a put in segments
        assert b.generate() == reference
        la = registry.engine_loads()[a.pid]
        n, mapped = la["published_tensors"], la["published_tensors"] + la["shared_tensors"]
        a.kill()
        assert wait_for(lambda: [e.pid for e in registry.stats().engines] == [b.pid])
        assert b.generate() == reference  # still answers, from segments the dead engine made
        assert registry.stats().groups[0].segments == n  # held by b alone now
        c = EngineProcess(smollm2, core=0).wait_ready()
        try:
            lc = registry.engine_loads()[c.pid]
            assert (lc["shared_tensors"], lc["published_tensors"]) == (mapped, 0)
            assert c.generate() == reference
        finally:
            c.stop()
    finally:
        b.stop()
    assert wait_for(lambda: registry.stats().groups == [])


def test_a_segment_that_cannot_be_created_leaves_its_tensors_private_and_the_engine_serving(
        smollm2, plain_smollm2, registry):
    """A real backend failure: the engine runs with a 16 MiB file-size limit (RLIMIT_FSIZE), so
    growing a memfd beyond it fails (EFBIG) and the 56.6 MB embedding gets no segment.  The
    engine still starts and answers as plain; with ``on_registry_error="fail"`` it stops with a
    clear error."""
    import re
    import resource

    limit = {resource.RLIMIT_FSIZE: 16 << 20}
    embedding = 49152 * 576 * 2
    with EngineProcess(smollm2, rlimits=limit) as e:
        e.wait_ready()
        assert e.generate() == plain_smollm2
        load = registry.engine_loads()[e.pid]
        assert load["private_bytes"] >= embedding and load["published_bytes"] > 0.7 * 269e6
        log = e.log()
        # The embedding, and with cpu_linear="packed" its packed copy (the tied head's too).
        stayed = re.search(r"(\d+) tensor\(s\) \(([\d.]+) MB\) stay private: (\d+) segment\(s\) could not be created",
                           log)
        assert stayed, log[-3000:]
        assert int(stayed[3]) in (1, 2) and float(stayed[2]) == round(int(stayed[1]) * embedding / 1e6, 1)
        assert "File too large" in log
    failing = EngineProcess(smollm2, extra={"on_registry_error": "fail"}, rlimits=limit)
    with pytest.raises(RuntimeError) as err:
        failing.wait_ready()
    assert "shared memory for the weights could not be created or mapped" in str(err.value)
    assert "SegmentError" in str(err.value)  # its own type (`fallback.fail_or_fall_back`), not a bare RuntimeError
    failing.end()


def test_unreachable_registry_falls_back_or_fails(smollm2, plain_smollm2, registry):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with EngineProcess(smollm2, extra={"registry_address": address}) as e:
        e.wait_ready()
        assert e.generate() == plain_smollm2
        assert "cannot reach the weight registry" in e.log() and "loading without sharing" in e.log()
    failing = EngineProcess(smollm2, extra={"registry_address": address, "on_registry_error": "fail"})
    with pytest.raises(RuntimeError) as err:
        failing.wait_ready()
    assert failing.proc.returncode != 0
    assert "cannot reach the weight registry" in str(err.value)
    assert f"no Ray cluster answers at {address}" in str(err.value)
    assert "RegistryUnavailable" in str(err.value)


def test_share_groups_never_share(smollm2, registry):
    engines = start_engines([{"model": smollm2, "extra": {"share_group": "a"}},
                             {"model": smollm2, "extra": {"share_group": "b"}},
                             {"model": smollm2, "extra": {"share_group": "a"}}])
    try:
        loads = registry.engine_loads()
        a1, b, a2 = (loads[e.pid] for e in engines)
        # b maps nothing of group a's: only, with cpu_linear="packed", its tied head's packed
        # copy from its own segment of the embedding's, as a1 does.
        assert a1["published_tensors"] > 0  # else nothing below could have been shared across groups
        assert (b["shared_tensors"], b["published_tensors"]) == (a1["shared_tensors"], a1["published_tensors"])
        assert a2["shared_tensors"] == a1["published_tensors"] + a1["shared_tensors"]
        groups = {g.share_group: g for g in registry.stats().groups}
        assert groups["a"].engines == 2 and groups["b"].engines == 1
    finally:
        for e in engines:
            e.stop()


def test_forced_hash_collisions_never_swap_in_other_bytes(smollm2, variants, registry, plain_tokens):
    """The exact compare of the load-then-share path.  The recipes' fast path compares nothing
    (it trusts BLAKE3-256 source keys and XXH3-128 content keys within a share group) and is turned off here:
    with every key forced to collide, trusting keys is wrong by construction."""
    last = variants["last-layers"]
    reference = plain_tokens(last)
    env = {"VLLM_DEDUP_TEST_FORCE_COLLISIONS": "1"}  # every key of a dtype and shape collides
    off = {"fast_path": False}
    engines = start_engines([{"model": smollm2, "env": env, "extra": off}, {"model": last, "env": env, "extra": off}])
    try:
        assert engines[1].generate() == reference
        loads = registry.engine_loads()
        assert loads[engines[1].pid]["collisions"] > 0
        assert loads[engines[0].pid]["collisions"] > 0  # within one model, same shapes collide too
        assert registry.stats().collisions > 0
    finally:
        for e in engines:
            e.stop()


def test_vllm_serve_with_dedup_answers_like_auto(smollm2, registry, tmp_path, plain_serve_texts):
    expected = plain_serve_texts
    served = ServeProcess(smollm2, "dedup", tmp_path / "dedup.log", core=0).wait_ready()
    try:
        assert served.complete(PROMPTS) == expected
        # The served engine's worker process published its weights; a second engine maps them.
        with EngineProcess(smollm2, core=1) as second:
            second.wait_ready()
            loads = registry.engine_loads()
            assert loads[second.pid]["shared_tensors"] > 0 and loads[second.pid]["published_tensors"] == 0
        assert served.complete(PROMPTS) == expected
    finally:
        served.stop()
    assert processes_matching(str(served.port).encode()) == []
    # vLLM's shutdown kills the server's whole process tree; the registry its worker started
    # has detached from that tree and lives on, with the engine's lease gone.
    assert registry.daemon_pids()
    assert wait_for(lambda: registry.stats().engines == [])


RAY_ACTORS = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(json.dumps([a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("vllm-dedup-registry")]))
"""


def _registry_actors(address: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", RAY_ACTORS, address], capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_start_stop_cycles_on_ray_leave_nothing_behind(smollm2, plain_smollm2, registry, ray_address):
    """Engines started and stopped one after another (five in CI; ``VLLM_DEDUP_SOAK_CYCLES``
    asks for more) leave no engine, segment, descriptor or process behind, whether they shut
    down as ``LLM`` does at interpreter exit or just exit (Note [an engine's exit in the
    tests] in harness/engines.py), and answer as a plain engine does."""
    cycles = max(5, int(os.environ.get("VLLM_DEDUP_SOAK_CYCLES", "5")))
    fds = []  # the registry's open descriptors after each cycle
    for cycle in range(cycles):
        with EngineProcess(smollm2, core=cycle % 2, graceful_exit=cycle % 2 == 0) as e:
            e.wait_ready()
            if cycle in (0, cycles - 1):
                assert e.generate() == plain_smollm2
            stats = registry.stats()
            assert [x.pid for x in stats.engines] == [e.pid]
            registry_pid = stats.registry_pid
        assert e.proc.returncode == 0
        assert wait_for(lambda: registry.stats().groups == [] and registry.stats().engines == [])
        fds.append(len(fd_targets(registry_pid)))
        assert memfd_holders() == []  # no segment outlives its engines
        # The Ray actor outlives them and keeps the model's recipes (for the next engine's fast
        # path): held by it alone, never more than it keeps.
        recipe_holders = memfd_holders(RECIPE_MEMFD_NAME)
        assert set(recipe_holders) == {registry_pid} and len(recipe_holders) <= MAX_RECIPES, recipe_holders
    # Ray's own connections in the actor's process come and go by one or two; a descriptor leaked
    # per engine would add at least four over the cycles after the first.
    assert fds[-1] - fds[0] <= 3, f"the registry's descriptors after each cycle: {fds}"
    assert not registry.daemon_pids()  # the Ray actor, not a daemon
    assert len(_registry_actors(ray_address)) == 1
    assert processes_matching(b"harness.engines") == []
