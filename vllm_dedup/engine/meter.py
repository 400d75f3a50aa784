"""What one ``load_model`` call cost: wall time, the growth of the worker's memory, and the
checkpoint bytes read (reported per engine, docs/architecture.md, "Loading only what is not resident").

Memory growth is the peak, sampled every few milliseconds on a background thread, of the
process's private memory above its level when the load began: ``RssAnon`` (anonymous resident
pages) on the CPU backend, torch's allocated device memory on a GPU.  Pages of a segment mapped
from another engine are not private and do not count; segments this engine creates are new
memory and are added *in the same sample*, as they exist at that moment (``live``): a private
copy freed once its segment is made is not counted twice.  A sample reads private memory first
and ``live`` second, so bytes moved into a segment between the two reads count twice: the peak
can err high by what moves in that instant, never low, while the thread samples.  Where no
thread can be started (a pids limit) only the load's end is sampled, and the peak is then
that (a debug line says so).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..log import init_logger
from ..segments import segment_class

__all__ = ["LoadMeter", "private_bytes"]

logger = init_logger(__name__)


def private_bytes(device_type: str) -> int:
    """The process's private memory on a device type now, in bytes (`Segment.private_bytes`:
    ``RssAnon`` on the CPU, ``torch.cuda.memory_allocated()`` on a GPU)."""
    return segment_class(device_type).private_bytes()


class LoadMeter:
    """Measures one load (a context manager).

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (`private_bytes`).
        interval_s: seconds between two samples.
        live: bytes of memory the load holds outside private memory at the moment of the call
            (the segments it created and still holds), added to each sample; read from the
            sampling thread.

    Attributes:
        seconds: wall time of the ``with`` block.
        peak_growth: the peak of private memory (plus ``live``) above its level at entry, in bytes.
    """

    def __init__(self, device_type: str, interval_s: float = 0.002, live: Callable[[], int] | None = None):
        self.device_type = device_type
        self.interval_s = interval_s
        self.live = live or (lambda: 0)
        self.seconds = 0.0
        self.peak_growth = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="vllm-dedup-meter", daemon=True)

    def __enter__(self) -> LoadMeter:
        self._cuda_device = None
        if self.device_type == "cuda":  # the load's device, for the sampling thread
            import torch

            self._cuda_device = torch.cuda.current_device()
        self._base = private_bytes(self.device_type) + self.live()
        self._start = time.perf_counter()
        try:
            self._thread.start()
        except RuntimeError as e:  # no thread to be had (a pids limit): the peak is sampled at the end only
            logger.debug("the load's peak memory is sampled at its end only (%s)", e)
            self._thread = None
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._note()
        self.seconds = time.perf_counter() - self._start

    def _note(self) -> None:
        self.peak_growth = max(self.peak_growth, private_bytes(self.device_type) + self.live() - self._base)

    def _sample(self) -> None:
        if self._cuda_device is not None:  # CUDA's current device is per thread: a new one's is GPU 0
            import torch

            torch.cuda.set_device(self._cuda_device)
        while not self._stop.wait(self.interval_s):
            try:
                self._note()
            except Exception as e:  # one sample missed, not the rest of the load's
                logger.debug("a sample of the load's memory failed (%s: %s)", type(e).__name__, e)

    @property
    def peak_bytes(self) -> int:
        """The peak growth in bytes, at least 0."""
        return max(self.peak_growth, 0)
