"""Loading only what is not resident: real vLLM engines (CPU backend) map from recipes instead of
reading their checkpoint, and answer exactly as plain engines do.

What an engine read is checked twice: the engine's own count (``checkpoint_bytes_read`` in its
report), and the page cache: the checkpoint file's pages are dropped before the engine starts,
and afterwards only its header's pages may be back (``mincore``).
"""

from __future__ import annotations

import os
import shutil

from harness.engines import PROMPTS, EngineProcess, ServeProcess
from harness.oracle import differences
from harness.procs import evict_from_page_cache, resident_bytes
from helpers import scan_json, wait_for
from vllm_dedup.registry.client import RegistryClient
from vllm_dedup.checkpoint.readers import SafetensorsFile

# vLLM itself reads a checkpoint's header at start-up, with the kernel's readahead (128 to 256 kB
# past it); no tensor byte beyond that window may be in the page cache.
READAHEAD = 512 << 10


def tensor_bytes_resident(ckpt) -> int:
    """Bytes of the checkpoint's tensor data, past the readahead window after its header, in
    the page cache now."""
    with SafetensorsFile(ckpt) as f:
        data_start = 8 + len(f.header())
    return resident_bytes(ckpt, data_start + READAHEAD)


def layer_bytes(model_dir, layers=(28, 29), min_bytes: int = 0) -> int:
    """Bytes of the checkpoint tensors of the given decoder layers (all of them changed in the
    last-layers variant), of those of at least ``min_bytes``."""
    with SafetensorsFile(model_dir / "model.safetensors") as f:
        return sum(e.nbytes for e in f.entries()
                   if any(f".layers.{i}." in e.name for i in layers) and e.nbytes >= min_bytes)


def dedup_lines(engine) -> str:
    """What the engine's log says of vllm-dedup (for failure messages)."""
    return "\n".join(line for line in engine.log().splitlines() if "vllm-dedup" in line)


def largest_tensor_bytes(model_dir) -> int:
    with SafetensorsFile(model_dir / "model.safetensors") as f:
        return max(e.nbytes for e in f.entries())


def tensor_bytes_total(model_dir) -> int:
    with SafetensorsFile(model_dir / "model.safetensors") as f:
        return sum(e.nbytes for e in f.entries())


def test_the_second_engine_of_a_model_maps_every_module_and_reads_no_checkpoint_byte(
        smollm2, registry, plain_smollm2, plain_serve_texts, tmp_path, same_tensors):
    # A copy of its own: the page cache is machine-wide, and tests in another worker read SmolLM2.
    model = tmp_path / "smollm2"
    shutil.copytree(smollm2, model)
    ckpt = model / "model.safetensors"
    first = EngineProcess(model, core=0).wait_ready()
    try:
        l1 = registry.engine_loads()[first.pid]
        assert l1["load_path"] == "none" and l1["checkpoint_bytes_read"] == tensor_bytes_total(smollm2)
        same_tensors(first, smollm2)
        evict_from_page_cache(ckpt)
        with EngineProcess(model, core=1) as second:  # LLM()
            second.wait_ready()
            l2 = registry.engine_loads()[second.pid]
            assert tensor_bytes_resident(ckpt) == 0
            assert (l2["load_path"], l2["checkpoint_bytes_read"], l2["published_tensors"]) == ("full", 0, 0)
            # It maps all the first holds in segments (the first maps one itself: its tied head's
            # oneDNN packed copy is its embedding's).  Its peak: with cpu_linear="packed", the
            # packed copies vLLM makes of the embedding and of the tied head (the largest tensor,
            # twice), which the sharing pass replaces once the model is built; a linear layer's
            # packed copy is replaced as soon as it is made.
            assert l2["shared_bytes"] == l1["published_bytes"] + l1["shared_bytes"]
            assert l2["peak_bytes"] < 0.05 * l1["published_bytes"] + 2 * largest_tensor_bytes(smollm2), l2
            same_tensors(second, smollm2)
            assert second.generate() == plain_smollm2
        evict_from_page_cache(ckpt)
        served = ServeProcess(model, "dedup", tmp_path / "serve.log", core=1).wait_ready()  # vllm serve
        try:
            (l3,) = [e.load for e in registry.stats().engines if e.pid in served.pids()]
            assert (l3["load_path"], l3["checkpoint_bytes_read"]) == ("full", 0)
            assert tensor_bytes_resident(ckpt) == 0
            same_tensors(served, smollm2)
            assert served.complete(PROMPTS) == plain_serve_texts
        finally:
            served.stop()
        assert first.generate() == plain_smollm2
    finally:
        first.stop()


def test_a_fine_tune_reads_only_its_changed_layers(smollm2, variants, registry, plain_tokens, cache_root,
                                                   same_tensors, tmp_path):
    # A copy of its own: the page cache is machine-wide, and tests in another worker read the variant.
    last = tmp_path / "last-layers"
    shutil.copytree(variants["last-layers"], last)
    scan_json(last, cache=cache_root)  # its keys in the manifest cache, as after `vllm-dedup scan`
    base = EngineProcess(smollm2, core=0).wait_ready()
    try:
        evict_from_page_cache(last / "model.safetensors")
        with EngineProcess(last, core=1) as tuned:
            tuned.wait_ready()
            load = registry.engine_loads()[tuned.pid]
            assert load["load_path"] == "modules"
            assert load["checkpoint_bytes_read"] == layer_bytes(last)  # 14.2 MB of 269 MB
            # The pages holding them, and nothing else (each tensor's ends round out to a page).
            assert tensor_bytes_resident(last / "model.safetensors") <= layer_bytes(last) + 18 * 2 * 4096
            assert "a recipe maps 202 of 214 modules" in tuned.log()
            same_tensors(tuned, variants["last-layers"])
            assert tuned.generate() == plain_tokens(variants["last-layers"])
    finally:
        base.stop()


def test_a_checkpoint_rewritten_in_place_is_never_served_stale(smollm2, registry, plain_tokens, tmp_path,
                                                               same_tensors):
    model = tmp_path / "model"
    shutil.copytree(smollm2, model)
    ckpt = model / "model.safetensors"
    before = plain_tokens(model)
    first = EngineProcess(model, core=0).wait_ready()
    try:
        # Zero layer 29's down projection in place; size, header and mtime stay as they were.
        with SafetensorsFile(ckpt) as f:
            start, end = f.byte_range("model.layers.29.mlp.down_proj.weight")
            header = f.header()
        st = os.stat(ckpt)
        with open(ckpt, "r+b") as fh:
            fh.seek(start)
            fh.write(bytes(end - start))
        os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns))
        with SafetensorsFile(ckpt) as f:
            assert (os.stat(ckpt).st_size, os.stat(ckpt).st_mtime_ns, f.header()) == (st.st_size, st.st_mtime_ns, header)
        plain = EngineProcess(model, "auto").wait_ready()
        rewritten = plain.generate()
        plain.stop()
        assert rewritten != before  # the rewrite changes the answers: staleness would show
        with EngineProcess(model, core=1) as second:
            second.wait_ready()
            load = registry.engine_loads()[second.pid]
            assert load["load_path"] == "modules", load
            assert "model.layers.29.mlp.down_proj: its checkpoint tensors changed" in second.log()
            same_tensors(second, model)  # the reference is made now, of the rewritten file
            assert second.generate() == rewritten
    finally:
        first.stop()


def test_segments_freed_after_the_recipe_was_made_are_loaded_again(smollm2, variants, registry, plain_tokens,
                                                                  cache_root, same_tensors):
    """The base engine goes; its last layers (held by nobody else) are freed, its recipe stays.
    The next base engine maps what is still resident (held by the fine-tune) and loads the
    rest; once nothing is resident, it loads everything, and still answers as plain."""
    last = variants["last-layers"]
    scan_json(last, cache=cache_root)
    base = EngineProcess(smollm2, core=0).wait_ready()
    tuned = EngineProcess(last, core=1).wait_ready()
    try:
        base.stop()
        assert wait_for(lambda: base.pid not in registry.engine_loads())
        with EngineProcess(smollm2, core=0) as again:
            again.wait_ready()
            load = registry.engine_loads()[again.pid]
            assert load["load_path"] == "modules"
            # The freed segments held those layers' matrices; their norms travel in the recipe.
            assert load["checkpoint_bytes_read"] == layer_bytes(smollm2, min_bytes=1 << 16)
            assert "is no longer resident" in again.log()
            same_tensors(again, smollm2)
            assert again.generate() == plain_tokens(smollm2)
        watcher = RegistryClient(registry.socket)  # keeps the idle daemon (and its recipes) up
    finally:
        tuned.stop()
    try:
        assert wait_for(lambda: registry.stats().groups == [])
        with EngineProcess(smollm2, core=0) as alone:
            alone.wait_ready()
            load = registry.engine_loads()[alone.pid]
            assert load["load_path"] == "none" and load["checkpoint_bytes_read"] == tensor_bytes_total(smollm2)
            assert "nothing the recipe names is resident any more" in alone.log(), dedup_lines(alone)
            same_tensors(alone, smollm2)
            assert alone.generate() == plain_tokens(smollm2)
    finally:
        watcher.close()


def test_after_the_first_engine_is_sigkilled_a_warm_registry_still_gives_the_fast_path(smollm2, registry,
                                                                                       plain_smollm2, same_tensors):
    first = EngineProcess(smollm2, extra={"keep_warm_s": 600}, core=0).wait_ready()  # starts the registry
    first.kill()
    assert wait_for(lambda: registry.stats().engines == [])
    assert registry.stats().groups[0].segments > 0  # kept warm
    with EngineProcess(smollm2, core=1) as second:
        second.wait_ready()
        load = registry.engine_loads()[second.pid]
        assert (load["load_path"], load["checkpoint_bytes_read"]) == ("full", 0)
        same_tensors(second, smollm2)
        assert second.generate() == plain_smollm2


def test_after_the_registry_dies_a_later_engine_maps_again(smollm2, registry, plain_smollm2, same_tensors):
    """The registry is SIGKILLed under a running engine; the engine re-registers its segments and
    recipe with the next registry, and a later engine still takes the full path."""
    import json
    import signal

    from helpers import run_cli

    first = EngineProcess(smollm2, core=0).wait_ready()
    try:
        old = registry.stats().registry_pid
        os.kill(old, signal.SIGKILL)
        assert wait_for(lambda: _reregistered(registry, first.pid, old), 60), dedup_lines(first)
        status = json.loads(run_cli("status", "--json", check=True).stdout)
        (engine,) = status["engines"]
        assert (engine["pid"], engine["load"]["reregistered"], engine["load"]["load_path"]) == (first.pid, 1, "none")
        with EngineProcess(smollm2, core=1) as second:
            second.wait_ready()
            load = registry.engine_loads()[second.pid]
            assert (load["load_path"], load["checkpoint_bytes_read"]) == ("full", 0)
            same_tensors(second, smollm2)
            assert second.generate() == plain_smollm2
        same_tensors(first, smollm2)
        assert first.generate() == plain_smollm2
    finally:
        first.stop()


def _reregistered(registry, pid: int, old_registry: int) -> bool:
    try:
        stats = registry.stats()
    except Exception:  # noqa: BLE001 (no registry yet)
        return False
    engine = stats.engine(pid)
    return stats.registry_pid != old_registry and engine is not None and engine.load.get("reregistered") == 1


def test_a_quantized_model_is_shared_and_answers_as_plain(smollm2, registry):
    """W8A8 int8 (compressed-tensors), which vLLM's CPU backend serves.  Its int8 weights are
    shared like any others; each oneDNN int8 handler reads its layer's ``weight_scale`` through
    a raw pointer, so the oracle compares every quantized linear's output too (``output:``),
    with a plain ``auto`` engine's, byte for byte.  The fast path cannot map its attention
    layers in this vLLM: the compressed-tensors KV-cache method declares pre-processed support
    but ignores the mode (patches/0003 is the fix), so the engine loads as usual, with one line
    saying why."""
    from harness.variants import cached_variant

    quantized = cached_variant(smollm2, "w8a8-int8")
    with EngineProcess(quantized, "auto", core=0) as plain:
        plain.wait_ready()
        (plain_tensors,) = plain.final_tensors()
        reference = plain.generate()
    assert sum(k.startswith("output:") for k in plain_tensors) == 4 * 30  # qkv, o, gate_up, down in 30 layers
    engines = [EngineProcess(quantized, core=i).wait_ready() for i in range(2)]
    try:
        first, second = (registry.engine_loads()[e.pid] for e in engines)
        with SafetensorsFile(quantized / "model.safetensors") as f:
            embedding = max(e.nbytes for e in f.entries())
        # Which tensors stay parameters depends on the CPU: with AVX-512, vLLM's int8 path
        # repacks the int8 matrices into oneDNN memory; with AVX2 they stay tensors and are
        # shared too.  What holds everywhere: the embedding is shared, the second engine maps
        # all the first published, and both hold exactly a plain load's tensors.
        assert first["published_bytes"] >= embedding
        assert second["shared_bytes"] == first["published_bytes"] + first["shared_bytes"]
        assert second["published_tensors"] == 0
        for e in engines:
            (tensors,) = e.final_tensors()
            assert not differences(tensors, plain_tensors), differences(tensors, plain_tensors)[:5]
        assert second["load_path"] in ("none", "modules")
        if second["load_path"] == "none":  # vLLM without patches/0003
            assert "failed in vLLM's pre-processed mode" in engines[1].log(), dedup_lines(engines[1])
        for e in engines:
            assert e.generate() == reference
    finally:
        for e in engines:
            e.stop()


def test_tensors_post_processing_writes_are_never_mapped_by_a_replay(smollm2, registry, plain_smollm2, same_tensors):
    """With ``min_tensor_bytes=4`` the attention layers' 4-byte scales are published, and vLLM's
    attention post-processing writes them whatever the pre-processed mode
    (``_k_scale.fill_(1.0)``).  A replay that mapped them read-only died of SIGSEGV; the recipe
    keeps them inline (as small as its inline limit), and a write into a mapped tensor would
    be refused and the replay declined (`provenance.WriteGuard`, test_provenance.py)."""
    extra = {"min_tensor_bytes": 4, "share_group": "tiny-tensors"}
    first = EngineProcess(smollm2, extra=extra, core=0).wait_ready()
    try:
        with EngineProcess(smollm2, extra=extra, core=1) as second:
            second.wait_ready()
            load = registry.engine_loads()[second.pid]
            assert (load["load_path"], load["checkpoint_bytes_read"]) == ("full", 0), load
            assert "would write into" not in second.log()
            same_tensors(second, smollm2)
            assert second.generate() == plain_smollm2
    finally:
        first.stop()
