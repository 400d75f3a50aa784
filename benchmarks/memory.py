"""Memory of two engines side by side, plain and with dedup, measured in one run.

    .venv/bin/python benchmarks/memory.py --model PATH [--json]

Scenarios (the second engine's checkpoint is built from ``PATH`` by `harness.variants`):

- ``same-model``: both engines serve PATH;
- ``last-layers-variant``: the second serves PATH with its last two decoder layers retrained;
- ``vocab-extended-variant``: the second serves PATH with 8 tokens added to the vocabulary.

Per scenario, three phases, each with both engines up (real vLLM engines on the CPU backend,
one process each, so a process's PSS is its engine's memory):

- ``plain``: ``--load-format auto``;
- ``apart``: ``dedup``, the two engines in different share groups: the same code path with
  nothing shared, so ``apart - dedup`` is what sharing itself saves;
- ``dedup``: ``dedup``, one share group.

Columns: ``expected_shared_bytes`` comes from the checkpoints' content keys (tensors of at least
``min_tensor_bytes``, the second engine's found in the first); ``registry_shared_bytes`` is what
the second engine mapped, as the registry counts it (post-processing tensors, which also
include buffers computed at start-up, such as rotary caches); ``saved_bytes`` is plain minus
dedup PSS (a dedup phase's PSS counts the registry daemon's too: it serves those engines
only); ``saved_by_sharing_bytes`` is apart minus dedup; ``outputs_match``: both dedup
engines' greedy tokens equal the plain engines'.  The table goes to stdout; the JSON to
``benchmarks/results/memory.json`` and, with ``--json``, as the last line of stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.engines import EngineProcess  # noqa: E402
from harness.machine import describe, machine  # noqa: E402
from harness.procs import pss_bytes  # noqa: E402
from harness.results import write_results  # noqa: E402
from harness.variants import cached_variant  # noqa: E402
from vllm_dedup.config import DedupConfig  # noqa: E402
from vllm_dedup.registry.client import registry_stats, shutdown_registry  # noqa: E402
from vllm_dedup.scan.files import scan_model  # noqa: E402
from vllm_dedup.checkpoint.manifest import ManifestCache, default_cache_dir  # noqa: E402
from vllm_dedup.scan.report import Report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
SCENARIOS = {"same-model": None, "last-layers-variant": "last-layers", "vocab-extended-variant": "vocab-extended"}
MB = 1e6


def expected_shared(first: Path, second: Path, min_bytes: int) -> int:
    """Bytes of ``second``'s checkpoint tensors whose content ``first`` holds."""
    cache = ManifestCache(default_cache_dir())
    scans = [scan_model(m, cache=cache, progress=False) for m in (first, second)]
    return Report(scans, min_bytes).shared_with_earlier_bytes()[1]


def phase(models: list[Path], load_format: str, groups: list[str] | None = None) -> dict:
    """Both engines up, one after the other; PSS, greedy tokens, and the registry's view."""
    engines = []
    try:
        for i, m in enumerate(models):
            extra = {"share_group": groups[i]} if groups else None
            engines.append(EngineProcess(m, load_format, extra, core=i % (os.cpu_count() or 1)).wait_ready())
        outputs = [e.generate(PROMPTS) for e in engines]
        pss = [e.pss() for e in engines]
        loads, registry_pss = {}, 0
        if load_format == "dedup":
            stats = registry_stats()
            loads, registry_pss = {e.pid: e.load for e in stats.engines}, pss_bytes(stats.registry_pid)
        return {"pss": sum(pss) + registry_pss, "registry_pss": registry_pss, "outputs": outputs,
                "loads": [loads.get(e.pid, {}) for e in engines]}
    finally:
        for e in engines:
            e.stop()


def run(model: Path) -> list[dict]:
    min_bytes = DedupConfig().min_tensor_bytes
    entries = []
    for scenario, kind in SCENARIOS.items():
        second = cached_variant(model, kind) if kind else model
        print(f"{scenario}: plain, apart, dedup ...", file=sys.stderr, flush=True)
        pair = [model, second]
        plain = phase(pair, "auto")
        apart = phase(pair, "dedup", [f"{scenario}-a", f"{scenario}-b"])
        dedup = phase(pair, "dedup", [scenario, scenario])
        entries.append({
            "scenario": scenario,
            "second_model": str(second),
            "expected_shared_bytes": expected_shared(model, second, min_bytes),
            "registry_shared_bytes": dedup["loads"][1].get("shared_bytes", 0),
            "pss_plain_bytes": plain["pss"],
            "pss_apart_bytes": apart["pss"],
            "pss_dedup_bytes": dedup["pss"],
            "pss_registry_bytes": dedup["registry_pss"],
            "saved_bytes": plain["pss"] - dedup["pss"],
            "saved_by_sharing_bytes": apart["pss"] - dedup["pss"],
            "outputs_match": dedup["outputs"] == plain["outputs"] == apart["outputs"],
        })
    return entries


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="HF model folder (default: the converted SmolLM2)")
    parser.add_argument("--json", action="store_true", help="print the JSON result as the last line")
    args = parser.parse_args()
    if args.model is None:
        from harness.sample_models import smollm2_hf

        args.model = smollm2_hf()

    with tempfile.TemporaryDirectory(prefix="vllm-dedup-bench-") as run_dir:
        os.environ["VLLM_DEDUP_RUNTIME_DIR"] = str(Path(run_dir) / "run")  # a private registry
        try:
            entries = run(args.model)
        finally:
            shutdown_registry()

    print(describe())
    print(f"model: {args.model}")
    head = ["scenario", "expected", "mapped", "PSS plain", "PSS apart", "PSS dedup", "saved", "by sharing", "match"]
    print("{:<24}{:>10}{:>10}{:>11}{:>11}{:>11}{:>10}{:>12}{:>7}".format(*head))
    for e in entries:
        print(f"{e['scenario']:<24}{e['expected_shared_bytes'] / MB:>8.0f}MB{e['registry_shared_bytes'] / MB:>8.0f}MB"
              f"{e['pss_plain_bytes'] / MB:>9.0f}MB{e['pss_apart_bytes'] / MB:>9.0f}MB{e['pss_dedup_bytes'] / MB:>9.0f}MB"
              f"{e['saved_bytes'] / MB:>8.0f}MB{e['saved_by_sharing_bytes'] / MB:>10.0f}MB{str(e['outputs_match']):>7}")
    result = {"machine": machine(), "model": str(args.model), "scenarios": entries}
    write_results(RESULTS / "memory.json", result, args.json)
    return 0 if all(e["outputs_match"] for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
