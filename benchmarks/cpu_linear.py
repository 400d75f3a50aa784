"""The speed of each ``cpu_linear`` mode on vLLM's CPU backend, dedup vs plain, in one run.

    .venv/bin/python benchmarks/cpu_linear.py [--model PATH] [--rounds 3] [--json]

On the CPU backend vLLM packs linear weights into oneDNN memory.  ``cpu_linear="packed"`` (the
default) shares those packed weights and runs vLLM's own kernels; ``plain`` keeps plain tensors
run by ``F.linear``, shared like any tensor; ``private`` lets vLLM pack them privately (then only
embeddings, norms and untied heads are shared).  Four engines, each alone on the machine in turn
(one process, all cores):

- ``plain``: ``--load-format auto`` (oneDNN);
- ``dedup, packed``: ``dedup`` with ``cpu_linear="packed"`` (oneDNN, shared packed weights);
- ``dedup, plain linear``: ``dedup`` with ``cpu_linear="plain"`` (``F.linear``);
- ``dedup, private linear``: ``dedup`` with ``cpu_linear="private"`` (oneDNN, not shared).

Each generates greedily for a batch of prompts; decode throughput is generated tokens per
second of ``LLM.generate`` wall time, the median of ``--rounds`` rounds, the engines taking turns
within each round so that machine noise falls on all alike.  Also reported: the bytes each
dedup engine put into shareable segments, and whether each engine's tokens equal plain's in
every round (each round starts from an empty registry).  CPU flags, table to stdout; JSON to
``benchmarks/results/cpu_linear.json`` (and the last line with ``--json``).  Exit status 1 when
``packed`` or ``private``, which run vLLM's own kernels, generate other tokens than plain.  For decode at batch
1 and 8, second engines and memory: benchmarks/cpu_decode.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.engines import EngineProcess  # noqa: E402
from harness.machine import describe, machine  # noqa: E402
from harness.results import write_results  # noqa: E402
from vllm_dedup.registry.client import registry_stats, shutdown_registry  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time",
    "The three primary colors are", "import numpy as np\n", "A haiku about the sea:", "The largest planet is",
]
CASES = {
    "plain": ("auto", None),
    "dedup, packed": ("dedup", {"cpu_linear": "packed", "share_group": "packed"}),
    "dedup, plain linear": ("dedup", {"cpu_linear": "plain", "share_group": "plain"}),
    "dedup, private linear": ("dedup", {"cpu_linear": "private", "share_group": "private"}),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        from harness.sample_models import smollm2_hf

        args.model = smollm2_hf()

    rates: dict[str, list[float]] = {c: [] for c in CASES}
    published: dict[str, int] = {}
    same: dict[str, bool] = {c: True for c in CASES}  # the tokens of every round equal plain's of that round
    with tempfile.TemporaryDirectory(prefix="vllm-dedup-bench-") as run_dir:
        os.environ["VLLM_DEDUP_RUNTIME_DIR"] = str(Path(run_dir) / "run")
        try:
            for r in range(args.rounds):
                for case, (fmt, extra) in CASES.items():
                    print(f"round {r + 1}: {case} ...", file=sys.stderr, flush=True)
                    with EngineProcess(args.model, fmt, extra) as engine:
                        engine.wait_ready()
                        engine.complete(PROMPTS[:2], 4)  # warm-up
                        res = engine.complete(PROMPTS, args.max_tokens)
                        rates[case].append(sum(len(ids) for ids in res["ids"]) / res["seconds"])
                        if case == "plain":
                            plain_ids = res["ids"]
                        same[case] &= res["ids"] == plain_ids
                        if fmt == "dedup":
                            load = registry_stats().engine(engine.pid).load
                            published[case] = load["published_bytes"] + load["shared_bytes"]
                shutdown_registry()  # each round from an empty registry: the same load paths
        finally:
            shutdown_registry()

    base = statistics.median(rates["plain"])
    rows = [{"case": c, "tokens_per_s": round(statistics.median(v), 2), "all_rounds": [round(x, 2) for x in v],
             "relative_to_plain": round(statistics.median(v) / base, 3), "shareable_bytes": published.get(c),
             "outputs_match_plain": same[c]} for c, v in rates.items()]
    print(describe())
    print(f"model: {args.model}  ({len(PROMPTS)} prompts x {args.max_tokens} tokens, {os.cpu_count()} CPUs, "
          f"median of {args.rounds})")
    print(f"{'case':<24}{'tokens/s':>10}{'vs plain':>10}{'shareable':>12}{'same tokens':>13}")
    for row in rows:
        share = "-" if row["shareable_bytes"] is None else f"{row['shareable_bytes'] / 1e6:.0f} MB"
        print(f"{row['case']:<24}{row['tokens_per_s']:>10.1f}{row['relative_to_plain']:>10.2f}{share:>12}"
              f"{str(row['outputs_match_plain']):>13}")
    result = {"machine": machine(), "model": str(args.model), "max_tokens": args.max_tokens, "prompts": len(PROMPTS),
              "rows": rows}
    write_results(RESULTS / "cpu_linear.json", result, args.json)
    # packed and private run vLLM's own kernels: their tokens must be plain's; F.linear's
    # numerics are its own, so "plain linear" may differ and is only reported.
    return 0 if same["dedup, packed"] and same["dedup, private linear"] else 1


if __name__ == "__main__":
    sys.exit(main())
