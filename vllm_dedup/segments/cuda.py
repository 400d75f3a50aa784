"""CUDA segments: CUDA virtual memory management allocations, seen as torch tensors.

Why VMM and not legacy CUDA IPC (``cudaIpcGetMemHandle``, torch's ``reduce_tensor``): an IPC
handle dies with the process that exported it, while a VMM allocation exported as a POSIX file
descriptor lives as long as any descriptor, handle or mapping of it does.  The engine that
loaded a tensor first can exit, even by SIGKILL, and the others keep computing (docs/architecture.md,
"Segments").  The registry keeps one descriptor per segment, so it decides when memory is freed.

Layers: `segments.cudadrv` (the driver: devices, contexts, support checks) and `segments.vmm`
(allocate, export, import, map, protect, unmap) hold every driver call and run in CI against a
model of the driver; this module only checks arguments, copies tensors in and wraps a mapping
as a tensor (``__cuda_array_interface__``), which needs a GPU (``benchmarks/gpu_check.py``).

Unlike a sealed memfd, a CUDA allocation cannot be sealed: any process holding its descriptor
could map it read-write.  Importers map read-only; share groups (the registry never hands a
group's descriptors to another) are the isolation.

Devices are named by GPU UUID (``cuda:GPU-xxxxxxxx-...``), not by ordinal: two engines with
different ``CUDA_VISIBLE_DEVICES`` call the same GPU by different numbers.
"""

from __future__ import annotations

import functools
import os
import threading

from ..content.views import typed_view
from ..errors import SegmentError
from ..log import init_logger
from . import cudadrv, vmm
from .base import Segment
from .cudadrv import CudaError

__all__ = ["CudaError", "CudaSegment", "GraphCaptures", "captures"]

logger = init_logger(__name__)
_warned_versions = False


def _ordinal(device) -> int:
    """This process's ordinal of a torch device, a ``cuda:GPU-...`` key or an ordinal."""
    if isinstance(device, int):
        return device
    if isinstance(device, str) and device.startswith("cuda:GPU-"):
        return cudadrv.ordinal_of(device)
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        raise CudaError(f"not a CUDA device: {device!r}")
    return torch.cuda.current_device() if dev.index is None else dev.index


class GraphCaptures:
    """How many CUDA graph captures are underway in this process, on any thread.

    A mapping's finalizer can run on any thread (whichever drops the last reference, or runs the
    garbage collector), while another thread captures a graph: torch's
    ``is_current_stream_capturing`` sees only the finalizing thread's stream, and a
    ``cuCtxSynchronize`` during another thread's capture fails and invalidates it (CUDA Driver
    API, ``cuThreadExchangeStreamCaptureMode``: in ``CU_STREAM_CAPTURE_MODE_GLOBAL``, the
    default and torch's, potentially unsafe calls are prohibited from any thread).  So captures are
    counted where every one of torch's begins and ends: ``torch.cuda.CUDAGraph.capture_begin``
    and ``capture_end`` (``torch.cuda.graph`` and vLLM's and inductor's CUDA graph wrappers all
    go through them), wrapped once per process by `track`.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._count = 0

    def underway(self) -> bool:
        """True from a tracked ``capture_begin`` until its ``capture_end``, on any thread."""
        with self._lock:
            return self._count > 0

    def track(self, cls) -> None:
        """Count the captures of ``cls`` (torch's ``CUDAGraph``: ``capture_begin`` /
        ``capture_end`` methods).  Idempotent, also for a subclass of a tracked class: each
        method is wrapped unless what ``cls`` resolves it to is wrapped already."""
        with self._lock:
            begin, end = cls.capture_begin, cls.capture_end
            if getattr(begin, "_counted_by", None) is not self:
                @functools.wraps(begin)
                def capture_begin(graph, *args, **kwargs):
                    self._add(1)
                    try:
                        return begin(graph, *args, **kwargs)
                    except BaseException:  # no capture began
                        self._add(-1)
                        raise

                capture_begin._counted_by = self
                cls.capture_begin = capture_begin
            if getattr(end, "_counted_by", None) is not self:
                @functools.wraps(end)
                def capture_end(graph, *args, **kwargs):
                    try:
                        return end(graph, *args, **kwargs)
                    finally:  # over, whether or not the graph was valid
                        self._add(-1)

                capture_end._counted_by = self
                cls.capture_end = capture_end

    def _add(self, n: int) -> None:
        with self._lock:
            self._count = max(0, self._count + n)


captures = GraphCaptures()


def _track_captures() -> None:
    import torch

    captures.track(torch.cuda.CUDAGraph)


def _capturing() -> bool:
    """Whether a CUDA graph may be being captured now, on this thread's stream or on any thread
    of this process (`GraphCaptures`): then a finalizer must not synchronize (`segments.vmm`).
    When unsure, say yes: a deferred unmap only waits."""
    if captures.underway():
        return True
    try:
        import torch

        return torch.cuda.is_current_stream_capturing()
    except Exception:
        return True


def _release_cached() -> None:
    """Give torch's cached blocks back to the driver (before retrying an out-of-memory create)."""
    import gc

    import torch

    gc.collect()  # tensors in reference cycles still hold blocks
    torch.cuda.empty_cache()


def _check_versions() -> None:
    """Warn once when cuda-bindings' CUDA major version differs from torch's."""
    global _warned_versions
    import torch

    try:
        from cuda.bindings import __version__
    except ImportError:
        return  # cudadrv.driver() says what to install
    if not _warned_versions and torch.version.cuda and torch.version.cuda.split(".")[0] != __version__.split(".")[0]:
        _warned_versions = True
        logger.warning("cuda-bindings %s does not match torch's CUDA %s; install the matching one "
                       "(pip install 'vllm-dedup[cuda%s]')", __version__, torch.version.cuda,
                       torch.version.cuda.split(".")[0])


class _Range:
    """``[offset, offset + nbytes)`` of a mapping as a 1-d ``uint8`` array for torch
    (``__cuda_array_interface__``); it holds the mapping, so a tensor over it keeps it alive."""

    def __init__(self, mapping: vmm.Mapping, offset: int, nbytes: int):
        if not 0 <= offset <= offset + nbytes <= mapping.size:
            raise ValueError(f"{nbytes} bytes at offset {offset} do not fit in a {mapping.size}-byte mapping")
        self.mapping, self.va, self.nbytes = mapping, mapping.va + offset, nbytes

    @property
    def __cuda_array_interface__(self) -> dict:
        # Consumers ignore the read-only flag; the range's access flags are what protect it.
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.va, False), "strides": None, "version": 2}


def _bytes_tensor(mapping: vmm.Mapping, offset: int = 0, nbytes: int | None = None):
    """``nbytes`` of the mapping from ``offset`` (default: all of it) as a 1-d uint8 CUDA tensor
    on its own device, with a storage of exactly those bytes (no copy; the tensor keeps the
    mapping alive)."""
    import torch

    rng = _Range(mapping, offset, mapping.size - offset if nbytes is None else nbytes)
    raw = torch.as_tensor(rng, device=torch.device("cuda", mapping.ordinal))
    if raw.data_ptr() != rng.va:  # torch copied instead of wrapping: never share a copy
        raise CudaError(f"torch wrapped the mapping at {raw.device}/{raw.data_ptr():#x}, expected "
                        f"cuda:{mapping.ordinal}/{rng.va:#x}")
    return raw


def _parts_ordinal(parts, nbytes: int) -> int:
    if not parts:
        raise SegmentError("create_packed needs at least one tensor")
    devices = {t.device for t, _ in parts}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise SegmentError(f"all parts must be on one CUDA device, got {sorted(map(str, devices))}")
    for t, offset in parts:
        size = t.numel() * t.element_size()
        if offset < 0 or offset + size > nbytes:
            raise SegmentError(f"a {size}-byte part at offset {offset} does not fit in {nbytes} bytes")
    return _ordinal(next(iter(devices)))


def _reraise(e: BaseException, what: str):
    """Raise ``e`` as a `SegmentError` (its own self when it is one, or not an Exception)."""
    if isinstance(e, SegmentError) or not isinstance(e, Exception):
        raise e
    raise SegmentError(f"{what} ({type(e).__name__}: {e})") from e


class CudaSegment(Segment):
    """A VMM allocation on one GPU, its exported descriptor and this process's mapping.

    Attributes:
        nbytes: usable bytes.
        size: bytes mapped here, a multiple of the granularity (the whole allocation, for the
            creator and for an importer: `mapped_bytes`).
        device: ``cuda:GPU-<uuid>``.
    """

    def __init__(self, mapping: vmm.Mapping, fd: int, nbytes: int, device: str):
        self._mapping = mapping
        self._fd = fd
        self.nbytes = nbytes
        self.size = mapping.size
        self.device = device

    @classmethod
    def content_keys(cls, tensors) -> list:
        """Device fingerprints of each tensor's bytes, computed on the GPU (`content.fingerprint`)."""
        from ..content.fingerprint import device_fingerprints, fingerprint_key

        return [fingerprint_key(t, d) for t, d in zip(tensors, device_fingerprints(tensors))]

    @classmethod
    def private_bytes(cls) -> int:
        """``torch.cuda.memory_allocated()``: bytes PyTorch's caching allocator has handed out on
        the current device (segments are VMM allocations outside it)."""
        import torch

        return torch.cuda.memory_allocated()

    @classmethod
    def return_cached(cls, collect: bool = True) -> None:
        """Free what the caching allocator keeps (``torch.cuda.empty_cache``), after a
        ``gc.collect()`` with ``collect``, so that swapped-out weights give their memory back to
        the driver."""
        import gc

        import torch

        if collect:
            gc.collect()
        torch.cuda.empty_cache()

    @classmethod
    def device_key(cls, device) -> str:
        """``cuda:GPU-<uuid>`` of a torch CUDA device (``torch.device``, ``"cuda:1"``, ordinal).
        Creates no CUDA context and leaves the current one as it is.

        Raises:
            CudaError: not a CUDA device, or the driver is not usable.
        """
        return cudadrv.device_key(_ordinal(device))

    @classmethod
    def granularity(cls, device) -> int:
        """The device's minimum VMM allocation granularity in bytes (2 MiB on current GPUs).

        Raises:
            CudaError: the driver is not usable.
        """
        return cudadrv.granularity(_ordinal(device))

    @classmethod
    def create_packed(cls, parts, nbytes: int, device: str | None = None) -> CudaSegment:
        """Allocate a segment on the parts' GPU, copy each ``(tensor, offset)`` in, make it
        read-only and export it.  The caller's current CUDA context is left as it was.

        Args:
            parts: ``(tensor, offset)`` pairs of contiguous CUDA tensors, all on one device;
                ``offset`` in bytes.
            nbytes: usable bytes (rounded up to the granularity for the allocation).
            device: the device's key; computed from the tensors when None.

        Raises:
            SegmentError: any failure (bad parts, no VMM support, out of device memory after
                one retry, a driver or copy error); nothing is left allocated.
        """
        try:
            ordinal = _parts_ordinal(parts, nbytes)
        except BaseException as e:
            _reraise(e, f"cannot create a CUDA segment of {nbytes} bytes")
        seg = cls.allocate(nbytes, device or ordinal)
        try:
            import torch

            with torch.cuda.device(ordinal):
                for t, offset in parts:
                    src = t.detach().reshape(-1).view(torch.uint8)
                    if src.numel():  # an empty part has no bytes to copy (and no member)
                        seg.member(offset, src.numel()).copy_(src)
            seg.freeze()
        except BaseException as e:
            seg.discard()
            _reraise(e, f"cannot copy {len(parts)} tensor(s) into a new CUDA segment")
        return seg

    @classmethod
    def allocate(cls, nbytes: int, device) -> CudaSegment:
        """A new exportable allocation of ``nbytes`` (rounded up to the granularity), mapped
        read-write here for this process to fill (`Segment.allocate`).  The caller's current
        CUDA context is left as it was.

        Args:
            nbytes: usable bytes.
            device: the device's key (``cuda:GPU-...``), a torch device or an ordinal.

        Raises:
            SegmentError: no VMM support, out of device memory after one retry (torch's cached
                blocks returned first), or a driver error; nothing is left allocated.
        """
        try:
            ordinal = _ordinal(device)
            _check_versions()
            _track_captures()
            key = device if isinstance(device, str) and device.startswith("cuda:GPU-") else cudadrv.device_key(ordinal)
            mapping, fd = vmm.allocate(ordinal, nbytes, release_cached=_release_cached, capturing=_capturing)
        except BaseException as e:
            _reraise(e, f"cannot create a CUDA segment of {nbytes} bytes")
        return cls(mapping, fd, nbytes, key)

    def member(self, offset: int, nbytes: int):
        """`Segment.member`: a uint8 CUDA tensor whose storage is exactly ``[offset, offset +
        nbytes)`` of the mapping (its own ``__cuda_array_interface__``)."""
        self._check_member(offset, nbytes)
        return _bytes_tensor(self._mapping, offset, nbytes)

    @property
    def read_only(self) -> bool:
        return self._mapping.read_only

    def freeze(self) -> None:
        """`Segment.freeze`: wait for the device (a weight loader's copy may still be writing),
        then make the mapping read-only (`vmm.Mapping.protect`).  A CUDA allocation cannot be
        sealed: any holder of its descriptor could map it writable (module docstring).  Where the
        driver refuses read-only access the segment stays writable here, as `create_packed`'s do
        (warned once).

        Raises:
            SegmentError: the synchronize failed.
        """
        try:
            self._mapping.protect(synchronize=True)
        except CudaError as e:
            raise SegmentError(f"cannot make a CUDA segment read-only: {e}") from None

    def discard(self) -> None:
        """Close the descriptor and unmap, for a segment never published whose tensors are
        gone (a failed `create_packed`)."""
        self.close_fd()
        try:
            self._mapping.close()
        except CudaError:
            logger.warning("could not unmap a CUDA segment that failed", exc_info=True)

    @classmethod
    def mapped_bytes(cls, needed: int, segment_bytes: int) -> int:
        """The whole allocation, ``segment_bytes``: the driver refuses to map part of an imported
        allocation (``CUDA_ERROR_NOT_SUPPORTED`` from ``cuMemMap`` on an H200, driver 580.159.04:
        docs/gpu-results.md), though the reference allows any ``size`` within it.  Mapping the
        rest costs address space only."""
        return segment_bytes

    @classmethod
    def attach(cls, fd: int, nbytes: int, device: str) -> CudaSegment:
        """Map another engine's segment read-only.  Takes ownership of ``fd`` (closed on failure).
        The caller's current CUDA context is left as it was.

        Args:
            fd: the segment's exported POSIX descriptor (from the registry).
            nbytes: bytes to map, rounded up to the granularity: the whole allocation
                (`mapped_bytes`).
            device: the device key the registry filed the segment under.

        Raises:
            SegmentError: the device is not visible or cannot share memory, or the descriptor
                is not a CUDA allocation of at least ``nbytes`` (import or map refused).
        """
        try:
            _check_versions()
            _track_captures()
            mapping = vmm.import_mapping(fd, nbytes, _ordinal(device), capturing=_capturing)
        except BaseException as e:
            os.close(fd)
            _reraise(e, f"cannot map a received CUDA segment of {nbytes} bytes")
        return cls(mapping, fd, nbytes, device)

    def tensor(self, offset: int, dtype, shape, stride):
        return typed_view(_bytes_tensor(self._mapping)[: self.nbytes], offset, dtype, shape, stride)
