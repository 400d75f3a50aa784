"""CUDA segments: CUDA virtual memory management through NVIDIA's ``cuda-bindings``.

Why VMM and not legacy CUDA IPC (``cudaIpcGetMemHandle``, torch's ``reduce_tensor``): an IPC
handle dies with the process that exported it, while a VMM allocation exported as a POSIX file
descriptor lives as long as any descriptor, handle or mapping of it does.  The engine that
loaded a tensor first can exit, even by SIGKILL, and the others keep computing (docs/architecture.md,
"Segments").  The registry keeps one descriptor per segment, so it decides when memory is freed.

Creating a segment (the engine that loads a tensor first):
``cuMemCreate`` (pinned device memory, POSIX-descriptor handle type, size rounded up to the
device's granularity, 2 MiB on current GPUs) -> ``cuMemExportToShareableHandle`` (the
descriptor the broker passes on) -> ``cuMemAddressReserve`` + ``cuMemMap`` + ``cuMemSetAccess``
(read-write) -> copy the tensors in -> ``cuMemSetAccess`` read-only.  Mapping another engine's
segment: ``cuMemImportFromShareableHandle`` -> reserve, map, ``cuMemSetAccess`` read-only.  In
both, the allocation handle is released right after mapping: the mapping (and the descriptor)
keep the memory, so nothing else has to be freed later.

Read-only access (``CU_MEM_ACCESS_FLAGS_PROT_READ``) makes a stray in-place write fault instead
of silently changing every engine's weights.  Where the driver refuses it, the mapping falls
back to read-write, `CudaSegment.read_only` says so and a warning is logged once.

Tensors: a `_Mapping` exposes ``__cuda_array_interface__``; ``torch.as_tensor`` wraps it without
a copy and keeps a reference to it in the tensor's storage, so the range is unmapped exactly
when the last tensor over it is freed (`_Mapping.__del__`).

Devices are named by GPU UUID (``cuda:GPU-xxxxxxxx-...``), not by ordinal: two engines with
different ``CUDA_VISIBLE_DEVICES`` call the same GPU by different numbers.
"""

from __future__ import annotations

import logging
import os
import threading

from ..content.views import typed_view
from ..errors import SegmentError
from .base import Segment

__all__ = ["CudaError", "CudaSegment"]

logger = logging.getLogger("vllm.dedup.segments")

_state_lock = threading.Lock()
_contexts: dict[int, object] = {}  # ordinal -> retained primary context
_granularity: dict[int, int] = {}  # ordinal -> bytes
_read_only_refused = False


class CudaError(SegmentError):
    """A CUDA driver call failed, or the driver (or cuda-bindings) is missing."""


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        raise CudaError(
            "vllm-dedup's CUDA segments need NVIDIA's cuda-bindings: pip install 'vllm-dedup[cuda]' "
            "(or 'cuda-bindings>=12.8')"
        ) from None
    return driver


def _call(name: str, *args):
    """Call driver function ``name``; return its outputs after the status (one value unwrapped).

    Raises:
        CudaError: the status is not CUDA_SUCCESS (message: the driver's error name and text), or
            the driver library cannot be loaded.
    """
    drv = _driver()
    try:
        out = getattr(drv, name)(*args)
    except (OSError, RuntimeError) as e:  # cuda.pathfinder's DynamicLibNotFoundError is a RuntimeError
        raise CudaError(f"{name}: the CUDA driver is not usable here ({e})") from None
    status, rest = out[0], out[1:]
    if status != drv.CUresult.CUDA_SUCCESS:
        _, err_name = drv.cuGetErrorName(status)
        _, err_text = drv.cuGetErrorString(status)
        raise CudaError(f"{name} failed: {_text(err_name)} ({_text(err_text)})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def _text(b) -> str:
    return b.decode() if isinstance(b, bytes) else str(b)


def _make_current(ordinal: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    with _state_lock:
        ctx = _contexts.get(ordinal)
        if ctx is None:
            _call("cuInit", 0)
            ctx = _call("cuDevicePrimaryCtxRetain", _call("cuDeviceGet", ordinal))
            _contexts[ordinal] = ctx
    _call("cuCtxSetCurrent", ctx)


def _allocation_prop(ordinal: int):
    drv = _driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _ordinal(device) -> int:
    """This process's ordinal of a torch device, a ``cuda:GPU-...`` key or an ordinal."""
    import torch

    if isinstance(device, str) and device.startswith("cuda:GPU-"):
        for i in range(torch.cuda.device_count()):
            if _uuid_key(i) == device:
                return i
        raise CudaError(f"no visible CUDA device has the UUID in {device!r} (check CUDA_VISIBLE_DEVICES)")
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise CudaError(f"not a CUDA device: {device!r}")
    return torch.cuda.current_device() if dev.index is None else dev.index


def _uuid_key(ordinal: int) -> str:
    _call("cuInit", 0)  # process-wide and idempotent; torch has usually done it already
    raw = bytes(_call("cuDeviceGetUuid", _call("cuDeviceGet", ordinal)).bytes)
    h = raw.hex()
    return f"cuda:GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _access_desc(ordinal: int, read_only: bool):
    drv = _driver()
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = (drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ if read_only
                  else drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    return desc


class _Mapping:
    """A reserved and mapped virtual-address range of one allocation in this process.

    Unmapped and its address range freed when garbage-collected, i.e. once the last torch
    tensor made from it (which holds a reference, see the module docstring) is gone.
    """

    def __init__(self, handle, size: int, ordinal: int, read_only: bool):
        self.size, self.ordinal, self.va = size, ordinal, 0
        va = _call("cuMemAddressReserve", size, 0, 0, 0)
        try:
            _call("cuMemMap", va, size, 0, handle, 0)
        except CudaError:
            _call("cuMemAddressFree", va, size)
            raise
        self.va = int(va)
        self.read_only = False
        try:
            if not (read_only and self.protect()):
                _call("cuMemSetAccess", self.va, size, [_access_desc(ordinal, False)], 1)
        except CudaError:
            self._unmap()
            raise

    def protect(self) -> bool:
        """Make the range read-only for this device.  Returns False (and logs once) where the
        driver refuses read-only access; the range's access is then unchanged."""
        global _read_only_refused
        try:
            _call("cuMemSetAccess", self.va, self.size, [_access_desc(self.ordinal, True)], 1)
            self.read_only = True
        except CudaError as e:
            if not _read_only_refused:
                _read_only_refused = True
                logger.warning("vllm-dedup: the CUDA driver refuses read-only mappings (%s); shared weights "
                               "are mapped read-write, so a stray in-place write would not fault", e)
        return self.read_only

    @property
    def __cuda_array_interface__(self) -> dict:
        # torch ignores the read-only flag; the mapping's access flags are what protect it.
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.va, False), "version": 2}

    def bytes_tensor(self):
        """The whole range as a 1-d uint8 torch tensor (no copy; keeps this mapping alive)."""
        import torch

        raw = torch.as_tensor(self)
        if raw.device.index != self.ordinal or raw.data_ptr() != self.va:
            raise CudaError(f"torch wrapped the mapping at {raw.device}/{raw.data_ptr():#x}, "
                            f"expected cuda:{self.ordinal}/{self.va:#x}")
        return raw

    def _unmap(self) -> None:
        if self.va:
            va, self.va = self.va, 0
            _make_current(self.ordinal)
            # Kernels still reading the range must finish before it goes (unmap is not
            # stream-ordered).  Weights are freed rarely: engine shutdown.
            _call("cuCtxSynchronize")
            _call("cuMemUnmap", va, self.size)
            _call("cuMemAddressFree", va, self.size)

    def __del__(self):
        try:
            self._unmap()
        except Exception:  # interpreter shutdown: the context may already be gone
            pass


class CudaSegment(Segment):
    """A VMM allocation on one GPU, its exported descriptor and this process's mapping.

    Attributes:
        nbytes: usable bytes; the allocation is ``granularity`` rounded (``size``).
        size: the mapped allocation's size in bytes (a multiple of the granularity).
        device: ``cuda:GPU-<uuid>``.
        read_only: this process's mapping refuses writes (False where the driver refused).
    """

    def __init__(self, mapping: _Mapping, fd: int, nbytes: int, device: str):
        self._mapping = mapping
        self._fd = fd
        self.nbytes = nbytes
        self.size = mapping.size
        self.device = device
        self.read_only = mapping.read_only

    @classmethod
    def device_key(cls, device) -> str:
        """``cuda:GPU-<uuid>`` of a torch CUDA device (``torch.device``, ``"cuda:1"``, ordinal).

        Raises:
            CudaError: not a CUDA device, or the driver is not usable.
        """
        ordinal = _ordinal(device)
        _make_current(ordinal)
        return _uuid_key(ordinal)

    @classmethod
    def granularity(cls, device) -> int:
        """The device's minimum VMM allocation granularity in bytes (2 MiB on current GPUs).

        Raises:
            CudaError: the driver is not usable.
        """
        ordinal = _ordinal(device)
        with _state_lock:
            if ordinal in _granularity:
                return _granularity[ordinal]
        _make_current(ordinal)
        drv = _driver()
        gran = int(_call("cuMemGetAllocationGranularity", _allocation_prop(ordinal),
                         drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        with _state_lock:
            _granularity[ordinal] = gran
        return gran

    @classmethod
    def create_packed(cls, parts, nbytes: int, device: str | None = None) -> CudaSegment:
        """Allocate a segment on the parts' GPU, copy each ``(tensor, offset)`` in, and export it.

        Args:
            parts: ``(tensor, offset)`` pairs of contiguous CUDA tensors, all on one device.
            nbytes: usable bytes (rounded up to the granularity for the allocation).
            device: the device's key; computed from the tensors when None.

        Raises:
            ValueError: no parts, parts on different devices, or a part past ``nbytes``.
            CudaError: a driver call failed (out of device memory: ``CUDA_ERROR_OUT_OF_MEMORY``).
        """
        import torch

        if not parts:
            raise ValueError("create_packed needs at least one tensor")
        devices = {t.device for t, _ in parts}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"all parts must be on one CUDA device, got {sorted(map(str, devices))}")
        ordinal = _ordinal(next(iter(devices)))
        key = device or cls.device_key(ordinal)
        for t, offset in parts:
            size = t.numel() * t.element_size()
            if offset < 0 or offset + size > nbytes:
                raise ValueError(f"a {size}-byte part at offset {offset} does not fit in {nbytes} bytes")
        gran = cls.granularity(ordinal)
        size = -(-max(nbytes, 1) // gran) * gran
        _make_current(ordinal)
        drv = _driver()
        handle = _call("cuMemCreate", size, _allocation_prop(ordinal), 0)
        fd = -1
        try:
            fd = int(_call("cuMemExportToShareableHandle", handle,
                           drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
            mapping = _Mapping(handle, size, ordinal, read_only=False)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        finally:
            _call("cuMemRelease", handle)  # the mapping and the descriptor keep the memory
        try:
            raw = mapping.bytes_tensor()
            with torch.cuda.device(ordinal):
                for t, offset in parts:
                    src = t.detach().reshape(-1).view(torch.uint8)
                    raw[offset : offset + src.numel()].copy_(src)
                torch.cuda.synchronize(ordinal)
            del raw
            mapping.protect()
        except BaseException:
            os.close(fd)
            raise
        return cls(mapping, fd, nbytes, key)

    @classmethod
    def attach(cls, fd: int, nbytes: int, device: str) -> CudaSegment:
        """Map another engine's segment read-only.  Takes ownership of ``fd``.

        Args:
            fd: the segment's exported POSIX descriptor (from the broker).
            nbytes: bytes this process needs (the hit's offset plus its size).
            device: the device key the registry filed the segment under.

        Raises:
            SegmentError: the descriptor is not a CUDA allocation of at least ``nbytes`` on
                ``device`` (import or map refused).
            CudaError: the driver is not usable, or the device is not visible here.
        """
        try:
            ordinal = _ordinal(device)
            size = -(-max(nbytes, 1) // cls.granularity(ordinal)) * cls.granularity(ordinal)
            _make_current(ordinal)
        except BaseException:
            os.close(fd)
            raise
        drv = _driver()
        try:
            handle = _call("cuMemImportFromShareableHandle", fd,
                           drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        except CudaError as e:
            os.close(fd)
            raise SegmentError(f"received descriptor is not a CUDA allocation ({e})") from None
        try:
            mapping = _Mapping(handle, size, ordinal, read_only=True)
        except CudaError as e:
            os.close(fd)
            raise SegmentError(f"cannot map {size} bytes of the received allocation ({e})") from None
        finally:
            _call("cuMemRelease", handle)
        return cls(mapping, fd, nbytes, device)

    def tensor(self, offset: int, dtype, shape, stride):
        return typed_view(self._mapping.bytes_tensor()[: self.nbytes], offset, dtype, shape, stride)
