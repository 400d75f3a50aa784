"""What a recipe is worth after a registry restart: the second engine's load with and without one.

    .venv/bin/python benchmarks/recipe_restart.py [--model DIR | --preset {smollm2,llama-1.2b}] [--json]

A recipe lives in the registry (`vllm_dedup.registry.state`).  When the registry dies, live
engines give it back theirs (each lease keeps the recipes its engine gave or used); when the
standalone daemon exits because it is idle, nothing is resident any more, so a recipe would map
nothing.  A recipe is lost, with the segments it names still resident, only when no live engine
of its load signature gave or used it.  Persisting recipes beside the manifest cache would turn
that case into the first one; this measures what that is worth.

Two scenarios, real vLLM engines (``LLM()``, one process each, CPU backend), a standalone daemon
in a private runtime dir, each ending with the daemon SIGKILLed and the first engine
re-registered with the daemon that replaces it:

- ``recipe kept``: the first engine loaded as usual and left a recipe; its lease gives the recipe
  back to the new daemon;
- ``recipe lost``: the first engine ran with ``fast_path: false`` (it leaves no recipe): the new
  daemon holds the same segments and no recipe, as it would after losing one.

Then a second engine of the same model loads (default options).  Per scenario: its load path,
``load_model`` seconds (`harness.engines.EngineProcess.load_stats`), checkpoint bytes read, peak
private memory, and whether its final tensors equal the first engine's (`harness.oracle`).
Prints the machine's CPU flags and a table; writes ``benchmarks/results/recipe_restart.json``
(``recipe_restart-<preset>.json`` for another preset; ``--json``: also the last line of stdout).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.engines import EngineProcess  # noqa: E402
from harness.machine import describe, machine  # noqa: E402
from harness.results import write_results  # noqa: E402
from harness.oracle import differences  # noqa: E402
from vllm_dedup.errors import RegistryUnavailable  # noqa: E402
from vllm_dedup.registry.client import registry_stats, shutdown_registry  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MB = 1e6
LOCAL = {"registry_address": "local"}  # the standalone daemon, whatever Ray runs on the machine


def _smollm2() -> Path:
    from harness.sample_models import smollm2_hf

    return smollm2_hf()


def _llama_1b() -> Path:
    from harness.sample_models import llama_1b

    return llama_1b()


PRESETS = {"smollm2": _smollm2, "llama-1.2b": _llama_1b}


def _reregistered(first_pid: int, old_registry: int) -> bool:
    try:
        stats = registry_stats()
    except RegistryUnavailable:
        return False
    engine = stats.engine(first_pid)
    return stats.registry_pid != old_registry and engine is not None and bool(engine.load.get("reregistered"))


def scenario(model: Path, first_extra: dict) -> dict:
    """First engine (``first_extra``), the daemon SIGKILLed and replaced, then the second engine."""
    with tempfile.TemporaryDirectory(prefix="recipe-restart-") as run:
        os.environ["VLLM_DEDUP_RUNTIME_DIR"] = str(Path(run) / "run")
        first = EngineProcess(model, "dedup", {**LOCAL, **first_extra}, core=0).wait_ready(900)
        second = None
        try:
            (first_tensors,) = first.final_tensors()
            old = registry_stats().registry_pid
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while not _reregistered(first.pid, old):  # its lease starts the daemon again
                if time.monotonic() > deadline:
                    raise TimeoutError("the first engine did not re-register within 120 s")
                time.sleep(0.2)
            second = EngineProcess(model, "dedup", LOCAL, core=1).wait_ready(900)
            stats = second.load_stats()
            load = registry_stats().engine(second.pid).load
            (second_tensors,) = second.final_tensors()
            return {"path": load["load_path"], "load_s": stats["seconds"], "read_bytes": load["checkpoint_bytes_read"],
                    "peak_bytes": load["peak_bytes"], "private_peak_bytes": stats["peak_bytes"],
                    "shared_bytes": load["shared_bytes"],
                    "tensors_differing": len(differences(second_tensors, first_tensors))}
        finally:
            for engine in (second, first):
                if engine is not None:
                    engine.stop()
            shutdown_registry()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="HF folder (default: the preset's)")
    parser.add_argument("--preset", choices=PRESETS, default=None, help="smollm2 (default) or llama-1.2b")
    parser.add_argument("--json", action="store_true", help="also print the JSON result as the last line")
    args = parser.parse_args()
    if args.model is not None and args.preset is not None:
        parser.error("give --model or --preset, not both")
    preset = args.preset or "smollm2"
    model = args.model or PRESETS[preset]()
    print(describe(), flush=True)
    rows = {"recipe kept": scenario(model, {}), "recipe lost": scenario(model, {"fast_path": False})}
    kept, lost = rows["recipe kept"]["load_s"], rows["recipe lost"]["load_s"]
    result = {"machine": machine(), "model": str(model), "scenarios": rows, "saved_s": lost - kept}
    print(f"model {model}: the second engine after a registry restart")
    print(f"{'scenario':<14}{'path':>8}{'load s':>9}{'read MB':>10}{'peak MB':>10}{'mapped MB':>11}  tensors differing")
    for name, r in rows.items():
        print(f"{name:<14}{r['path']:>8}{r['load_s']:>9.2f}{r['read_bytes'] / MB:>10.1f}{r['peak_bytes'] / MB:>10.1f}"
              f"{r['shared_bytes'] / MB:>11.1f}  {r['tensors_differing']}")
    print(f"a recipe saves {lost - kept:.2f} s of this load ({lost / max(kept, 1e-9):.1f}x)")
    name = "recipe_restart.json" if preset == "smollm2" or args.model else f"recipe_restart-{preset}.json"
    write_results(RESULTS / name, result, args.json)
    return 0 if all(r["tensors_differing"] == 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
