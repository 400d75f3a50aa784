"""The machine a benchmark ran on, as its tables and JSON state it.  Not shipped.

Figures differ between x86-64 CPUs (AVX2 vs AVX-512 with BF16 changes vLLM's CPU kernels and
their rounding), so every benchmark prints `describe` and stores `machine` with its results.

Load times differ as much with how the kernel hands out memory (Note [fresh memory]), so
`describe` also says how it is set up (`memory_setup`), and a benchmark of load times measures
how fast fresh memory is at its start (`fresh_memory`).

Note [fresh memory]
    Most of what a load costs beyond reading the checkpoint is the kernel giving it new pages:
    anonymous ones for plain vLLM's tensors, shared memory (memfd) ones for a dedup engine's
    segments.  On the 2-core Firecracker VM this project's CI runs on, that cost moved 2.5 times
    between days (a 1.2B model's plain load 3.0 s one day, 7.5 s the next), and within one hour
    filling fresh memory ran anywhere from 0.5 to 8 GB/s, anonymous and memfd pages alike,
    depending on which free pages the kernel handed out: the VM gives free memory back to its
    host (virtio balloon free page reporting), and a page the host must supply again costs the
    most.  Shared memory transparent huge pages (``shmem_enabled``) change it again: with
    ``within_size`` a memfd filled 3 to 4 times faster than with ``never`` right after 3 GB
    had been freed, and no faster 10 s later; in separate runs of ``load_time.py --preset
    llama-1.2b`` minutes apart, the first dedup engine took 256% of plain's load with it
    against 144% with ``never`` (the second engine 22% against 29-39%: a huge page's mapping
    is one page-table entry, not 512).  So figures from different days or machines compare only
    beside these lines; ratios measured in one run stay comparable.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from pathlib import Path

__all__ = ["ISA_FLAGS", "cpu_flags", "describe", "fresh_memory", "machine", "memory_setup"]

# The flags that change which of vLLM's CPU kernels run, and how they round.
ISA_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16",
             "amx_int8", "amx_tile")


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
    return {"cpu": model, "isa": cpu_flags(), "cores": os.cpu_count() or 1, "memory_bytes": memory,
            "memory_setup": memory_setup()}


_THP = Path("/sys/kernel/mm/transparent_hugepage")


def _chosen(path: Path) -> str | None:
    """The bracketed choice of a sysfs setting such as ``always [madvise] never``; None where
    it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip() or None


def memory_setup() -> dict:
    """How this kernel hands out memory (Note [fresh memory]): ``{"shmem_thp": mode,
    "anonymous_thp": mode, "page_reporting_order": n}`` (None where unknown).  ``shmem_thp``
    is ``shmem_enabled`` (memfd segments), ``anonymous_thp`` is ``enabled``; a
    ``page_reporting_order`` (pages of ``2**n`` base pages) means the kernel can give free
    memory back to a hypervisor, and does where a virtio balloon is bound (``balloon``)."""
    try:
        order = int(Path("/sys/module/page_reporting/parameters/page_reporting_order").read_text())
    except (OSError, ValueError):
        order = None
    balloon = Path("/sys/bus/virtio/drivers/virtio_balloon")
    try:
        bound = any(p.name.startswith("virtio") for p in balloon.iterdir())
    except OSError:
        bound = False
    return {"shmem_thp": _chosen(_THP / "shmem_enabled"), "anonymous_thp": _chosen(_THP / "enabled"),
            "page_reporting_order": order, "balloon": bound}


def fresh_memory(nbytes: int = 256 << 20, rounds: int = 3) -> dict:
    """How fast this machine fills memory it has just handed out (Note [fresh memory]):
    ``{"memfd_gb_s": ..., "anonymous_gb_s": ...}``, the median of ``rounds`` fills of
    ``nbytes`` each (GB/s, 1e9 bytes), into a new memfd with ``pwrite`` (as a dedup engine
    fills its segments) and into a new anonymous mapping with a copy (as a plain load fills its
    tensors).  Each round's memory is freed before the next."""
    source = mmap.mmap(-1, nbytes)
    source.write(b"\x01" * nbytes)
    view = memoryview(source)
    chunk = 16 << 20
    memfd, anonymous = [], []
    try:
        for _ in range(rounds):
            fd = os.memfd_create("vllm-dedup-probe", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, nbytes)
                start, done = time.perf_counter(), 0
                while done < nbytes:
                    done += os.pwrite(fd, view[done:done + chunk], done)
                memfd.append(nbytes / (time.perf_counter() - start) / 1e9)
            finally:
                os.close(fd)
            target = mmap.mmap(-1, nbytes)
            try:
                start = time.perf_counter()
                target[:] = view
                anonymous.append(nbytes / (time.perf_counter() - start) / 1e9)
            finally:
                target.close()
    finally:
        view.release()
        source.close()
    return {"memfd_gb_s": round(statistics.median(memfd), 2), "anonymous_gb_s": round(statistics.median(anonymous), 2),
            "bytes": nbytes, "rounds": rounds}


def describe() -> str:
    """Two lines: CPU model, ISA flags, cores, memory; how the kernel hands out memory."""
    m = machine()
    s = m["memory_setup"]
    reporting = ("no free page reporting" if s["page_reporting_order"] is None else
                 f"free page reporting (order {s['page_reporting_order']}) "
                 f"{'with a virtio balloon bound: a VM giving free memory back to its host' if s['balloon'] else 'built in, no balloon bound'}")
    return (f"machine: {m['cpu'] or 'unknown CPU'}; ISA {' '.join(m['isa']) or 'none of ' + ','.join(ISA_FLAGS)}; "
            f"{m['cores']} cores; {m['memory_bytes'] / (1 << 30):.0f} GiB\n"
            f"memory: shmem THP {s['shmem_thp'] or 'unknown'}, anonymous THP {s['anonymous_thp'] or 'unknown'}; {reporting}")
