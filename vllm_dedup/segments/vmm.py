"""VMM mappings: allocate and export, import, map, protect and unmap CUDA memory; no torch here.

`allocate` creates an exportable allocation and maps it read-write for the creator to fill;
`import_mapping` maps another process's allocation read-only; `Mapping.protect` makes the
creator's range read-only once filled.  Both release the allocation handle right after mapping
(cuda-samples ``memMapIPCDrv``: "the allocation will be kept live until it is unmapped"), so
the mapping and the exported descriptors are what keep the memory (docs/architecture.md,
"Segments").  Every call runs under `cudadrv.on_device` and leaves the caller's context current.

Unmapping: ``cuMemUnmap`` is not stream-ordered, so `Mapping.close` synchronizes the device
first.  A mapping's finalizer runs whenever its last reference goes, on whichever thread drops
it, which can be in the middle of a CUDA-graph capture on any thread, where ``cuCtxSynchronize``
is not allowed (it fails and invalidates the capture: CUDA programming guide, "Stream
capture"); there the unmap is deferred to the next `allocate`, `import_mapping` or
`release_deferred` outside a capture.  The caller says what "capturing" means (``capturing``):
`segments.cuda` answers for every thread of the process.
"""

from __future__ import annotations

import contextlib
import os

from ..log import init_logger
from . import cudadrv
from .cudadrv import CudaError, call, on_device

__all__ = ["Mapping", "allocate", "import_mapping", "release_deferred"]

logger = init_logger(__name__)

# (va, size, ordinal, mapped) left by finalizers during a capture, or by a failed release
_deferred: list[tuple[int, int, int, bool]] = []
_warned_read_only = False


def _never() -> bool:
    return False


def _access_desc(ordinal: int, read_only: bool):
    drv = cudadrv.driver()
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = (drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ if read_only
                  else drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    return desc


def _release_range(va: int, size: int, ordinal: int, mapped: bool = True, defer: bool = True) -> None:
    """Unmap ``[va, va + size)`` (when ``mapped``) and free its reservation.  A failed step
    leaves what is still to do to `release_deferred` (with ``defer``), and raises: after
    ``cuMemUnmap`` the range is a reservation only (NVIDIA's reference: "the address range is
    converted to an address reservation"), and unmapping it again would fail and leak it; once
    freed, nothing is left to do, even if leaving the device's context fails (the addresses
    may be another reservation's by then).

    Raises:
        CudaError: a driver call failed.
    """
    freed = False
    try:
        with on_device(ordinal):
            if mapped:
                call("cuCtxSynchronize")  # kernels still reading the range must finish first
                call("cuMemUnmap", va, size)
                mapped = False
            call("cuMemAddressFree", va, size)
            freed = True
    except CudaError:
        if defer and not freed:
            with cudadrv.lock:
                _deferred.append((va, size, ordinal, mapped))
        raise


class Mapping:
    """``[va, va + size)``: one allocation mapped into this process's address space on a device.

    Attributes:
        va: the range's device address (an int; under the driver model, a host address).
        size: bytes mapped, a multiple of the granularity (may be less than the allocation).
        ordinal: the device, as this process numbers it.
        read_only: writes through this range fault (False where the driver refused read-only
            access; a warning then says so once).

    `segments.cuda` wraps byte ranges of it as torch tensors (``__cuda_array_interface__``),
    which keep this object alive.
    """

    def __init__(self, handle, size: int, ordinal: int, read_only: bool, capturing=_never):
        self.va, self.size, self.ordinal, self.read_only = 0, size, ordinal, False
        self._capturing = capturing
        with on_device(ordinal):
            # Alignment 0 is the driver's default, which the reference leaves unspecified;
            # cuMemMap needs a granularity-aligned address, so ask for that.
            va = int(call("cuMemAddressReserve", size, cudadrv.granularity(ordinal), 0, 0))
            try:
                call("cuMemMap", va, size, 0, handle, 0)
            except CudaError:
                with contextlib.suppress(CudaError):  # the map's error is the one to say
                    _release_range(va, size, ordinal, mapped=False)
                raise
            self.va = va
            try:
                if not (read_only and self.protect()):
                    call("cuMemSetAccess", va, size, [_access_desc(ordinal, False)], 1)
            except CudaError:
                with contextlib.suppress(CudaError):  # the first error is the one to say
                    self.close()
                raise

    def protect(self, synchronize: bool = False) -> bool:
        """Make the range read-only on its device.  Returns False (and warns once) where the
        driver refuses read-only access (`cudadrv.refuses`: invalid value or not supported); the
        range's access is then unchanged.

        Args:
            synchronize: wait for the device's work first.  ``cuMemSetAccess`` is not
                stream-ordered: a kernel still writing the range (a weight loader's copy) would
                fault once it is read-only.

        Raises:
            CudaError: the synchronize failed (a kernel faulted, or the context is gone), or
                ``cuMemSetAccess`` failed otherwise (an earlier launch's error): the range may
                still be writable, so it must not be shared as read-only.
        """
        global _warned_read_only
        if synchronize:
            with on_device(self.ordinal):
                call("cuCtxSynchronize")
        try:
            with on_device(self.ordinal):
                call("cuMemSetAccess", self.va, self.size, [_access_desc(self.ordinal, True)], 1)
            self.read_only = True
        except CudaError as e:
            if not cudadrv.refuses(e):
                raise
            if not _warned_read_only:
                _warned_read_only = True
                logger.warning("the CUDA driver refuses read-only mappings (%s); shared weights are "
                               "mapped read-write, so a stray in-place write would not fault", e)
        return self.read_only

    def close(self) -> None:
        """Synchronize the device, unmap the range and free its addresses (idempotent).

        Raises:
            CudaError: a driver call failed; what is left (the unmap and the free, or the free
                alone) is then done by the next `release_deferred`, once (a range forgotten
                would keep its allocation alive, its handle released already, until the
                process exits).
        """
        with cudadrv.lock:
            va, self.va = self.va, 0
        if va:
            _release_range(va, self.size, self.ordinal)

    def __del__(self):
        try:
            if not self.va:
                return
            if self._capturing():
                with cudadrv.lock:
                    _deferred.append((self.va, self.size, self.ordinal, True))
                    self.va = 0
                return
            self.close()
            release_deferred()
        except Exception:  # interpreter shutdown: the driver may already be gone
            pass


def release_deferred() -> int:
    """Unmap the ranges whose finalizers ran during a CUDA-graph capture, and finish those whose
    release failed once (`Mapping.close`); returns how many.
    Call it outside any capture (`allocate` and `import_mapping` do)."""
    with cudadrv.lock:
        pending = list(_deferred)
        del _deferred[:]
    for va, size, ordinal, mapped in pending:
        try:  # tried once again, not for ever: what is left then is given up
            _release_range(va, size, ordinal, mapped, defer=False)
        except CudaError as e:
            logger.warning("could not unmap a released CUDA segment range (%s)", e)
    return len(pending)


def _create(ordinal: int, size: int, release_cached):
    """``cuMemCreate``; on out-of-memory, ``release_cached()`` (torch's cached blocks back to
    the driver) and one more try.  A refusal (`cudadrv.refuses`) is remembered for the device
    (`cudadrv.refuse_device`): no later segment is attempted there; any other failure fails this
    segment only."""
    prop = cudadrv.allocation_prop(ordinal)
    oom = int(cudadrv.driver().CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    for attempt in (1, 2):
        try:
            with on_device(ordinal):
                return call("cuMemCreate", size, prop, 0)
        except CudaError as e:
            if cudadrv.refuses(e):  # WSL2: the attributes say yes, creation says no
                raise cudadrv.refuse_device(ordinal, e) from None
            if e.status != oom or release_cached is None:
                raise
            if attempt == 2:
                raise CudaError(f"CUDA device {ordinal} is out of memory for a {size}-byte segment, even after "
                                "returning torch's cached blocks; its tensors stay private", e.status) from None
        release_cached()  # outside on_device: torch's own device guard applies there
    raise AssertionError("unreachable")


def _release_handle(handle, ordinal: int, quiet: bool) -> None:
    try:
        with on_device(ordinal):
            call("cuMemRelease", handle)
    except CudaError:
        if not quiet:
            raise
        logger.warning("cuMemRelease failed while handling another error", exc_info=True)


def allocate(ordinal: int, nbytes: int, release_cached=None, capturing=_never) -> tuple[Mapping, int]:
    """A new exportable allocation on device ``ordinal``, mapped read-write in this process.

    Args:
        ordinal: the device, as this process numbers it.
        nbytes: usable bytes; the allocation is rounded up to the granularity.
        release_cached: called once when ``cuMemCreate`` runs out of memory, before the retry.
        capturing: returns True while a CUDA graph is being captured (see the module docstring).

    Returns:
        ``(mapping, fd)``: the read-write mapping (`Mapping.protect` it once filled) and the
        exported POSIX descriptor (the caller owns it).

    Raises:
        CudaError: no VMM or descriptor support, out of memory after the retry, or a driver call
            failed; nothing is left allocated or mapped.
    """
    if not capturing():
        release_deferred()
    cudadrv.check_support(ordinal)
    size = cudadrv.rounded(nbytes, ordinal)
    handle = _create(ordinal, size, release_cached)
    fd = -1
    try:
        with on_device(ordinal):
            fd = int(call("cuMemExportToShareableHandle", handle,
                          cudadrv.driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
        # The driver does not document close-on-exec for it: a child exec'd meanwhile (a
        # compiler vLLM runs) must not keep the allocation alive.
        os.set_inheritable(fd, False)
        mapping = Mapping(handle, size, ordinal, read_only=False, capturing=capturing)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        _release_handle(handle, ordinal, quiet=True)
        raise
    try:
        _release_handle(handle, ordinal, quiet=False)  # the mapping and the descriptor keep the memory
    except BaseException:
        os.close(fd)
        mapping.close()
        raise
    return mapping, fd


def import_mapping(fd: int, nbytes: int, ordinal: int, capturing=_never) -> Mapping:
    """Map another process's allocation read-only: its first ``nbytes`` bytes, rounded up to the
    granularity (the whole allocation: the driver may refuse a part, `CudaSegment.mapped_bytes`).
    The caller keeps ``fd``.

    Raises:
        CudaError: the device cannot share memory, the descriptor is not an allocation this
            driver can import on ``ordinal``, or it is smaller than ``nbytes``; nothing is left
            imported or mapped.
    """
    if not capturing():
        release_deferred()
    cudadrv.check_support(ordinal)
    size = cudadrv.rounded(nbytes, ordinal)
    try:
        with on_device(ordinal):
            handle = call("cuMemImportFromShareableHandle", fd,
                          cudadrv.driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    except CudaError as e:
        raise CudaError(f"the received descriptor is not a CUDA allocation this process can import on device "
                        f"{ordinal} ({e})", e.status) from None
    try:
        mapping = Mapping(handle, size, ordinal, read_only=True, capturing=capturing)
    except BaseException as e:
        _release_handle(handle, ordinal, quiet=True)
        if isinstance(e, CudaError):
            raise CudaError(f"cannot map {size} bytes of the received allocation (is the registry's size of it "
                            f"wrong? a driver maps no part of one: CudaSegment.mapped_bytes) ({e})", e.status) from None
        raise
    try:
        _release_handle(handle, ordinal, quiet=False)
    except BaseException:
        mapping.close()
        raise
    return mapping
