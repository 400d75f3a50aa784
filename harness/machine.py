"""The machine a benchmark ran on, as its tables and JSON state it.  Not shipped.

Figures differ between x86-64 CPUs (AVX2 vs AVX-512 with BF16 changes vLLM's CPU kernels and
their rounding), so every benchmark prints `describe` and stores `machine` with its results.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ISA_FLAGS", "cpu_flags", "describe", "machine"]

# The flags that change which of vLLM's CPU kernels run, and how they round.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_flags() -> list[str]:
    """The `ISA_FLAGS` this CPU has (from ``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [f for f in ISA_FLAGS if f in flags]


def machine() -> dict:
    """``{"cpu": model name, "isa": [flags], "cores": n, "memory_bytes": total}``."""
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
        memory = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                          if line.startswith("MemTotal:"))) * 1024
    except (OSError, StopIteration, ValueError):
        memory = 0
    return {"cpu": model, "isa": cpu_flags(), "cores": os.cpu_count() or 1, "memory_bytes": memory}


def describe() -> str:
    """One line: CPU model, ISA flags, cores, memory."""
    m = machine()
    return (f"machine: {m['cpu'] or 'unknown CPU'}; ISA {' '.join(m['isa']) or 'none of ' + ','.join(ISA_FLAGS)}; "
            f"{m['cores']} cores; {m['memory_bytes'] / (1 << 30):.0f} GiB")
