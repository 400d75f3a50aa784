"""Scan throughput on a >= 1 GB checkpoint, next to the raw rates of BLAKE3 (the source keys'
hash), XXH3 (the content keys') and SHA-256, measured in the same run.

    .venv/bin/python benchmarks/scan_throughput.py [--model DIR] [--repeat 3] [--json]

Without ``--model`` the checkpoint is the real SmolLM2-135M-Instruct saved in float64
(1.08 GB, 272 tensors), built once under the cache directory: no model of 1 GB or more installs
offline here, and float64 keeps the real weights while doubling their size twice.

Rows (each the best of ``--repeat`` runs, the file warm in the page cache):
- ``<hash> raw``: the hash over an in-memory buffer as large as the checkpoint's tensors, one
  thread (BLAKE3 also with its own threads): each hash's ceiling here.  The scan hashes with
  BLAKE3-256 (source keys must be collision-resistant: README, "Trust"), so its ratio is to
  raw BLAKE3 on one thread.
- ``scan warm, 1 thread`` / ``scan warm, N threads``: `scan_model` without the manifest cache:
  open, mmap, hash every tensor.
- ``scan with manifest``: `scan_model` with the manifest cache filled (reads no tensor bytes).

GB/s are tensor bytes (10^9) per second of wall time.  The table goes to stdout; the JSON is
written to ``benchmarks/results/scan_throughput.json`` (and printed as the last line with
``--json``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import hashlib

import blake3
import numpy as np
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.machine import describe, machine  # noqa: E402
from harness.results import write_results  # noqa: E402
from vllm_dedup.checkpoint.manifest import ManifestCache, default_cache_dir  # noqa: E402
from vllm_dedup.scan.files import scan_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def float64_smollm2() -> Path:
    """SmolLM2-135M-Instruct's real weights in float64: a 1.08 GB safetensors checkpoint."""
    from harness.sample_models import smollm2_hf
    from harness.variants import load_state_dict, save_state_dict

    out = default_cache_dir() / "bench" / "SmolLM2-135M-Instruct-float64"
    if not (out / "model.safetensors").exists():
        tensors = {k: v.double() for k, v in load_state_dict(smollm2_hf()).items()}
        tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        save_state_dict(tensors, tmp)
        os.replace(tmp, out)
    return out


RAW_HASHES = {  # case -> hash of a buffer
    "blake3-256 raw, 1 thread": lambda buf: blake3.blake3(buf).digest(),
    "blake3-256 raw, its threads": lambda buf: blake3.blake3(buf, max_threads=blake3.blake3.AUTO).digest(),
    "xxh3-128 raw, 1 thread": xxhash.xxh3_128_digest,
    "sha-256 raw, 1 thread": lambda buf: hashlib.sha256(buf).digest(),
}


def raw_seconds(nbytes: int, repeat: int) -> dict[str, float]:
    """Best time of each `RAW_HASHES` over ``nbytes`` of random bytes in memory."""
    buf = np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype=np.uint8)
    return {case: best_of(repeat, lambda fn=fn: fn(buf))[0] for case, fn in RAW_HASHES.items()}


def best_of(repeat: int, fn) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model folder or file (default: SmolLM2 in float64)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the JSON result as the last line")
    args = parser.parse_args()

    model = args.model or float64_smollm2()
    warm = scan_model(model, threads=1, progress=False)  # also pulls the file into the page cache
    nbytes = sum(t.entry.nbytes for t in warm.tensors)
    threads = os.cpu_count() or 1

    raw = raw_seconds(nbytes, args.repeat)
    raw_s = raw["blake3-256 raw, 1 thread"]

    rows = [(case, s, None) for case, s in raw.items()]
    for n in sorted({1, threads}):
        s, scan = best_of(args.repeat, lambda n=n: scan_model(model, threads=n, progress=False))
        rows.append((f"scan warm, {n} thread{'s' * (n > 1)}", s, scan.hashed_bytes))
    with tempfile.TemporaryDirectory() as tmp:
        cache = ManifestCache(Path(tmp))
        scan_model(model, cache=cache, progress=False)
        s, scan = best_of(args.repeat, lambda: scan_model(model, cache=cache, progress=False))
        assert scan.hashed_bytes == 0 and scan.cached_files == len({t.file for t in scan.tensors})
        rows.append(("scan with manifest", s, scan.hashed_bytes))

    raw_rate = nbytes / raw_s / 1e9
    result = {
        "machine": machine(),
        "model": str(model),
        "tensor_bytes": nbytes,
        "tensors": len(warm.tensors),
        "cpu_count": threads,
        "rows": [
            {"case": case, "seconds": round(s, 5), "gb_per_s": round(nbytes / s / 1e9, 3),
             "hashed_bytes": hashed, "ratio_to_raw": round(nbytes / s / 1e9 / raw_rate, 3)}
            for case, s, hashed in rows
        ],
    }
    best_warm = max(r["gb_per_s"] for r in result["rows"] if r["case"].startswith("scan warm"))
    result["warm_scan_over_raw"] = round(best_warm / raw_rate, 3)

    print(describe())
    print(f"model: {model}  ({nbytes / 1e9:.2f} GB of tensors, {len(warm.tensors)} tensors, {threads} CPUs)")
    print(f"{'case':<26} {'seconds':>9} {'GB/s':>8} {'x raw':>7} {'hashed bytes':>14}")
    for r in result["rows"]:
        hashed = "-" if r["hashed_bytes"] is None else str(r["hashed_bytes"])
        print(f"{r['case']:<26} {r['seconds']:>9.4f} {r['gb_per_s']:>8.2f} {r['ratio_to_raw']:>7.2f} {hashed:>14}")
    print(f"best warm scan / raw blake3 (1 thread): {result['warm_scan_over_raw']:.2f}  (target >= 0.5)")
    write_results(RESULTS / "scan_throughput.json", result, args.json)


if __name__ == "__main__":
    main()
