"""The chaos soak, as long as asked: three ``vllm serve`` engines of the SmolLM2 family under a
steady, bounded stream of requests (one client per engine, one request at a time), while every
few seconds the registry is SIGKILLed, an engine is SIGKILLed and started again, or an engine is
hung (its process group SIGSTOPped, then SIGCONTed), drawn at random (`harness.chaos.Soak`).

    .venv/bin/python benchmarks/chaos.py [--cycles 30] [--minutes M] [--interval-s 3] [--hang-s 5] [--pause-s 0.5]
                                         [--seed 0] [--json]

References first: per model a reference ``vllm serve`` (`harness.references`), asked one prompt
per request as the soak asks: its greedy texts and its final tensors.  Then one line per cycle,
as it happens: what was done, kills and hangs so far, requests sent, failed (only those in flight
to a killed engine may fail) and wrong (any answer differing from the reference's), the tensor
oracle's verdict for every engine up (tensors differing from its model's reference: must be 0),
and whether the registry's state agreed with /proc.  At the end: what was left over after
everything stopped (memfds, registry descriptors beyond a fresh registry's, registry processes,
servers, socket files: all must be 0) and PSS at the end next to the start's.

``--cycles N`` stops after N cycles, ``--minutes M`` once M minutes have passed since the start
(references and start-up included; the cycle in progress finishes); with both, whichever comes
first.  SIGINT (Ctrl-C), SIGTERM and SIGHUP stop every process group the run started (reference
servers, engines, the registry) before it exits; the partial result is still written.

Writes ``benchmarks/results/chaos.json`` (``--json``: also the last line of stdout).  Exit status
0 only if nothing failed unexpectedly, nothing was wrong, no tensor differed, nothing leaked, the
registry agreed with /proc after every cycle and the run was not interrupted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.chaos import Soak  # noqa: E402
from harness.machine import describe, machine  # noqa: E402
from harness.results import write_results  # noqa: E402
from harness.procs import mark_session  # noqa: E402
from harness.variants import smollm2_family  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MB = 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=None, help="cycles to run (default 30 without --minutes)")
    parser.add_argument("--minutes", type=float, default=None, help="wall-clock budget, start-up included")
    parser.add_argument("--interval-s", type=float, default=3.0, help="seconds between two cycles")
    parser.add_argument("--hang-s", type=float, default=5.0, help="seconds a hung engine stays stopped")
    parser.add_argument("--pause-s", type=float, default=0.5, help="seconds a client waits between two requests")
    parser.add_argument("--seed", type=int, default=0, help="for the draw of the victims")
    parser.add_argument("--json", action="store_true", help="also print the JSON result as the last line")
    args = parser.parse_args()
    if args.cycles is None and args.minutes is None:
        args.cycles = 30
    print(describe(), flush=True)
    # Every process the run starts inherits this: the leak and /proc checks count only those,
    # never what else runs on the machine (harness.procs).
    mark_session("chaos")
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    os.environ["VLLM_DEDUP_RUNTIME_DIR"] = str(work / "run")  # a private registry, which the soak kills
    models = smollm2_family(3)
    print(f"models: {', '.join(models)}; references, then the engines ...", flush=True)
    soak = Soak(models, work, work / "run" / "vllm-dedup.sock", args.interval_s, args.seed, hang_s=args.hang_s,
                pause_s=args.pause_s, on_cycle=lambda c: print(c.line(), flush=True))
    interrupted = None
    try:
        soak.run(cycles=args.cycles, minutes=args.minutes)
    except BaseException as e:  # noqa: BLE001 (reported, and the result written)
        interrupted = e
    report = soak.report.to_dict()
    per_cycle = report["cycle_seconds"]
    print(f"{report['cycles']} cycles in {report['seconds']:.0f} s (a cycle: median "
          f"{sorted(per_cycle)[len(per_cycle) // 2] if per_cycle else 0:.0f} s): {report['registry_kills']} registry "
          f"kills, {report['engine_kills']} engine kills (each started again), {report['hangs']} engines hung")
    print(f"requests: {report['sent']} sent, {report['failed']} failed ({report['failed_unexpected']} not in flight "
          f"to a killed engine), {report['wrong']} wrong")
    print(f"tensors: {report['tensor_checks']} engine checks against their reference, "
          f"{report['tensors_differing']} tensors differing")
    print(f"left over: {report['leaked']}")
    print(f"registry agreed with /proc after every cycle: {report['consistent']} {report['inconsistencies'] or ''}")
    if report["pss_end_bytes"]:
        print(f"PSS: {report['pss_start_bytes'] / MB:.0f} MB at the start, {report['pss_end_bytes'] / MB:.0f} MB at "
              f"the end ({(report['pss_end_bytes'] - report['pss_start_bytes']) / MB:+.0f} MB)")
    if interrupted is not None:
        print(f"interrupted: {report['interrupted']}")
    result = {"machine": machine(), "args": vars(args), **report}
    write_results(RESULTS / "chaos.json", result, args.json)
    if soak.report.ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"servers' logs kept in {work}")
    return 0 if soak.report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
