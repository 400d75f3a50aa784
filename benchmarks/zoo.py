"""The model zoo: for each architecture, does every dedup load path leave the engine's final
tensors exactly as a plain load with the same options leaves them?

    .venv/bin/python benchmarks/zoo.py [--arch NAME ...] [--no-plain] [--json] [--render ZOO.JSON]

Checkpoints: tiny random-weight models made here from transformers configs (`harness.zoo`: 27
architectures, dense, MoE, BERT, SSMs, hybrid, attention sinks), each with a "last-layers"
fine-tune (its last two layers perturbed, every other tensor bit-identical) and, where the head
is tied to the token embedding or a tensor is derived from it, an "embeddings" fine-tune (only
the token embeddings perturbed).  For each architecture, real vLLM engines on the CPU backend,
started in turn (`harness.zoo.run_arch`):

- ``plain``: ``--load-format auto``: whether vLLM's CPU backend serves it at all;
- the references (`harness.zoo.reference_extra`: a dedup engine alone in its own share group,
  fast path off) of the base and of each fine-tune;
- ``first`` (expected path ``none``), ``second`` (``full``, while the first is up),
  ``last-layers`` and ``embeddings`` (``modules``, while the first is up): dedup engines.

Each dedup engine's final tensors (every parameter, buffer and attribute tensor: the oracle,
`harness.oracle`) are compared with its reference's.  The table says per architecture and engine
``equal`` (the expected path, tensors equal), ``declined`` (another path, tensors equal: the
fast path said no), ``DIFFERENT`` (a final tensor differs: a wrong weight) or ``CRASHED``;
and whether the outputs (greedy token ids; a pooling model's outputs) of the dedup engines of
one checkpoint are equal.  Prints the CPU's ISA, the table and every difference; writes
``benchmarks/results/zoo.json`` and ``benchmarks/results/zoo.md``.  Exit status 1 when any
engine is DIFFERENT or CRASHED, or an architecture was not tested (its checkpoint or a reference
failed: no engine rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.sample_models import MODELS_ENV  # noqa: E402
from harness.machine import cpu_flags  # noqa: E402
from harness.zoo import ARCH_NAMES, EXPECTED_PATH, run_arch  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ROLES = tuple(EXPECTED_PATH)


def cell(row: dict | None) -> str:
    """One table cell: the verdict, and the path taken when it is not the expected one."""
    if row is None:
        return "-"
    v = row["verdict"]
    if v == "CRASHED":
        return "CRASHED"
    return v if row["path"] == row["expected_path"] else f"{v} ({row['path']})"


def outputs_cell(result: dict) -> str:
    rows = result["engines"]
    marks = []
    for role in ROLES[1:]:
        if role in rows and "outputs_equal" in rows[role]:
            marks.append("=" if rows[role]["outputs_equal"] else "DIFF")
        else:
            marks.append("-")
    return "/".join(marks)


def table(results: list[dict]) -> str:
    """Markdown: architecture x engine, and the plain engine's standing."""
    head = " | ".join(f"{role} ({path})" for role, path in EXPECTED_PATH.items())
    lines = [f"| architecture | plain `auto` | {head} | outputs equal: second/last-layers/embeddings |",
             "| --- " * (len(ROLES) + 3) + "|"]
    for r in results:
        plain = r.get("plain", {})
        serves = "serves" if plain.get("serves") else ("FAILS (below)" if plain else "not run")
        if r["errors"] and not r["engines"]:
            serves += "; no reference (below)"
        cells = [cell(r["engines"].get(role)) for role in ROLES]
        lines.append(f"| {r['name']} | {serves} | " + " | ".join(cells) + f" | {outputs_cell(r)} |")
    return "\n".join(lines)


def load_table(results: list[dict]) -> str:
    """Markdown: per architecture, what the second engine (the unchanged checkpoint, the first
    engine up) took: its path, the checkpoint bytes it read, the bytes it mapped, and the
    dedup loader's load time (``load_seconds``: vLLM's ``load_weights`` and post-processing,
    or the replay, plus the sharing pass) next to the first engine's, which reads everything
    as a plain load does.  ``get_model`` columns: vLLM's ``get_model`` wall time as the harness
    times it in every engine alike (`harness.engines.EngineProcess.load_stats`), plain ``auto``
    against the second dedup engine (without ``--no-plain``)."""
    lines = ["| architecture | second: path | read | mapped | load s: first | second | second/first "
             "| get_model s: plain | second | second/plain |",
             "| --- " * 10 + "|"]

    def cell(x, fmt="{:.2f}"):
        return fmt.format(x) if x is not None else "-"

    for r in results:
        first, second = r["engines"].get("first", {}), r["engines"].get("second", {})
        if "path" not in second:
            continue
        f_s, s_s = first.get("load_seconds"), second.get("load_seconds")
        p_g, s_g = r.get("plain", {}).get("get_model_s"), second.get("get_model_s")
        lines.append(f"| {r['name']} | {second['path']} | {(second.get('checkpoint_bytes_read') or 0) / 1e6:.1f} MB | "
                     f"{(second.get('shared_bytes') or 0) / 1e6:.1f} MB | {cell(f_s)} | {cell(s_s)} | "
                     f"{cell(s_s / f_s if f_s and s_s is not None else None, '{:.0%}')} | {cell(p_g)} | {cell(s_g)} | "
                     f"{cell(s_g / p_g if p_g and s_g is not None else None, '{:.0%}')} |")
    return "\n".join(lines)


def details(results: list[dict]) -> str:
    """Every difference, meta tensor, crash and declined fast path, by architecture."""
    out = []
    for r in results:
        notes = []
        if not r.get("plain", {}).get("serves", True):
            notes.append("plain auto fails: " + r["plain"]["error"].strip().splitlines()[-1][:300])
        notes += [f"error: {e.strip().splitlines()[-1][:300]}" for e in r["errors"]]
        for role, row in r["engines"].items():
            if row["verdict"] == "CRASHED":
                notes.append(f"{role}: CRASHED: {row['error'].strip().splitlines()[-1][:300]}")
                continue
            if row["differences"]:
                notes.append(f"{role} ({row['path']}): {len(row['differences'])} tensors differ: "
                             + "; ".join(d.split(":", 2)[0] + ":" + d.split(":", 2)[1] for d in row["differences"][:8]))
            if row["meta_tensors"]:
                notes.append(f"{role}: meta tensors left: {', '.join(row['meta_tensors'][:6])}")
            if row["path"] != row["expected_path"]:
                why = [line for line in row["log"] if "loading from the checkpoint" in line or "recipe maps" in line]
                notes.append(f"{role}: path {row['path']}: {why[0] if why else '(no log line)'}")
            elif row["path"] == "modules" or (role == "second" and row["path"] != "full"):
                why = [line for line in row["log"] if "recipe maps" in line]
                if why:
                    notes.append(f"{role}: {why[0]}")
        for recipe in r.get("recipes", [])[:1]:
            if recipe["unreplayable"]:
                first = sorted(recipe["unreplayable"].items())[:4]
                notes.append(f"recipe: {len(recipe['unreplayable'])} of {recipe['modules']} modules not replayable: "
                             + "; ".join(f"{n}: {w}" for n, w in first))
            if not recipe["replayable"]:
                notes.append(f"recipe not replayable: {recipe['why']}")
        if notes:
            out.append(f"- **{r['name']}**\n" + "\n".join(f"  - {n}" for n in notes))
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", choices=ARCH_NAMES, help="only these (repeatable)")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain `auto` engines")
    parser.add_argument("--json", action="store_true", help="also print the JSON result as the last line")
    parser.add_argument("--render", type=Path, metavar="ZOO.JSON", help="print the table of an earlier run; run nothing")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        print(f"ISA: {' '.join(saved['isa'])}\n\n{table(saved['architectures'])}\n\n{load_table(saved['architectures'])}\n\n"
              f"{details(saved['architectures'])}\n\n"
              f"{len(saved['architectures'])} architectures in {saved['seconds']:.0f} s")
        return 0
    work = Path(tempfile.mkdtemp(prefix="zoo-"))
    # The checkpoints outlive the run (made once, under .venv/ as the tests' are); the manifest
    # cache and the registries are this run's own.
    os.environ.setdefault(MODELS_ENV, str(ROOT / ".venv" / "test-models" / "benchmarks"))
    os.environ.setdefault("VLLM_DEDUP_CACHE_DIR", str(work / "cache"))
    flags = cpu_flags()
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; ISA: {' '.join(flags)}",
          flush=True)
    began = time.monotonic()
    results = []
    for name in args.arch or ARCH_NAMES:
        r = run_arch(name, work, plain=not args.no_plain)
        results.append(r)
        shutil.rmtree(work / name, ignore_errors=True)
        cells = ", ".join(f"{role} {cell(r['engines'].get(role))}" for role in ROLES)
        print(f"{name}: {cells} [{r['seconds']:.0f} s]", flush=True)
        RESULTS.mkdir(parents=True, exist_ok=True)  # what is measured so far, should a later one hang
        (RESULTS / "zoo.partial.json").write_text(json.dumps({"isa": flags, "architectures": results}, indent=1))
    seconds = time.monotonic() - began
    shutil.rmtree(work, ignore_errors=True)
    md = (f"ISA: {' '.join(flags)}\n\n" + table(results) + "\n\n" + load_table(results) + "\n\n" + details(results) + "\n\n"
          + f"{len(results)} architectures in {seconds:.0f} s\n")
    print()
    print(md)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"isa": flags, "cores": os.cpu_count(), "seconds": round(seconds, 1), "architectures": results}
    (RESULTS / "zoo.json").write_text(json.dumps(out, indent=1) + "\n")
    (RESULTS / "zoo.md").write_text(md)
    (RESULTS / "zoo.partial.json").unlink(missing_ok=True)
    if args.json:
        print(json.dumps(out))
    bad = [r for r in results for row in r["engines"].values() if row["verdict"] in ("DIFFERENT", "CRASHED")]
    # An architecture whose checkpoint or reference failed has no engine rows: it was not tested.
    untested = [r["name"] for r in results if r["errors"] or not r["engines"]]
    if untested:
        print(f"not tested (see their errors): {', '.join(untested)}")
    return 1 if bad or untested else 0


if __name__ == "__main__":
    sys.exit(main())
