"""What loading costs, plain vs dedup, in one run: the N-th engine of a model and a fine-tune.

    .venv/bin/python benchmarks/load_time.py [--model DIR | --preset {smollm2,smollm2-fp32,llama-1.2b}]
                                             [--no-serve] [--profile] [--cpu-linear MODE] [--no-in-place] [--huge-pages]
                                             [--isa avx2]
                                             [--rounds N] [--json]

Engines (real vLLM engines on the CPU backend, one process each, started in turn):

1. ``plain``: ``--load-format auto``;
2. ``dedup first``: the first dedup engine (no recipe yet: loads as usual, publishes, leaves a
   recipe);
3. ``dedup second``: a second dedup engine of the same model while the first is up (the
   ``full`` path);
4. ``dedup last-layers``: the model with its last two decoder layers retrained
   (`harness.variants`), its keys in the manifest cache (scanned first, as `vllm-dedup scan`
   does), while the first is up (the ``modules`` path); and a plain engine of it for its
   reference tokens.

For each: ``load_s`` (wall time of vLLM's ``get_model``, i.e. the loader's ``load_model``,
measured in the engine's process the same way for every load format), ``read_bytes`` (checkpoint
bytes the engine read, as it reports; plain: the checkpoint's tensor bytes), ``peak_bytes``
(the largest growth of new memory during the load, sampled every 2 ms the same way for every
engine: the process's private memory plus the machine's shared memory, so the segments a dedup
engine makes count from the moment they exist and the ones it maps from another engine do not;
``private_peak_bytes``: private memory alone; ``engine_peak_bytes``: a dedup engine's own
figure, `vllm_dedup.engine.meter`), ``gc_s`` (the garbage collector's pauses within ``load_s``:
vLLM's loader collects the heap once after loading the weights, which a dedup load does with
the heap frozen, so the ``no gc`` column compares the loads without them), ``user_s`` and
``system_s`` (the CPU time of the engine's threads within ``load_s``, in user space and in the
kernel: page faults and shared memory filled show in the latter; a registry daemon the first
dedup engine starts is another process and is not counted) and whether its greedy tokens equal
the plain engine's.  Then ``vllm serve`` time-to-ready for a restart: the server is started,
stopped and started again, plain, then dedup with ``keep_warm_s`` (the second start maps).

The second engine's final tensors are compared with the first's (`harness.oracle`: the first
dedup engine, alone in its group, loads as a plain load with the same options does).

``--rounds N`` measures ``plain`` and ``dedup first`` N times, alternating which starts first
(each first engine alone, with a new registry), and reports their medians, each round's figures
beside them in the JSON (``load_s_rounds``, ``gc_s_rounds``, ``peak_bytes_rounds``, ``user_s_rounds``,
``system_s_rounds``): on a VM whose
fresh memory comes from its host, one pair's ratio moves by 10-20% from run to run.

``--isa avx2`` starts every engine with oneDNN and torch held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``,
``ATEN_CPU_CAPABILITY=avx2``), the branch an AVX2-only machine takes: there vLLM's bfloat16
linears cannot be packed and run ``F.linear``, float32 ones are packed.

Models (``--preset``): ``smollm2-fp32`` (the default), SmolLM2-135M-Instruct saved as float32
(538 MB, served as float32), built once from the packaged checkpoint; ``smollm2``, the demo's
SmolLM2-135M-Instruct as converted (bfloat16, 269 MB); ``llama-1.2b``, a
random-weight Llama of 1.17B parameters (bfloat16, 2.34 GB in three shards,
`harness.sample_models.llama_1b`), made at the first run (about a minute).  The page cache is
warm for every engine (the checkpoints are read once before the plain engine starts): the
plain figures are a plain load's best case.  ``--no-serve`` leaves out the ``vllm serve`` restarts; ``--profile [first|second]``
runs that dedup engine's ``get_model`` (the second's by default) under cProfile and prints where its time goes (the whole
profile is written beside the JSON).  Prints the machine's CPU flags, how its kernel hands out
memory and how fast fresh memory was before the engines started (`harness.machine`, Note [fresh
memory]: load times move with it between days), and a table; writes
``benchmarks/results/load_time.json`` (``load_time-<preset>.json`` for another preset;
``--json``: also the last line of stdout).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.engines import PROFILE_ENV, PROMPTS, EngineProcess, ServeProcess  # noqa: E402
from harness.machine import describe, fresh_memory, machine  # noqa: E402
from harness.results import write_results  # noqa: E402
from harness.oracle import differences  # noqa: E402
from harness.variants import cached_variant  # noqa: E402
from vllm_dedup.registry.client import registry_stats, shutdown_registry  # noqa: E402
from vllm_dedup.scan.files import scan_model  # noqa: E402
from vllm_dedup.checkpoint.manifest import ManifestCache, default_cache_dir  # noqa: E402
from vllm_dedup.scan.report import Report  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MB = 1e6


def _smollm2_fp32() -> tuple[Path, str]:
    from harness.sample_models import smollm2_hf

    return cached_variant(smollm2_hf(), "fp32"), "float32"


def _llama_1b() -> tuple[Path, str]:
    from harness.sample_models import llama_1b

    return llama_1b(), "bfloat16"


def _smollm2() -> tuple[Path, str]:
    from harness.sample_models import smollm2_hf

    return smollm2_hf(), "bfloat16"


PRESETS = {"smollm2-fp32": _smollm2_fp32, "smollm2": _smollm2, "llama-1.2b": _llama_1b}  # -> (folder, dtype)
ISA_ENV = {"avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


def measure(engine: EngineProcess, reference: list | None, checkpoint_bytes: int) -> dict:
    stats = engine.load_stats()
    tokens = engine.generate()
    row = {"load_s": stats["seconds"], "gc_s": stats["gc_seconds"], "peak_bytes": stats["new_memory_peak_bytes"],
           "user_s": stats["user_seconds"], "system_s": stats["system_seconds"],
           "private_peak_bytes": stats["peak_bytes"], "read_bytes": checkpoint_bytes,
           "path": "-", "same_tokens": reference is None or tokens == reference}
    if engine.load_format == "dedup":
        load = registry_stats().engine(engine.pid).load
        row.update(path=load["load_path"], read_bytes=load["checkpoint_bytes_read"],
                   engine_load_s=load["load_seconds"], engine_peak_bytes=load["peak_bytes"])
    return row | {"tokens": tokens}


ENGINE_ENV: dict[str, str] = {}  # set by --isa for every engine of the run


def start(model: Path, load_format: str, dtype: str, core: int, extra: dict | None = None,
          env: dict | None = None) -> EngineProcess:
    return EngineProcess(model, load_format, extra=extra, core=core, dtype=dtype,
                         env={**ENGINE_ENV, **(env or {})}).wait_ready(900)


def profile_summary(path: Path, top: int = 25) -> list[str]:
    """The ``top`` functions of a cProfile dump by cumulative time, as text lines."""
    import io
    import pstats

    out = io.StringIO()
    pstats.Stats(str(path), stream=out).sort_stats("cumulative").print_stats(top)
    return [line for line in out.getvalue().splitlines() if line.strip()]


def serve_restart(model: Path, load_format: str, dtype: str, logs: Path, extra: dict | None = None) -> list[float]:
    """Seconds to ``/health`` of two ``vllm serve`` starts, one after the other.  Each server
    is stopped whatever happens (it runs in a process group of its own, which a Ctrl-C here
    does not reach)."""
    times = []
    for i in range(2):
        begin = time.monotonic()
        server = ServeProcess(model, load_format, logs / f"{load_format}-{i}.log", extra_config=extra, core=0,
                              dtype=dtype)
        try:
            server.wait_ready(600)
            times.append(time.monotonic() - begin)
            server.complete(PROMPTS[:1], max_tokens=4)
        finally:
            server.stop()
    return times


def warm_page_cache(*folders: Path) -> None:
    """Read every weight file of ``folders`` once, so the first engine (plain) does not pay cold
    reads that the later ones are spared."""
    buffer = bytearray(64 << 20)
    for folder in folders:
        for path in sorted(folder.glob("*.safetensors")):
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass


def more_rounds(model: Path, dtype: str, extra: dict | None, rows: dict, reference: list, rounds: int) -> None:
    """Measure ``plain`` and ``dedup first`` ``rounds - 1`` more times (odd rounds start the dedup
    engine first), and make their ``load_s``, ``gc_s`` and ``peak_bytes`` the medians of all rounds,
    keeping each round's in ``<figure>_rounds``."""
    import statistics

    figures = ("load_s", "gc_s", "peak_bytes", "user_s", "system_s")
    for name in ("plain", "dedup first"):
        for f in figures:
            rows[name][f"{f}_rounds"] = [rows[name][f]]
    for i in range(1, rounds):
        for name in (("dedup first", "plain") if i % 2 else ("plain", "dedup first")):
            engine = start(model, "auto" if name == "plain" else "dedup", dtype, 0,
                           None if name == "plain" else extra)
            try:
                row = measure(engine, reference, 0)
            finally:
                engine.stop()
                shutdown_registry()  # the next dedup engine is a first one again: no recipe, nothing resident
            rows[name]["same_tokens"] = rows[name]["same_tokens"] and row["same_tokens"]
            for f in figures:
                rows[name][f"{f}_rounds"].append(row[f])
    for name in ("plain", "dedup first"):
        for f in figures:
            rows[name][f] = statistics.median(rows[name][f"{f}_rounds"])


def run(model: Path, dtype: str, serve: bool = True, profile: Path | None = None, extra: dict | None = None,
        profiled: str | None = None, rounds: int = 1) -> dict:
    fresh = fresh_memory()  # before any engine: how fast this machine gives out new pages today
    tuned = cached_variant(model, "last-layers")
    cache = ManifestCache(default_cache_dir())
    scans = [scan_model(m, cache=cache, progress=False) for m in (model, tuned)]  # the variant's keys cached
    report = Report(scans)
    model_bytes = report.model_bytes(scans[0])
    tuned_unique = report.model_bytes(scans[1]) - report.shared_with_earlier_bytes()[1]
    rows: dict[str, dict] = {}
    logs = Path(tempfile.mkdtemp(prefix="load-time-"))
    warm_page_cache(model, tuned)
    plain = start(model, "auto", dtype, 0)
    rows["plain"] = measure(plain, None, model_bytes)
    reference = rows["plain"].pop("tokens")
    plain.stop()
    plain_tuned = start(tuned, "auto", dtype, 0)
    rows["plain last-layers"] = measure(plain_tuned, None, report.model_bytes(scans[1]))
    tuned_reference = rows["plain last-layers"].pop("tokens")
    plain_tuned.stop()
    profile_env = {PROFILE_ENV: str(profile)} if profile else None
    first = start(model, "dedup", dtype, 0, extra, env=profile_env if profiled == "first" else None)
    try:
        rows["dedup first"] = measure(first, reference, 0)
        (first_tensors,) = first.final_tensors()
        second = start(model, "dedup", dtype, 1, extra, env=profile_env if profiled == "second" else None)
        rows["dedup second"] = measure(second, reference, 0)
        (second_tensors,) = second.final_tensors()
        rows["dedup second"]["tensors_differing"] = len(differences(second_tensors, first_tensors))
        second.stop()
        variant = start(tuned, "dedup", dtype, 1, extra)
        rows["dedup last-layers"] = measure(variant, tuned_reference, 0)
        variant.stop()
    finally:
        first.stop()
        shutdown_registry()
    if rounds > 1:
        more_rounds(model, dtype, extra, rows, reference, rounds)
    for row in rows.values():
        row.pop("tokens", None)
    serve = {}
    if serve:
        try:
            serve = {"plain": serve_restart(model, "auto", dtype, logs),
                     "dedup": serve_restart(model, "dedup", dtype, logs, {**(extra or {}), "keep_warm_s": 600})}
        finally:
            shutdown_registry()  # its segments were kept warm for 600 s
    plain_s, plain_peak = rows["plain"]["load_s"], rows["plain"]["peak_bytes"]
    targets = {
        "first engine load_s <= plain + 10%": rows["dedup first"]["load_s"] <= 1.10 * plain_s,
        "first engine peak_bytes <= plain's + 5%": rows["dedup first"]["peak_bytes"] <= 1.05 * plain_peak,
        "second engine load_s <= 5% of plain": rows["dedup second"]["load_s"] <= 0.05 * plain_s,
        "second engine peak_bytes <= 2% of the model": rows["dedup second"]["peak_bytes"] <= 0.02 * model_bytes,
        "second engine's final tensors are the first's": rows["dedup second"]["tensors_differing"] == 0,
        "last-layers reads <= its unique bytes + 5%": rows["dedup last-layers"]["read_bytes"] <= 1.05 * tuned_unique,
    }
    return {"machine": machine(), "fresh_memory": fresh, "engine_env": ENGINE_ENV, "model": str(model), "dtype": dtype,
            "dedup_options": extra or {}, "rounds": rounds,
            "model_bytes": model_bytes,
            "last_layers_unique_bytes": tuned_unique, "engines": rows, "serve_ready_s": serve, "targets": targets,
            "profiled": profiled if profile else None, "profile": profile_summary(profile) if profile else []}


def print_table(result: dict) -> None:
    print(describe())
    fresh = result["fresh_memory"]  # harness.machine, Note [fresh memory]
    print(f"fresh memory before the engines: {fresh['memfd_gb_s']:.2f} GB/s into a memfd, "
          f"{fresh['anonymous_gb_s']:.2f} GB/s anonymous (median of {fresh['rounds']} fills of "
          f"{fresh['bytes'] >> 20} MiB)")
    if result.get("engine_env"):
        print("every engine's environment:", " ".join(f"{k}={v}" for k, v in result["engine_env"].items()))
    print(f"model {result['model']} ({result['dtype']}, {result['model_bytes'] / MB:.0f} MB of tensors); "
          f"dedup options {result.get('dedup_options') or 'default'}; "
          f"last-layers variant: {result['last_layers_unique_bytes'] / MB:.1f} MB of its own")
    print(f"{'engine':<20}{'path':>8}{'load s':>9}{'vs plain':>10}{'gc s':>7}{'no gc':>8}{'user s':>8}{'sys s':>7}"
          f"{'read MB':>10}{'peak MB':>10}  same tokens")
    plain = result["engines"]["plain"]
    plain_s, plain_work = plain["load_s"], plain["load_s"] - plain["gc_s"]
    for name, r in result["engines"].items():
        print(f"{name:<20}{r['path']:>8}{r['load_s']:>9.2f}{r['load_s'] / plain_s:>9.1%} {r['gc_s']:>7.2f}"
              f"{(r['load_s'] - r['gc_s']) / plain_work:>7.1%} {r['user_s']:>7.2f}{r['system_s']:>7.2f}"
              f"{r['read_bytes'] / MB:>10.1f}"
              f"{r['peak_bytes'] / MB:>10.1f}  {r['same_tokens']}")
    if result.get("rounds", 1) > 1:
        for name in ("plain", "dedup first"):
            r = result["engines"][name]
            print(f"{name}: median of {result['rounds']} rounds; load s "
                  + " ".join(f"{s:.2f}" for s in r["load_s_rounds"]) + "; peak MB "
                  + " ".join(f"{b / MB:.0f}" for b in r["peak_bytes_rounds"]))
    for fmt, (cold, again) in result["serve_ready_s"].items():
        print(f"vllm serve {fmt:<6} ready in {cold:.1f} s, restarted ready in {again:.1f} s")
    for target, ok in result["targets"].items():
        print(f"[{'met' if ok else 'MISSED'}] {target}")
    if result["profile"]:
        print(f"{result['profiled']} dedup engine's get_model, by cumulative time (cProfile):")
        print("\n".join(result["profile"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="HF folder (default: the preset's)")
    parser.add_argument("--preset", choices=PRESETS, default=None,
                        help="smollm2-fp32 (default) or llama-1.2b (random weights, bfloat16, 2.34 GB)")
    parser.add_argument("--dtype", default=None, help="engine dtype (default: the preset's; bfloat16 for --model)")
    parser.add_argument("--no-serve", action="store_true", help="leave out the vllm serve restarts")
    parser.add_argument("--profile", nargs="?", const="second", choices=("first", "second"), default=None,
                        help="profile this dedup engine's get_model (cProfile; default: the second)")
    parser.add_argument("--cpu-linear", choices=("packed", "plain", "private"), default=None,
                        help="the dedup engines' cpu_linear (default: the loader's, packed)")
    parser.add_argument("--no-in-place", action="store_true",
                        help="the dedup engines load into private memory and copy into segments (in_place: false)")
    parser.add_argument("--huge-pages", action="store_true",
                        help="the dedup engines ask for 2 MiB pages for their segments (huge_pages: true; it changes "
                             "something only where transparent_hugepage/shmem_enabled is advise)")
    parser.add_argument("--isa", choices=tuple(ISA_ENV), default=None,
                        help="hold every engine's oneDNN and torch to this ISA (the branch such a CPU takes)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure plain and the first dedup engine this many times; report medians")
    parser.add_argument("--json", action="store_true", help="also print the JSON result as the last line")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    ENGINE_ENV.update(ISA_ENV.get(args.isa, {}))
    if args.model is not None and args.preset is not None:
        parser.error("give --model or --preset, not both")
    if "VLLM_DEDUP_RUNTIME_DIR" not in os.environ:  # a private registry
        os.environ["VLLM_DEDUP_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="load-time-run-")
    name = "load_time.json"
    if args.model is None:
        preset = args.preset or "smollm2-fp32"
        args.model, dtype = PRESETS[preset]()
        args.dtype = args.dtype or dtype
        if preset != "smollm2-fp32":
            name = f"load_time-{preset}.json"
    extra = {"cpu_linear": args.cpu_linear} if args.cpu_linear else {}
    if args.cpu_linear:
        name = name.replace(".json", f"-cpu_linear-{args.cpu_linear}.json")
    if args.no_in_place:
        extra["in_place"] = False
        name = name.replace(".json", "-no-in-place.json")
    if args.huge_pages:
        extra["huge_pages"] = True
        name = name.replace(".json", "-huge-pages.json")
    extra = extra or None
    if args.isa:
        name = name.replace(".json", f"-{args.isa}.json")
    RESULTS.mkdir(parents=True, exist_ok=True)  # the profiled engine writes its profile there
    profile = RESULTS / name.replace(".json", f".{args.profile}.prof") if args.profile else None
    result = run(args.model, args.dtype or "bfloat16", serve=not args.no_serve, profile=profile, extra=extra,
                 profiled=args.profile, rounds=args.rounds)
    print_table(result)
    write_results(RESULTS / name, result, args.json)
    return 0 if all(r["same_tokens"] for r in result["engines"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
