"""Decode speed, tokens and shared bytes of packed oneDNN linears on vLLM's CPU backend, side by
side in one run (issue 21).

    .venv/bin/python benchmarks/cpu_decode.py [--models smollm2,llama-1.2b] [--rounds 3]
                                             [--tokens 32] [--core 1] [--json]
                                             [--quick] [--dtype float32] [--isa avx2]

``--quick``: only plain, the packed dedup engines and a fine-tune (below); ``--dtype``: the
engines' dtype (bfloat16 by default; float32 is what oneDNN packs on AVX2); ``--isa avx2``: every
engine with oneDNN and torch held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``,
``ATEN_CPU_CAPABILITY=avx2``), the branch an AVX2 machine takes (bfloat16 linears are not packed
there: vLLM runs ``F.linear`` and so does the dedup engine, on shared weights).

Engines (``LLM()`` alone in a child process each, ``enforce_eager``, bf16, bound to one core):

- ``plain``: ``--load-format auto``: vLLM packs every linear weight for oneDNN, privately;
- ``dedup 1st`` / ``dedup 2nd``: ``--load-format dedup`` with its default ``cpu_linear="packed"``
  (`vllm_dedup.engine.packed`): the first engine publishes each oneDNN handler's packed weight
  as a segment and installs it in place of its private copy; the second maps them from the
  first's recipe (load path ``full``: the checkpoint is not read, vLLM packs placeholders of
  zero pages and each is replaced by its segment at once);
- ``F.linear 1st`` / ``F.linear 2nd``: ``--load-format dedup`` with ``cpu_linear="plain"`` (plain
  weights, ``F.linear``, shared through the registry; the default before packed sharing);
- ``fine-tune``: the model's last-layers variant (`harness.variants`), a dedup engine started
  while ``dedup 1st`` is up (load path ``modules``), against a plain engine of the fine-tune.

The engines use a registry of the benchmark's own (``VLLM_DEDUP_RUNTIME_DIR``, a temporary
directory), each case in its own share group.

Phases keep at most two engines alive: (plain, dedup 1st), (dedup 1st, dedup 2nd), (plain,
F.linear 1st), (F.linear 1st, F.linear 2nd); within a phase the engines take turns for each
measurement, ``--rounds`` times, and ratios are taken within a phase (the second engines' ratio
to plain goes through the first engine's: machine noise hits both sides of each ratio alike).

Measured: decode tokens/s at batch 1 and 8 (``ignore_eos``; ``batch * tokens / (t(tokens + 1)
- t(1))``, so prefill is left out; per engine the best of its rounds, and ratios both as best
over best and as the median of back-to-back pairs; the page faults of each measurement, the
engine's and the machine's, say how disturbed it was), greedy tokens compared with plain's on
every prompt, and memory: the second engine's private memory (RssAnon, after ``malloc_trim``)
below a plain engine's, as a share of the linear (packed) bytes of one engine (what the second
engine adds to the machine is its private memory: its segments are the first engine's pages),
and the same from the PSS of the pair (``2 * PSS(plain) - PSS(1st) - PSS(2nd)``).

The mechanism is also timed without an engine, where a decode step's linears are all there is
and little else disturbs them: handlers of every linear shape of the model in three processes
(private, 1st with segments, 2nd mapping the 1st's) taking turns (``stack``), and in one process
a private and a segment-reading handler per shape alternating step by step (``ab``, the finest
comparison).  Also: where the packed buffers sit in plain engines (heap or own mapping, page
offsets: what page replacement in place would face), a per-shape micro-benchmark of
``onednn_mm`` against ``F.linear`` (anonymous and memfd pages), and torch's profiler over a
batch-1 decode (plain, ``F.linear`` 1st and 2nd): where ``F.linear``'s time goes.

The table goes to stdout, the JSON to ``benchmarks/results/cpu_decode.json`` (and the last line
with ``--json``).  CPU flags and the vLLM extension that runs are printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)
from harness.machine import cpu_flags  # noqa: E402
from harness.results import write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time",
    "The three primary colors are", "import numpy as np\n", "A haiku about the sea:", "The largest planet is",
]
LLAMA_1B = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 2048, "intermediate_size": 5632,
            "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
            "max_position_embeddings": 2048}
BATCHES = (1, 8)


# ----------------------------------------------------------------------------------------- child
def _model_of(worker):
    return getattr(worker, "worker", worker).model_runner.model


def _placement(address: int, nbytes: int) -> dict:
    """Where a buffer sits (page replacement in place, the way not taken, needs whole pages)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                where = parts[5] if len(parts) > 5 else "anonymous"
                own = where == "anonymous" and hi - lo <= nbytes + (2 << 12)
                first, last = -(-address // 4096) * 4096, (address + nbytes) // 4096 * 4096
                return {"where": "own mapping" if own else where, "page_offset": address % 4096,
                        "whole_page_bytes": max(0, last - first)}
    return {"where": "unmapped", "page_offset": address % 4096, "whole_page_bytes": 0}


def _packed_state(worker) -> dict:
    """Every handler's packed weight: name -> {nbytes, layout tag, N, K, placement}."""
    from vllm_dedup.engine import onednn

    out = {}
    for name, handler in onednn.handlers_in(_model_of(worker)):
        packed = onednn.find_packed(handler)
        out[name] = {"nbytes": packed.nbytes, "tag": packed.layout.tag, "n": handler.n, "k": handler.k,
                     **_placement(packed.address, packed.nbytes)}
    return out


def _vmstat() -> dict[str, int]:
    """The machine's major faults and pages scanned for reclaim so far (/proc/vmstat): what
    other processes' memory pressure did meanwhile."""
    out = {"pgmajfault": 0, "pgscan": 0}
    with open("/proc/vmstat") as f:
        for line in f:
            key, value = line.split()
            if key == "pgmajfault":
                out["pgmajfault"] = int(value)
            elif key in ("pgscan_kswapd", "pgscan_direct"):
                out["pgscan"] += int(value)
    return out


def _child(argv: list[str]) -> None:
    model, fmt, extra, core = argv[0], argv[1], json.loads(argv[2]), argv[3]
    dtype = argv[4] if len(argv) > 4 else "bfloat16"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = core
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model, load_format=fmt, dtype=dtype, max_model_len=512, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, seed=0, **({"model_loader_extra_config": extra} if extra else {}))
    info = {"load_seconds": round(time.perf_counter() - started, 1)}
    if fmt == "auto":
        info["packed"] = llm.collective_rpc(_packed_state)[0]
    print("OK " + json.dumps(info), flush=True)

    def timed(prompts, tokens):
        """(wall seconds, CPU seconds of this process, token ids)."""
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        start, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return (time.perf_counter() - start, time.process_time() - cpu,
                [list(o.outputs[0].token_ids) for o in outs])

    for batch in BATCHES:  # warm-up: first-call costs stay out of the figures
        timed(PROMPTS[:batch], 4)
    for line in sys.stdin:
        req = json.loads(line)
        if "decode" in req:
            batch, tokens = req["decode"]
            prompts = PROMPTS[:batch]
            firsts = [timed(prompts, 1) for _ in range(2)]
            before, vm = resource.getrusage(resource.RUSAGE_SELF), _vmstat()
            wall, _, ids = timed(prompts, tokens + 1)
            after, vm_after = resource.getrusage(resource.RUSAGE_SELF), _vmstat()
            wall -= min(f[0] for f in firsts)
            reply = {"rate": batch * tokens / max(wall, 1e-9), "ids": ids,
                     "faults": {"minor": after.ru_minflt - before.ru_minflt, "major": after.ru_majflt - before.ru_majflt,
                                "machine_major": vm_after["pgmajfault"] - vm["pgmajfault"],
                                "machine_scanned": vm_after["pgscan"] - vm["pgscan"]}}
        elif req.get("trim"):
            import ctypes
            import gc

            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/status") as status:
                anon = next(int(line.split()[1]) << 10 for line in status if line.startswith("RssAnon:"))
            reply = {"rss_anon": anon}
        elif "profile" in req:
            import torch

            batch, tokens = req["profile"]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                timed(PROMPTS[:batch], tokens)
            events = prof.key_averages()
            total = sum(e.self_cpu_time_total for e in events) or 1
            per_token = batch * tokens
            reply = {"ms_per_token": round(total / 1e3 / per_token, 3),
                     "top": [{"op": e.key, "share": round(e.self_cpu_time_total / total, 3),
                              "ms_per_token": round(e.self_cpu_time_total / 1e3 / per_token, 3),
                              "calls_per_token": round(e.count / per_token, 1)}
                             for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]]}
        else:
            reply = {"error": f"unknown request {req}"}
        print("OK " + json.dumps(reply), flush=True)


# ---------------------------------------------------------------------------------------- parent
class Engine:
    """One benchmark engine in a child process (`harness.procs.PeerProcess`)."""

    dtype = "bfloat16"  # of every engine (`main`'s --dtype)
    env: dict = {}  # for every engine: --isa avx2 holds oneDNN and torch to AVX2

    def __init__(self, label: str, model: Path, fmt: str, extra: dict | None, core: str):
        from harness.procs import PeerProcess

        self.label = label
        self.proc = PeerProcess([__file__, "--child", model, fmt, json.dumps(extra or {}), core, self.dtype], label,
                                env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                     "VLLM_LOGGING_STREAM": "ext://sys.stderr", **self.env})
        print(f"  starting {label} ...", file=sys.stderr, flush=True)
        self.info = self.proc.read_json(timeout_s=900)
        self.rates: dict[int, list[float]] = {b: [] for b in BATCHES}
        self.faults: list[dict] = []
        self.ids: dict[int, list] = {}

    def ask(self, request: dict, timeout_s: float = 1800) -> dict:
        self.proc.send(request)
        return self.proc.read_json(timeout_s=timeout_s)

    def decode(self, batch: int, tokens: int) -> None:
        reply = self.ask({"decode": [batch, tokens]})
        self.rates[batch].append(reply["rate"])
        self.faults.append(reply["faults"])
        self.ids[batch] = reply["ids"]

    def load(self) -> dict:
        """This engine's load report, as the registry keeps it (dedup engines)."""
        from vllm_dedup.registry.client import registry_stats

        return registry_stats().engine(self.proc.pid).load

    def memory(self) -> tuple[int, int]:
        """(PSS, RssAnon) in bytes, after ``malloc_trim``."""
        from harness.procs import pss_bytes

        anon = self.ask({"trim": True})["rss_anon"]
        return pss_bytes(self.proc.pid), anon

    def stop(self) -> None:
        self.proc.end(120)


Rates = dict[int, list[float]]  # batch -> tokens/s of each round


def _rounds(engines: list[Engine], rounds: int, tokens: int) -> dict[str, Rates]:
    """``rounds`` rounds of each batch, the engines taking turns (the order flips each round);
    returns each engine's rates of these rounds alone (label -> batch -> tokens/s): an engine
    measured in two phases must be compared with its partner in each on that phase's rounds."""
    begin = {engine.label: {b: len(engine.rates[b]) for b in BATCHES} for engine in engines}
    for r in range(rounds):
        for batch in BATCHES:
            for engine in engines if r % 2 == 0 else engines[::-1]:
                print(f"  round {r + 1}: {engine.label}, batch {batch}", file=sys.stderr, flush=True)
                engine.decode(batch, tokens)
    return {e.label: {b: e.rates[b][begin[e.label][b]:] for b in BATCHES} for e in engines}


def _profiles(engines: list[Engine], tokens: int) -> dict[str, dict]:
    """Torch's profiler over a batch-1 decode, each engine twice in turn; the least disturbed
    run (fewest milliseconds per token) of each is kept."""
    out: dict[str, dict] = {}
    for _ in range(2):
        for engine in engines:
            got = engine.ask({"profile": [1, tokens]})
            if engine.label not in out or got["ms_per_token"] < out[engine.label]["ms_per_token"]:
                out[engine.label] = got
    return out


def _ratio(a: Rates, b: Rates, batch: int) -> float:
    """a's best rate over b's, both from the same rounds (`_rounds`): other processes on the
    machine only ever slow a measurement down, so the best of a few is the least disturbed."""
    return max(a[batch]) / max(b[batch])


def _paired(a: Rates, b: Rates, batch: int) -> float:
    """The median over rounds of a's rate over b's in the same round (back to back)."""
    return statistics.median(x / y for x, y in zip(a[batch], b[batch]))


def measure_model(name: str, model: Path, rounds: int, tokens: int, core: str, quick: bool = False) -> dict:
    result: dict = {"model": name, "path": str(model), "rows": []}
    rows = result["rows"]

    def row(label, engine, rates, ratio_to_plain, plain, extra, paired=None):
        """A row of ``engine``, its figures from ``rates``: the phase its ratios come from."""
        paired = paired or ratio_to_plain
        rows.append({"case": label,
                     **{f"tokens_per_s_b{b}": round(max(rates[b]), 2) for b in BATCHES},
                     "all_rounds": {b: [round(x, 2) for x in rates[b]] for b in BATCHES},
                     "paired_median_vs_plain": {b: round(paired[b], 3) for b in BATCHES},
                     "faults_per_round": engine.faults,
                     **{f"vs_plain_b{b}": round(ratio_to_plain[b], 3) for b in BATCHES},
                     "same_tokens": all(engine.ids[b] == plain.ids[b] for b in BATCHES), **extra})

    print(f"{name}: plain and dedup 1st", file=sys.stderr, flush=True)
    plain = Engine("plain", model, "auto", None, core)
    packed_info = plain.info["packed"]
    linear_bytes = sum(p["nbytes"] for p in packed_info.values())
    packed = {"share_group": f"packed-{name}"}  # cpu_linear="packed", the default
    first = Engine("dedup 1st", model, "dedup", packed, core)
    phase = _rounds([plain, first], rounds, tokens)
    plain_rates, first_rates = phase["plain"], phase["dedup 1st"]
    pss_plain, anon_plain = plain.memory()
    one = {b: 1.0 for b in BATCHES}
    first_vs_plain = {b: _ratio(first_rates, plain_rates, b) for b in BATCHES}
    first_paired = {b: _paired(first_rates, plain_rates, b) for b in BATCHES}
    row("plain (oneDNN, private)", plain, plain_rates, one, plain, {"pss_mb": round(pss_plain / 1e6),
                                                         "rss_anon_mb": round(anon_plain / 1e6),
                                                         "start_s": plain.info["load_seconds"]})
    plain.stop()

    print(f"{name}: dedup 1st and 2nd", file=sys.stderr, flush=True)
    second = Engine("dedup 2nd", model, "dedup", packed, core)
    load1, load2 = first.load(), second.load()
    phase = _rounds([first, second], rounds, tokens)
    (pss_1, _), (pss_2, anon_2) = first.memory(), second.memory()
    pss_pair = pss_1 + pss_2
    # The second against the first in these rounds, times the first against plain in its own.
    second_vs_plain = {b: _ratio(phase["dedup 2nd"], phase["dedup 1st"], b) * first_vs_plain[b] for b in BATCHES}
    second_paired = {b: _paired(phase["dedup 2nd"], phase["dedup 1st"], b) * first_paired[b] for b in BATCHES}
    row("dedup 1st (packed oneDNN)", first, first_rates, first_vs_plain, plain,
        {"start_s": first.info["load_seconds"], "load_path": load1["load_path"],
         "packed_published_mb": round(load1["published_bytes"] / 1e6)}, first_paired)
    row("dedup 2nd (packed oneDNN)", second, phase["dedup 2nd"], second_vs_plain, plain,
        {"start_s": second.info["load_seconds"], "load_path": load2["load_path"],
         "packed_handlers_mapped": load2["packed_tensors"], "mapped_mb": round(load2["shared_bytes"] / 1e6),
         "saved_share_of_linear": round((anon_plain - anon_2) / linear_bytes, 3) if linear_bytes else None,
         "pair_pss_saved_share_of_linear": (round((2 * pss_plain - pss_pair) / linear_bytes, 3)
                                            if linear_bytes else None)}, second_paired)
    second.stop()
    if quick:
        _fine_tune_phase(name, model, rounds, tokens, core, row)
        first.stop()
        result.update(linear_bytes=linear_bytes, handlers=len(packed_info), pss_plain=pss_plain,
                      pss_packed_pair=pss_pair)
        return result
    first.stop()

    print(f"{name}: plain and F.linear 1st", file=sys.stderr, flush=True)
    plain = Engine("plain", model, "auto", None, core)
    result["placement"] = _placement_summary(packed_info, plain.info["packed"])
    share = {"cpu_linear": "plain", "share_group": f"flinear-{name}"}
    flin1 = Engine("F.linear 1st", model, "dedup", share, core)
    phase = _rounds([plain, flin1], rounds, tokens)
    flin1_rates = phase["F.linear 1st"]
    pss_plain_again, anon_plain_again = plain.memory()
    profiles = result["profile_b1"] = _profiles([plain, flin1], tokens)
    f1_vs_plain = {b: _ratio(flin1_rates, phase["plain"], b) for b in BATCHES}
    f1_paired = {b: _paired(flin1_rates, phase["plain"], b) for b in BATCHES}
    plain.stop()
    print(f"{name}: F.linear 1st and 2nd", file=sys.stderr, flush=True)
    flin2 = Engine("F.linear 2nd", model, "dedup", share, core)
    phase = _rounds([flin1, flin2], rounds, tokens)
    (pss_f1, _), (pss_f2, anon_f2) = flin1.memory(), flin2.memory()  # before any profile: its buffers stay
    profiles.update(_profiles([flin2], tokens))
    pss_flin = pss_f1 + pss_f2
    f2_vs_plain = {b: _ratio(phase["F.linear 2nd"], phase["F.linear 1st"], b) * f1_vs_plain[b] for b in BATCHES}
    f2_paired = {b: _paired(phase["F.linear 2nd"], phase["F.linear 1st"], b) * f1_paired[b] for b in BATCHES}
    row("F.linear 1st (plain)", flin1, flin1_rates, f1_vs_plain, plain,
        {"start_s": flin1.info["load_seconds"], "load_path": flin1.load()["load_path"]}, f1_paired)
    row("F.linear 2nd (plain)", flin2, phase["F.linear 2nd"], f2_vs_plain, plain,
        {"start_s": flin2.info["load_seconds"], "load_path": flin2.load()["load_path"],
         "saved_share_of_linear": round((anon_plain_again - anon_f2) / linear_bytes, 3),
         "pair_pss_saved_share_of_linear": round((2 * pss_plain_again - pss_flin) / linear_bytes, 3)}, f2_paired)
    flin1.stop()
    flin2.stop()
    print(f"{name}: the mechanism alone (handlers in three processes, no engine)", file=sys.stderr, flush=True)
    shapes = [(p["n"], p["k"]) for p in packed_info.values()]
    result["stack"] = stack_benchmark(shapes, core)
    result["ab"] = ab_benchmark(shapes, core, steps=max(40, int(4e10 // linear_bytes)))
    result.update(linear_bytes=linear_bytes, handlers=len(packed_info), pss_plain=pss_plain,
                  pss_packed_pair=pss_pair, pss_flinear_pair=pss_flin, pss_plain_second_phase=pss_plain_again,
                  shapes=sorted({(p["tag"], p["nbytes"]) for p in packed_info.values()}))
    return result


def _fine_tune_phase(name: str, model: Path, rounds: int, tokens: int, core: str, row) -> None:
    """The last-layers fine-tune of ``model``: a dedup engine started while the base's first
    dedup engine is up (it maps the unchanged layers), against a plain engine of the fine-tune,
    taking turns."""
    from harness.variants import cached_variant

    tuned = cached_variant(model, "last-layers")
    print(f"{name}: plain fine-tune and dedup fine-tune", file=sys.stderr, flush=True)
    plain = Engine("plain fine-tune", tuned, "auto", None, core)
    engine = Engine("dedup fine-tune", tuned, "dedup", {"share_group": f"packed-{name}"}, core)
    load = engine.load()
    phase = _rounds([plain, engine], rounds, tokens)
    rates, plain_rates = phase["dedup fine-tune"], phase["plain fine-tune"]
    row("dedup fine-tune (vs plain fine-tune)", engine, rates, {b: _ratio(rates, plain_rates, b) for b in BATCHES},
        plain,
        {"start_s": engine.info["load_seconds"], "load_path": load["load_path"],
         "mapped_mb": round(load["shared_bytes"] / 1e6), "read_mb": round(load["checkpoint_bytes_read"] / 1e6)},
        {b: _paired(rates, plain_rates, b) for b in BATCHES})
    plain.stop()
    engine.stop()


def _placement_summary(plain: dict, other: dict) -> dict:
    """What page replacement in place would face, from two engines' packed buffers."""
    total = sum(p["nbytes"] for p in plain.values())
    same_offset = sum(p["nbytes"] for name, p in plain.items()
                      if name in other and other[name]["page_offset"] == p["page_offset"])
    where: dict[str, int] = {}
    for p in plain.values():
        where[p["where"]] = where.get(p["where"], 0) + p["nbytes"]
    return {"bytes_by_place": where, "whole_page_share": round(sum(p["whole_page_bytes"] for p in plain.values())
                                                               / total, 4),
            "same_page_offset_in_two_engines_share": round(same_offset / total, 4),
            "page_aligned_share": round(sum(p["nbytes"] for p in plain.values() if p["page_offset"] == 0) / total, 4)}


def _stack_child(argv: list[str]) -> None:
    """One process holding a handler per (N, K) of a model (seeded bf16 weights), answering
    ``{"forward": 1}`` (every handler once at M=1, as a decode step does: the least milliseconds
    of 5 such steps, and the page faults), ``{"publish": 1}`` (segments in place, their descriptors) and ``{"attach": [pid, fds]}``."""
    import torch
    from vllm import _custom_ops as ops

    from vllm_dedup.engine import heap, onednn
    from vllm_dedup.segments.host import HostSegment

    os.sched_setaffinity(0, {int(c) for c in argv[0].split(",")})
    torch.set_num_threads(1)
    shapes = json.loads(argv[1])
    handlers = []
    for i, (n, k) in enumerate(shapes):
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        handlers.append(ops.create_onednn_mm(weight.t(), 32))
        del weight
    inputs = {k: torch.randn(1, k).to(torch.bfloat16) for _, k in shapes}
    held = []
    print("OK {}", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("publish"):
            fds = []
            for handler in handlers:
                packed = onednn.find_packed(handler)
                seg = HostSegment.create_packed([(torch.frombuffer(packed.view(), dtype=torch.uint8), 0)],
                                                packed.nbytes)
                onednn.install(packed, seg.tensor(0, torch.uint8, (packed.nbytes,), (1,)))
                held.append(seg)
                fds.append(seg.fileno())
            reply = {"fds": fds}
        elif "attach" in req:
            pid, fds = req["attach"]
            for handler, fd in zip(handlers, fds):
                packed = onednn.find_packed(handler)
                seg = HostSegment.attach(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC), packed.nbytes)
                seg.close_fd()
                onednn.install(packed, seg.tensor(0, torch.uint8, (packed.nbytes,), (1,)))
            reply = {}
        else:  # the least of 5 steps
            before, steps = resource.getrusage(resource.RUSAGE_SELF), []
            for _ in range(5):
                start = time.perf_counter()
                for handler, (_, k) in zip(handlers, shapes):
                    ops.onednn_mm(handler, inputs[k], None)
                steps.append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_SELF)
            reply = {"ms": min(steps) * 1e3, "minor_faults": after.ru_minflt - before.ru_minflt}
        if "forward" not in req:
            heap.trim()
        print("OK " + json.dumps(reply), flush=True)


def _ab_child(argv: list[str]) -> None:
    """Prints ``OK {json}``: in one process, two handlers per (N, K) of a model (the same seeded
    weights), one private and one reading a segment; decode steps' linears (every handler at
    M=1) alternate between the two sets, ``argv[2]`` times each."""
    import torch
    from vllm import _custom_ops as ops

    from vllm_dedup.engine import heap, onednn
    from vllm_dedup.segments.host import HostSegment

    os.sched_setaffinity(0, {int(c) for c in argv[0].split(",")})
    torch.set_num_threads(1)
    shapes, steps = json.loads(argv[1]), int(argv[2])
    private, shared = [], []
    for i, (n, k) in enumerate(shapes):
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        private.append(ops.create_onednn_mm(weight.t(), 32))
        shared.append(ops.create_onednn_mm(weight.t(), 32))
        del weight
        packed = onednn.find_packed(shared[-1])
        seg = HostSegment.create_packed([(torch.frombuffer(packed.view(), dtype=torch.uint8), 0)], packed.nbytes)
        seg.close_fd()
        onednn.install(packed, seg.tensor(0, torch.uint8, (packed.nbytes,), (1,)))
    heap.trim()
    inputs = {k: torch.randn(1, k).to(torch.bfloat16) for _, k in shapes}

    def step(handlers) -> float:
        start = time.perf_counter()
        for handler, (_, k) in zip(handlers, shapes):
            ops.onednn_mm(handler, inputs[k], None)
        return time.perf_counter() - start

    for handlers in (private, shared, private, shared):  # warm-up
        step(handlers)
    t_private, t_shared = [], []
    for i in range(steps):
        for handlers, times in ((private, t_private), (shared, t_shared))[:: 1 if i % 2 else -1]:
            times.append(step(handlers))
    print("OK " + json.dumps({
        "private_ms_best": round(min(t_private) * 1e3, 2), "shared_ms_best": round(min(t_shared) * 1e3, 2),
        "shared_speed_paired_median": round(statistics.median(p / s for p, s in zip(t_private, t_shared)), 3),
        "shared_speed_best": round(min(t_private) / min(t_shared), 3), "steps": steps}), flush=True)


def ab_benchmark(shapes: list[tuple[int, int]], core: str, steps: int) -> dict:
    """`_ab_child` in a child process: the finest comparison of the kernel on a segment and on
    its private buffer (no engine, no second process, alternating step by step)."""
    from harness.procs import PeerProcess

    proc = PeerProcess([__file__, "--ab-child", core, json.dumps(shapes), steps], "a/b")
    try:
        return proc.read_json(timeout_s=1800)
    finally:
        proc.end(60)


def stack_benchmark(shapes: list[tuple[int, int]], core: str, rounds: int = 11) -> dict:
    """The mechanism without an engine: three processes hold handlers of a model's every linear
    shape (the same seeded weights): ``private`` as vLLM leaves them, ``1st`` with its packed
    weights moved into segments, ``2nd`` mapping the first's.  They take turns running all
    handlers once at M=1 (a decode step's linears), ``rounds`` times; per process the least
    disturbed (fastest) step and the paired median ratios."""
    from harness.procs import PeerProcess

    procs = {name: PeerProcess([__file__, "--stack-child", core, json.dumps(shapes)], f"stack {name}")
             for name in ("private", "1st", "2nd")}
    try:
        for proc in procs.values():
            proc.read_json(timeout_s=900)

        def ask(name, request):
            procs[name].send(request)
            return procs[name].read_json(timeout_s=900)

        fds = ask("1st", {"publish": 1})["fds"]
        ask("2nd", {"attach": [procs["1st"].pid, fds]})
        times: dict[str, list[float]] = {name: [] for name in procs}
        faults = 0
        for r in range(rounds):
            for name in procs if r % 2 == 0 else list(procs)[::-1]:
                got = ask(name, {"forward": 1})
                times[name].append(got["ms"])
                faults += got["minor_faults"] if r else 0
        return {"ms_best": {n: round(min(t), 2) for n, t in times.items()},
                "vs_private_paired_median": {n: round(statistics.median(p / x for p, x in zip(times["private"], t)), 3)
                                             for n, t in times.items()},
                "vs_private_best": {n: round(min(times["private"]) / min(t), 3) for n, t in times.items()},
                "all_ms": {n: [round(x, 1) for x in t] for n, t in times.items()},
                "minor_faults_after_first_round": faults}
    finally:
        for proc in procs.values():
            proc.end(60)


def microbenchmark(shapes: list[tuple[int, int]], repeats: int = 30) -> list[dict]:
    """Per (N, K): milliseconds of CPU time per call at M=1 (the least of ``repeats``) of vLLM's
    onednn_mm, F.linear on an anonymous weight, and F.linear on a weight in a sealed memfd
    mapping; one thread."""
    import torch
    from vllm import _custom_ops as ops

    from vllm_dedup.segments.host import HostSegment

    torch.set_num_threads(1)
    out = []
    for n, k in shapes:
        weight = torch.randn(n, k).to(torch.bfloat16)
        seg = HostSegment.create_packed([(weight.view(torch.uint8).reshape(-1), 0)], weight.numel() * 2)
        seg.close_fd()
        mapped = seg.tensor(0, torch.bfloat16, (n, k), (k, 1))
        handler = ops.create_onednn_mm(weight.t(), 32)
        x = torch.randn(1, k).to(torch.bfloat16)
        cases = {"onednn_mm": lambda: ops.onednn_mm(handler, x, None),
                 "F.linear anon": lambda: torch.nn.functional.linear(x, weight),
                 "F.linear memfd": lambda: torch.nn.functional.linear(x, mapped)}
        times = {c: [] for c in cases}
        for _ in range(repeats):
            for c, fn in cases.items():
                start = time.thread_time()
                fn()
                times[c].append(time.thread_time() - start)
        row = {"n": n, "k": k, **{c: round(min(v) * 1e3, 3) for c, v in times.items()}}
        row["GB/s onednn_mm"] = round(n * k * 2 / (row["onednn_mm"] / 1e3) / 1e9, 1)
        out.append(row)
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--ab-child":
        _ab_child(sys.argv[2:])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--stack-child":
        _stack_child(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,llama-1.2b")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--core", default="1", help="the CPU core(s) every engine's OpenMP threads run on")
    parser.add_argument("--no-micro", action="store_true", help="skip the per-shape microbenchmark")
    parser.add_argument("--quick", action="store_true",
                        help="plain, the packed dedup engines and a fine-tune only (no F.linear, mechanism, micro)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--isa", choices=("avx2",), help="hold oneDNN and torch to this ISA in every engine")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    Engine.dtype = args.dtype
    if args.isa == "avx2":
        Engine.env = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}

    from harness.sample_models import random_model, smollm2_hf
    from vllm_dedup.engine import onednn
    from vllm_dedup.registry.client import shutdown_registry

    support = onednn.probe(args.dtype)  # in this process: without --isa's hold (the engines have it)
    flags = cpu_flags()
    print(f"CPU flags: {' '.join(flags)}; {os.cpu_count()} CPUs; engines on core(s) {args.core}; "
          f"dtype {args.dtype}; ISA {'held to ' + args.isa if args.isa else 'native'}")
    print(f"packed sharing (probed in this process, at the native ISA): "
          f"{'supported' if support.supported else 'NOT supported: ' + support.reason} {support.details}")
    models = {"smollm2": smollm2_hf,
              "llama-1.2b": lambda: random_model("llama-1.2b", LLAMA_1B, dtype="bfloat16", max_shard_size="1GB")}
    result = {"cpu_flags": flags, "cpus": os.cpu_count(), "core": args.core, "probe": support.details,
              "rounds": args.rounds, "tokens": args.tokens, "dtype": args.dtype, "isa": args.isa or "native",
              "quick": args.quick, "models": []}
    # (N, K) of SmolLM2's qkv, o, gate_up, down, head, then the 1.2B Llama's
    micro_shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576),
                    (2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (49152, 2048)]
    paths = {name: models[name]() for name in args.models.split(",")}  # built once, kept in the usual cache
    with tempfile.TemporaryDirectory(prefix="vllm-dedup-bench-") as run_dir:
        os.environ["VLLM_DEDUP_RUNTIME_DIR"] = str(Path(run_dir) / "run")
        os.environ["VLLM_DEDUP_CACHE_DIR"] = str(Path(run_dir) / "cache")
        try:
            for name, path in paths.items():
                result["models"].append(measure_model(name, path, args.rounds, args.tokens, args.core, args.quick))
        finally:
            shutdown_registry()
    quick = args.no_micro or args.quick
    result["microbenchmark_ms_per_call_m1"] = [] if quick else microbenchmark(micro_shapes)

    for m in result["models"]:
        print(f"\n{m['model']}: {m['handlers']} packed weights, {m['linear_bytes'] / 1e6:.0f} MB; "
              f"decode tokens/s (wall), best of {args.rounds} rounds x {args.tokens} tokens")
        print(f"{'case':<28}{'b=1 tok/s':>10}{'vs plain':>9}{'b=8 tok/s':>10}{'vs plain':>9}{'same tokens':>12}"
              f"{'saved/linear':>13}{'start s':>8}  path")
        for r in m["rows"]:
            saved, load = r.get("saved_share_of_linear"), r.get("start_s")
            print(f"{r['case']:<28}{r['tokens_per_s_b1']:>10.2f}{r['vs_plain_b1']:>9.3f}{r['tokens_per_s_b8']:>10.2f}"
                  f"{r['vs_plain_b8']:>9.3f}{str(r['same_tokens']):>12}{'-' if saved is None else f'{saved:.1%}':>13}"
                  f"{'-' if load is None else f'{load:.1f}':>8}  {r.get('load_path', '-')}")
        print("paired medians vs plain (b=1, b=8): " + "; ".join(
            f"{r['case']}: {r['paired_median_vs_plain'][1]:.3f}, {r['paired_median_vs_plain'][8]:.3f}"
            for r in m["rows"][1:]))
        if args.quick:
            continue
        st = m["stack"]
        print(f"mechanism alone, one decode step's linears: best ms {st['ms_best']}, vs private (paired median) "
              f"{st['vs_private_paired_median']}, minor faults after warm-up {st['minor_faults_after_first_round']}")
        ab = m["ab"]
        print(f"mechanism in one process, {ab['steps']} alternating steps: private {ab['private_ms_best']} ms, "
              f"segment {ab['shared_ms_best']} ms; segment speed / private: paired median "
              f"{ab['shared_speed_paired_median']}, best {ab['shared_speed_best']}")
        print(f"placement of plain packed buffers: {m['placement']}")
        for who, prof in m["profile_b1"].items():
            print(f"profile at batch 1, {who}: {prof['ms_per_token']} ms per token; " + ", ".join(
                f"{t['op']} {t['ms_per_token']} ms ({t['calls_per_token']}/token)" for t in prof["top"][:6]))
    print("\nmicrobenchmark, ms per call at M=1 (one thread):")
    for r in result["microbenchmark_ms_per_call_m1"]:
        print("  " + ", ".join(f"{k}={v}" for k, v in r.items()))
    suffix = "" if not args.quick else f"-quick-{args.dtype}-{args.isa or 'native'}"
    write_results(RESULTS / f"cpu_decode{suffix}.json", result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
