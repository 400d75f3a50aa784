"""The chaos soak, as long as asked: three ``vllm serve`` engines of the SmolLM2 family under a
steady stream of requests, while every few seconds a random engine or the registry is SIGKILLed
and started again (`harness.chaos.Soak`).

    .venv/bin/python benchmarks/chaos.py [--cycles 20] [--interval-s 3] [--seed 0] [--json]

Reports requests sent, failed (only those in flight to a killed engine may) and wrong (any
answer differing from a plain engine's greedy answer); what was left over after everything
stopped (memfds, registry processes, servers, socket files: all must be 0); whether the
registry's state agreed with /proc after every cycle; and PSS at the end next to a fresh
start's.  Writes ``benchmarks/results/chaos.json`` (``--json``: also the last line of stdout).
Exit status 0 only if nothing failed unexpectedly, nothing was wrong and nothing leaked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.chaos import Soak  # noqa: E402
from harness.engines import EngineProcess  # noqa: E402
from harness.variants import smollm2_family  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=20, help="kills, each followed by a restart")
    parser.add_argument("--interval-s", type=float, default=3.0, help="seconds between two kills")
    parser.add_argument("--seed", type=int, default=0, help="for the draw of the victims")
    parser.add_argument("--json", action="store_true", help="also print the JSON result as the last line")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    os.environ["VLLM_DEDUP_RUNTIME_DIR"] = str(work / "run")  # a private registry, which the soak kills
    models = smollm2_family(3)
    references = {}
    for name, path in models.items():
        with EngineProcess(path, "auto") as plain:
            plain.wait_ready(600)
            references[name] = plain.complete()["texts"]
    report = Soak(models, references, work, work / "run" / "vllm-dedup.sock", args.interval_s, args.seed).run(
        args.cycles).to_dict()
    mb = 1e6
    print(f"{report['cycles']} cycles in {report['seconds']:.0f} s: {report['engine_kills']} engines and "
          f"{report['registry_kills']} registries SIGKILLed and started again")
    print(f"requests: {report['sent']} sent, {report['failed']} failed ({report['failed_unexpected']} not in flight "
          f"to a killed engine), {report['wrong']} wrong")
    print(f"left over: {report['leaked']}")
    print(f"registry agreed with /proc after every cycle: {report['consistent']} {report['inconsistencies'] or ''}")
    print(f"PSS: {report['pss_start_bytes'] / mb:.0f} MB at the start, {report['pss_end_bytes'] / mb:.0f} MB at the end")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "chaos.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report))
    ok = not report["failed_unexpected"] and not report["wrong"] and not any(report["leaked"].values())
    return 0 if ok and report["consistent"] else 1


if __name__ == "__main__":
    sys.exit(main())
