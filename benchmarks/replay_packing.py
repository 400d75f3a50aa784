#!/usr/bin/env python
"""What the N-th engine's replay pays for vLLM's oneDNN packing of its linear layers (CPU,
``cpu_linear="packed"``), one layout of the placeholder and the heap against another.

Usage: ``.venv/bin/python benchmarks/replay_packing.py [--preset {llama-1.2b,smollm2}] [--repeats 3] [--json]``

A replay cannot make a linear layer's oneDNN handler without letting vLLM pack a weight of the
layer's shape (``create_onednn_mm``); the recipe's segment then replaces the packing and the
buffer is freed (Note [packed weights replayed]).  Here every linear layer of the preset's
Llama shape (the 1.2B model of ``load_time.py``: 22 layers of qkv, o, gate_up and down) is
packed in turn, the handler dropped right after as the replay's install frees it, one way per
row, on the same machine in the same run:

- **real weight, glibc's heap as it is**: what a plain load packs (random bf16 bytes);
- **zero pages, row-major**: the placeholder before this benchmark existed, a full row-major
  view of read-only zero pages, in `heap.reused_heap` (blocks over 32 MiB still mapped anew);
- **zero row broadcast**: `packed.ZeroPages` (one row of zero pages, stride 0 over the rows),
  same heap;
- **zero row broadcast, large blocks from the heap**: what the replay does
  (`heap.reused_heap(large_blocks=True)`, Note [large blocks from the heap]).

The embedding and an untied head are left out: a replay packs their real weights.  Each figure
is the best of ``--repeats`` passes over the model, in seconds, with torch and oneDNN on
``--threads`` threads (1: an engine bound to one core).  Prints the CPU flags and a table;
writes ``benchmarks/results/replay_packing.json`` (``--json``: also the last line of stdout).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.machine import describe, machine  # noqa: E402
from harness.results import write_results  # noqa: E402
from harness.sample_models import LLAMA_1B_CONFIG  # noqa: E402
from vllm_dedup.engine.heap import reused_heap  # noqa: E402
from vllm_dedup.engine.packed import ZeroPages  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PRESETS = {  # Llama shapes: (hidden, intermediate, layers, heads, kv heads, head dim)
    "llama-1.2b": (LLAMA_1B_CONFIG["hidden_size"], LLAMA_1B_CONFIG["intermediate_size"],
                   LLAMA_1B_CONFIG["num_hidden_layers"], LLAMA_1B_CONFIG["num_attention_heads"],
                   LLAMA_1B_CONFIG["num_key_value_heads"], 64),
    "smollm2": (576, 1536, 30, 9, 3, 64),  # SmolLM2-135M-Instruct's config.json
}


def linear_shapes(preset: str) -> list[tuple[int, int]]:
    """``(N, K)`` of every linear layer's weight, in model order (vLLM's merged qkv and
    gate_up projections)."""
    hidden, inter, layers, heads, kv_heads, head_dim = PRESETS[preset]
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
             (hidden, inter)]
    return layer * layers


def _row_major_zero_pages(shape: tuple[int, int]) -> torch.Tensor:
    """The placeholder as it was: a row-major ``shape`` bf16 view of read-only zero pages."""
    pages = mmap.mmap(-1, shape[0] * shape[1] * 2, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(pages, dtype=torch.bfloat16).view(shape)


def pass_seconds(shapes, weight_of, heap) -> float:
    """Seconds to pack every shape once, each handler dropped before the next is made."""
    from vllm import _custom_ops as ops

    weights = {shape: weight_of(shape) for shape in set(shapes)}  # made before the clock starts
    with heap():
        start = time.perf_counter()
        for shape in shapes:
            handler = ops.create_onednn_mm(weights[shape].t(), 32)
            del handler  # the replay's install frees the packed buffer here
        return time.perf_counter() - start


def run(preset: str, repeats: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    shapes = linear_shapes(preset)
    zeros = ZeroPages()
    ways = {
        "real weight, glibc's heap as it is": (lambda s: torch.randn(s, dtype=torch.bfloat16), contextlib.nullcontext),
        "zero pages, row-major": (_row_major_zero_pages, reused_heap),
        "zero row broadcast": (lambda s: zeros.tensor(torch.bfloat16, torch.Size(s)), reused_heap),
        "zero row broadcast, large blocks from the heap": (lambda s: zeros.tensor(torch.bfloat16, torch.Size(s)),
                                                            lambda: reused_heap(large_blocks=True)),
    }
    best: dict[str, float] = {}
    for _ in range(repeats):  # interleaved, so that a noisy moment hits every way alike
        for name, (weight_of, heap) in ways.items():
            seconds = pass_seconds(shapes, weight_of, heap)
            best[name] = min(best.get(name, seconds), seconds)
    return {"machine": machine(), "preset": preset, "threads": threads, "repeats": repeats,
            "linear_layers": len(shapes), "packed_bytes": sum(n * k * 2 for n, k in shapes), "seconds": best}


def print_table(result: dict) -> None:
    print(describe())
    print(f"{result['preset']}: {result['linear_layers']} linear layers, {result['packed_bytes'] / 1e9:.2f} GB bf16; "
          f"{result['threads']} thread(s); best of {result['repeats']}")
    first = next(iter(result["seconds"].values()))
    print(f"{'placeholder and heap':<48} {'seconds':>8} {'vs real':>8}")
    for name, seconds in result["seconds"].items():
        print(f"{name:<48} {seconds:8.3f} {seconds / first:7.0%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-1.2b")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the model; the best is kept (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch and oneDNN threads (default 1)")
    parser.add_argument("--json", action="store_true", help="also print the JSON result as the last line")
    args = parser.parse_args()
    try:
        result = run(args.preset, args.repeats, args.threads)
    except RuntimeError as e:  # oneDNN cannot make a bfloat16 matmul here (AVX2): vLLM runs F.linear
        print(f"{describe()}\noneDNN cannot pack bfloat16 on this CPU ({e}); vLLM does not pack, nothing to measure")
        return 1
    print_table(result)
    write_results(RESULTS / f"replay_packing-{args.preset}.json", result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
