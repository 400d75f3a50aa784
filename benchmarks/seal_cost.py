#!/usr/bin/env python
"""What sealing a loaded tensor where it lies costs, and what mapping a segment costs: the
page-table work under the first and the N-th engine's load (host backend).

Usage: ``.venv/bin/python benchmarks/seal_cost.py [--gb 2.34] [--segments 91] [--repeats 3] [--json]``

A model of ``--gb`` GB in ``--segments`` tensors (the 1.2B Llama of ``load_time.py`` is 2.34 GB
in 91 tensors of at least ``min_tensor_bytes``) is loaded into writable memfds of its own by
`vllm_dedup.engine.in_place.InPlace` and written, as vLLM's weight loaders would, then sealed
by `InPlace.seal` one of two ways, on the same bytes in the same run:

- **kept** (Note [sealing where it lies]): the writable mapping stays, made read-only with
  ``mprotect``, the memfd sealed with ``F_SEAL_FUTURE_WRITE``: no page is mapped again;
- **bridge** (Note [sealing under a tensor]): the writable mapping is closed and the pages
  mapped again read-only (``MAP_POPULATE``), so the memfd can take ``F_SEAL_WRITE``.

Then a receiver (the N-th engine) maps every sealed segment: with ``MAP_POPULATE``
(`HostSegment.attach`, what the engines do), and lazily, reading one byte of every page after.

Each figure is the best of ``--repeats`` runs, in seconds and seconds per GB.  Prints the CPU
flags and a table; writes ``benchmarks/results/seal_cost.json`` (``--json``: also the last
line of stdout).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.machine import describe, machine  # noqa: E402
from harness.results import write_results  # noqa: E402
from vllm_dedup.engine.in_place import InPlace  # noqa: E402
from vllm_dedup.engine.slots import collect_slots  # noqa: E402
from vllm_dedup.segments.host import HostSegment  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PAGE = mmap.PAGESIZE


def _model(nbytes: int, segments: int) -> nn.Module:
    """``segments`` bfloat16 parameters of about ``nbytes / segments`` bytes each (meta-free,
    unwritten: ``torch.empty``, as vLLM allocates them)."""
    per = max(nbytes // segments // 2 // 4096 * 4096, 4096)
    model = nn.Module()
    for i in range(segments):
        model.register_parameter(f"w{i}", nn.Parameter(torch.empty(per, dtype=torch.bfloat16), requires_grad=False))
    return model


def _seal_all(nbytes: int, segments: int, kept: bool) -> tuple[float, list[HostSegment]]:
    """Load a model in place, write it, and time sealing every tensor; returns (seconds, the
    sealed segments, which keep their descriptors)."""
    model = _model(nbytes, segments)
    placed = InPlace(min_bytes=1 << 20)
    placed.seals_where_it_lies = kept
    placed.place(model)
    for p in model.parameters():
        p.data.fill_(1.0)  # every page written, as by the weight loaders
    slots, _, _ = collect_slots(model, "cpu", 1 << 20)
    start = time.perf_counter()
    sealed = [placed.seal([slot], [0]) for slot in slots]
    seconds = time.perf_counter() - start
    if None in sealed:
        raise SystemExit(f"a tensor could not be sealed where it lies: {placed.failures[:1]}")
    placed.release()
    return seconds, sealed


def _receive(sealed: list[HostSegment], populate: bool) -> float:
    """Seconds for a receiver to map every segment and have every page in its page tables."""
    start = time.perf_counter()
    maps = []
    for seg in sealed:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        maps.append(mmap.mmap(seg.fileno(), seg.nbytes, flags, mmap.PROT_READ))
    if not populate:
        for m in maps:
            np.frombuffer(m, dtype=np.uint8)[::PAGE].sum()  # one byte of every page
    seconds = time.perf_counter() - start
    for m in maps:
        m.close()
    return seconds


def run(gb: float, segments: int, repeats: int) -> dict:
    nbytes = int(gb * 1e9)
    best: dict[str, float] = {}

    def keep(name: str, seconds: float) -> None:
        best[name] = min(best.get(name, seconds), seconds)

    for _ in range(repeats):
        for kept in (True, False):
            seconds, sealed = _seal_all(nbytes, segments, kept)
            keep("seal: kept, mprotect + F_SEAL_FUTURE_WRITE" if kept else "seal: bridge, mapped again + F_SEAL_WRITE",
                 seconds)
            if kept:
                keep("receiver: map with MAP_POPULATE", _receive(sealed, populate=True))
                keep("receiver: map lazily, read every page", _receive(sealed, populate=False))
            total = sum(seg.nbytes for seg in sealed)
            for seg in sealed:
                seg.close_fd()
            del sealed
    return {"machine": machine(), "bytes": total, "segments": segments, "repeats": repeats,
            "seconds": best, "seconds_per_gb": {k: v / (total / 1e9) for k, v in best.items()}}


def print_table(result: dict) -> None:
    print(describe())
    print(f"{result['bytes'] / 1e9:.2f} GB in {result['segments']} segments, best of {result['repeats']}; "
          f"page size {PAGE} bytes; kernel {os.uname().release}")
    print(f"{'step':<46} {'seconds':>8} {'s per GB':>9}")
    for name, seconds in result["seconds"].items():
        print(f"{name:<46} {seconds:8.3f} {result['seconds_per_gb'][name]:9.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.34, help="model size in GB (default: the 1.2B Llama's 2.34)")
    parser.add_argument("--segments", type=int, default=91, help="tensors, one segment each (default 91)")
    parser.add_argument("--repeats", type=int, default=3, help="runs; the best is kept (default 3)")
    parser.add_argument("--json", action="store_true", help="also print the JSON result as the last line")
    args = parser.parse_args()
    result = run(args.gb, args.segments, args.repeats)
    print_table(result)
    write_results(RESULTS / "seal_cost.json", result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
