"""What one ``load_model`` call cost: wall time, the growth of the worker's memory, and the
checkpoint bytes read (reported per engine, docs/architecture.md, "Loading only what is not resident").

Memory growth is the peak, sampled every few milliseconds on a background thread, of the
process's private memory above its level when the load began: ``RssAnon`` (anonymous resident
pages) on the CPU backend, torch's allocated device memory on a GPU.  Pages of a segment mapped
from another engine are not private and do not count; segments this engine creates are new
memory and are added (`LoadMeter.peak_bytes`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

__all__ = ["LoadMeter", "private_bytes"]


def private_bytes(device_type: str) -> int:
    """The process's private memory now, in bytes: ``RssAnon`` of ``/proc/self/status`` on the
    CPU, ``torch.cuda.memory_allocated()`` on a GPU."""
    if device_type == "cuda":
        import torch

        return torch.cuda.memory_allocated()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class LoadMeter:
    """Measures one load (a context manager).

    Attributes:
        seconds: wall time of the ``with`` block.
        peak_growth: the peak of private memory above its level at entry, in bytes.
    """

    def __init__(self, device_type: str, interval_s: float = 0.002):
        self.device_type = device_type
        self.interval_s = interval_s
        self.seconds = 0.0
        self.peak_growth = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="vllm-dedup-meter", daemon=True)

    def __enter__(self) -> LoadMeter:
        self._base = private_bytes(self.device_type)
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._note()
        self.seconds = time.perf_counter() - self._start

    def _note(self) -> None:
        self.peak_growth = max(self.peak_growth, private_bytes(self.device_type) - self._base)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._note()

    def peak_bytes(self, created_segment_bytes: int) -> int:
        """Peak private growth plus the bytes of the segments this engine created."""
        return max(self.peak_growth, 0) + created_segment_bytes
