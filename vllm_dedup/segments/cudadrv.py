"""The CUDA driver for CUDA segments, through NVIDIA's ``cuda-bindings``: calls, devices,
contexts, support checks; no torch here.

Two layers sit below the torch tensors of `segments.cuda` (docs/architecture.md, "Segments"):
this one, and `segments.vmm` (allocate, export, import, reserve, map, protect, unmap).

Context discipline (as PyTorch's device guards and its expandable segments,
c10/cuda/CUDACachingAllocator.cpp): naming a device (`device_key`) needs no context at all
(``cuInit``, ``cuDeviceGet``, ``cuDeviceGetUuid``); every other call runs under `on_device`,
which pushes the device's primary context and pops it afterwards, so the caller's current
context (torch's current device) is never changed.  Each device's primary context is retained
once per process, on first use, the way the CUDA runtime does.

Failures raise `CudaError` (a `SegmentError`): the engine keeps the tensors concerned private.

Tested in CI against ``tests/cuda_model`` (a model of the documented driver contract over host
memory, not a GPU); ``benchmarks/gpu_check.py`` runs the same calls on a real GPU.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from ..errors import SegmentError
from ..log import init_logger

__all__ = ["CudaError", "allocation_prop", "call", "check_support", "device_count", "device_key", "driver",
           "granularity", "lock", "memory_info", "on_device", "ordinal_of", "refuse_device", "rounded"]

logger = init_logger(__name__)

# Re-entrant: a mapping's finalizer (vmm.Mapping) can run, at any allocation, while this thread
# holds it, and takes it again.
lock = threading.RLock()
_contexts: dict[int, object] = {}  # ordinal -> primary context, retained once per process
_granularity: dict[int, int] = {}  # ordinal -> bytes
_supported: set[int] = set()  # ordinals whose VMM and POSIX-descriptor support was checked
_refused: dict[int, str] = {}  # ordinal -> why it cannot share memory although its attributes say it can
_initialized = False

# The driver each cuda-bindings major version needs on Linux (nvidia.github.io/cuda-python,
# "Installation": 12.x: 525.60.13 or later; 13.x: 580.65.06 or later).
DRIVER_FOR_BINDINGS = {12: "525.60.13", 13: "580.65.06"}


class CudaError(SegmentError):
    """A CUDA driver call failed, the device cannot share memory, or the driver (or
    cuda-bindings) is missing.

    Attributes:
        status: the driver's ``CUresult`` as an int, or None when no call returned one.
    """

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def driver():
    """The ``cuda.bindings.driver`` module.

    Raises:
        CudaError: cuda-bindings is not installed.
    """
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        raise CudaError("vllm-dedup's CUDA segments need NVIDIA's cuda-bindings of torch's CUDA major version: "
                        "pip install 'vllm-dedup[cuda]' (CUDA 13) or 'vllm-dedup[cuda12]'") from None
    return drv


def call(name: str, *args):
    """Call driver function ``name``; return its outputs after the status (one value unwrapped).

    Raises:
        CudaError: the status is not ``CUDA_SUCCESS`` (message: the driver's error name and
            text), or the driver library cannot be loaded or lacks the function.
    """
    drv = driver()
    try:
        out = getattr(drv, name)(*args)
    except (OSError, RuntimeError) as e:  # cuda.pathfinder's DynamicLibNotFoundError is a RuntimeError
        raise CudaError(f"{name}: the CUDA driver is not usable here ({e}); install the NVIDIA driver, or run "
                        "without dedup on this device") from None
    status, rest = out[0], out[1:]
    if status != drv.CUresult.CUDA_SUCCESS:
        known, err_name = drv.cuGetErrorName(status)
        _, err_text = drv.cuGetErrorString(status)
        if known != drv.CUresult.CUDA_SUCCESS:  # a code this driver has no name for
            raise CudaError(f"{name} failed: CUresult {int(status)}", int(status))
        raise CudaError(f"{name} failed: {_text(err_name)} ({_text(err_text)})", int(status))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def _text(b) -> str:
    return b.decode() if isinstance(b, bytes) else str(b)


def _init() -> None:
    """``cuInit`` once per process (idempotent in the driver too; torch has usually done it)."""
    global _initialized
    if not _initialized:
        call("cuInit", 0)
        _initialized = True


def device_count() -> int:
    """Devices visible to this process (``CUDA_VISIBLE_DEVICES`` applies).  No context."""
    _init()
    return int(call("cuDeviceGetCount"))


def device_key(ordinal: int) -> str:
    """``cuda:GPU-<uuid>``: the registry's name of device ``ordinal``, the same in every process
    whatever its ``CUDA_VISIBLE_DEVICES``.  Needs, creates and changes no context.

    On a MIG instance only ``cuDeviceGetUuid_v2`` (CUDA 11.4 on) gives the instance's own UUID
    (which NVML spells ``MIG-<uuid>``); v1 gives its parent GPU's, the same for every instance.
    cuda-bindings 13 resolves ``cuDeviceGetUuid`` to v2; 12.x resolves it to v1 and offers
    ``cuDeviceGetUuid_v2`` beside it, which is then used.  The key keeps the ``GPU-`` prefix
    either way.

    Raises:
        CudaError: the driver is not usable, or no such device.
    """
    _init()
    name = "cuDeviceGetUuid_v2" if hasattr(driver(), "cuDeviceGetUuid_v2") else "cuDeviceGetUuid"
    raw = bytes(call(name, call("cuDeviceGet", ordinal)).bytes)
    h = raw.hex()
    return f"cuda:GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def ordinal_of(key: str) -> int:
    """This process's ordinal of the device named ``key`` (`device_key`).  No context.

    Raises:
        CudaError: no visible device has that UUID.
    """
    for ordinal in range(device_count()):
        if device_key(ordinal) == key:
            return ordinal
    raise CudaError(f"no visible CUDA device has the UUID in {key!r} (check CUDA_VISIBLE_DEVICES)")


def _primary_context(ordinal: int):
    with lock:
        ctx = _contexts.get(ordinal)
        if ctx is None:
            _init()
            ctx = _contexts[ordinal] = call("cuDevicePrimaryCtxRetain", call("cuDeviceGet", ordinal))
    return ctx


@contextmanager
def on_device(ordinal: int):
    """Run the body with device ``ordinal``'s primary context current on this thread, then make
    the caller's context current again (``cuCtxPushCurrent`` / ``cuCtxPopCurrent``).

    Raises:
        CudaError: the context cannot be retained or pushed.
    """
    ctx = _primary_context(ordinal)
    call("cuCtxPushCurrent", ctx)
    try:
        yield
    finally:
        popped = call("cuCtxPopCurrent")
        if int(popped) != int(ctx):  # something in the body left a context pushed: say so
            logger.warning("the CUDA context stack changed under a segment operation on device %d",
                           ordinal)


def check_support(ordinal: int) -> None:
    """Check once per device that it can share memory: VMM and POSIX-descriptor handles
    (``CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED``,
    ``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED``, as the CUDA programming
    guide asks before exporting), and that cuda-bindings does not need a newer driver.

    Raises:
        CudaError: saying which is missing and what to do.
    """
    with lock:
        if ordinal in _refused:
            raise CudaError(_refused[ordinal])
        if ordinal in _supported:
            return
    drv = driver()
    _init()
    _check_driver_version()
    dev = call("cuDeviceGet", ordinal)
    attr = drv.CUdevice_attribute
    for name, what in (("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", "virtual memory management"),
                       ("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
                        "POSIX file-descriptor memory handles")):
        if not call("cuDeviceGetAttribute", getattr(attr, name), dev):
            raise CudaError(f"CUDA device {ordinal} ({device_key(ordinal)}) does not support {what} ({name} is 0): "
                            "vllm-dedup cannot share weights on it and keeps them private.  Check the driver "
                            "version and whether the GPU is virtualised (vGPU, some containers).")
    with lock:
        _supported.add(ordinal)


def refuses(error: CudaError) -> bool:
    """Whether ``error`` is the driver saying it cannot do this on this device at all
    (``CUDA_ERROR_INVALID_VALUE`` or ``CUDA_ERROR_NOT_SUPPORTED``) rather than failing this once:
    the reference lets any call also return errors of earlier asynchronous launches."""
    drv = driver()
    return error.status in (int(drv.CUresult.CUDA_ERROR_INVALID_VALUE), int(drv.CUresult.CUDA_ERROR_NOT_SUPPORTED))


def refuse_device(ordinal: int, error: CudaError) -> CudaError:
    """Remember that device ``ordinal`` cannot make shareable memory although its attributes
    say it can (``cuMemCreate`` refused, `refuses`: under WSL2 the
    POSIX-descriptor attribute reads 1 and creation fails with ``CUDA_ERROR_INVALID_VALUE``).
    `check_support` then refuses the device at once, without calling the driver again.
    Returns the error to raise (the same message every time)."""
    message = (f"CUDA device {ordinal} cannot create shareable (POSIX file-descriptor) allocations although its "
               f"attributes say it can ({error}); vllm-dedup keeps tensors on it private.  Under WSL2 and "
               "some virtualised GPUs this is expected.")
    with lock:
        _refused.setdefault(ordinal, message)
        return CudaError(_refused[ordinal], error.status)


def memory_info(ordinal: int) -> tuple[int, int]:
    """``(free, total)`` bytes of device ``ordinal`` (``cuMemGetInfo``, the figure vLLM's memory
    snapshot reads through ``cudaMemGetInfo``), under its primary context.

    Raises:
        CudaError: the driver is not usable.
    """
    with on_device(ordinal):
        free, total = call("cuMemGetInfo")
    return int(free), int(total)


def _check_driver_version() -> None:
    from cuda.bindings import __version__

    major = int(__version__.split(".")[0])
    version = int(call("cuDriverGetVersion"))
    if major > version // 1000:
        raise CudaError(f"cuda-bindings {__version__} needs a driver for CUDA {major} (Linux "
                        f"{DRIVER_FOR_BINDINGS.get(major, '?')} or later); this one supports CUDA "
                        f"{version // 1000}.{version % 1000 // 10}: install the cuda-bindings of torch's CUDA "
                        f"version (pip install 'vllm-dedup[cuda{version // 1000}]') or update the driver")


def allocation_prop(ordinal: int):
    drv = driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def granularity(ordinal: int) -> int:
    """Device ``ordinal``'s minimum VMM allocation granularity in bytes (2 MiB on current GPUs).

    Raises:
        CudaError: the driver is not usable.
    """
    with lock:
        if ordinal in _granularity:
            return _granularity[ordinal]
    drv = driver()
    with on_device(ordinal):
        gran = int(call("cuMemGetAllocationGranularity", allocation_prop(ordinal),
                        drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    with lock:
        _granularity[ordinal] = gran
    return gran


def rounded(nbytes: int, ordinal: int) -> int:
    """``nbytes`` (at least 1) rounded up to device ``ordinal``'s granularity."""
    gran = granularity(ordinal)
    return -(-max(nbytes, 1) // gran) * gran
