"""Calls the CUDA driver model (``tests/cuda_model``; host memory, not a GPU) against its
documented preconditions through cuda-bindings and prints ``OK {case: status name}``, one case
per precondition, for tests/integration/test_cuda_model.py.

    python tests/peers/cuda_contract_peer.py
"""

from __future__ import annotations

import json

from cuda.bindings import driver as d

MB2 = 2 << 20
POSIX = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def status(out) -> str:
    return (out[0] if isinstance(out, tuple) else out).name


def value(out):
    """The call's output after its status, which must be success."""
    assert out[0] == d.CUresult.CUDA_SUCCESS, out
    return out[1] if len(out) > 1 else None


def value_pair(out):
    """The two outputs after a call's status, which must be success."""
    assert out[0] == d.CUresult.CUDA_SUCCESS, out
    return out[1], out[2]


def prop(device: int = 0, handle_types=POSIX, kind=d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED):
    p = d.CUmemAllocationProp()
    p.type = kind
    p.requestedHandleTypes = handle_types
    p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = device
    return p


def access(device: int, flags=d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE):
    a = d.CUmemAccessDesc()
    a.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    a.location.id = device
    a.flags = flags
    return a


def main() -> None:
    cases = {"before cuInit: cuDeviceGetCount": status(d.cuDeviceGetCount())}
    value(d.cuInit(0))
    dev0 = value(d.cuDeviceGet(0))
    cases["no context: cuMemCreate"] = status(d.cuMemCreate(MB2, prop(), 0))
    cases["no context: cuMemAddressReserve"] = status(d.cuMemAddressReserve(MB2, 0, 0, 0))
    cases["no context: cuCtxSynchronize"] = status(d.cuCtxSynchronize())
    cases["no context: cuMemGetInfo"] = status(d.cuMemGetInfo())
    cases["empty stack: cuCtxPopCurrent"] = status(d.cuCtxPopCurrent())
    cases["release without retain: cuDevicePrimaryCtxRelease"] = status(d.cuDevicePrimaryCtxRelease(dev0))
    ctx = value(d.cuDevicePrimaryCtxRetain(dev0))
    value(d.cuCtxPushCurrent(ctx))
    cases["size not a granularity multiple: cuMemCreate"] = status(d.cuMemCreate(MB2 + 4096, prop(), 0))
    cases["flags not 0: cuMemCreate"] = status(d.cuMemCreate(MB2, prop(), 1))
    cases["no such device: cuMemCreate"] = status(d.cuMemCreate(MB2, prop(device=7), 0))
    _, total = value_pair(d.cuMemGetInfo())
    cases["more than the device's memory: cuMemCreate"] = status(d.cuMemCreate(total + MB2, prop(), 0))
    default = int(value(d.cuMemAddressReserve(MB2, 0, 0, 0)))
    some = value(d.cuMemCreate(MB2, prop(), 0))
    cases["alignment 0 (the driver's default): cuMemMap"] = status(d.cuMemMap(default, MB2, 0, some, 0))
    value(d.cuMemAddressFree(default, MB2))
    page_aligned = int(value(d.cuMemAddressReserve(MB2, 4096, 0, 0)))  # what was asked, no more
    cases["alignment 4096, below the granularity: cuMemMap"] = status(d.cuMemMap(page_aligned, MB2, 0, some, 0))
    value(d.cuMemAddressFree(page_aligned, MB2))
    value(d.cuMemRelease(some))
    cases["no handle type requested: cuMemExportToShareableHandle"] = status(d.cuMemExportToShareableHandle(
        value(d.cuMemCreate(MB2, prop(handle_types=d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE), 0)),
        POSIX, 0))
    handle = value(d.cuMemCreate(2 * MB2, prop(), 0))
    va = int(value(d.cuMemAddressReserve(4 * MB2, MB2, 0, 0)))
    cases["reservation not granularity-aligned: cuMemMap"] = status(d.cuMemMap(va + 4096, MB2, 0, handle, 0))
    cases["offset not 0: cuMemMap"] = status(d.cuMemMap(va, MB2, MB2, handle, 0))
    cases["larger than the allocation: cuMemMap"] = status(d.cuMemMap(va, 4 * MB2, 0, handle, 0))
    cases["outside any reservation: cuMemMap"] = status(d.cuMemMap(va + 4 * MB2, MB2, 0, handle, 0))
    cases["part of the allocation: cuMemMap"] = status(d.cuMemMap(va, MB2, 0, handle, 0))
    cases["over a mapped range: cuMemMap"] = status(d.cuMemMap(va, MB2, 0, handle, 0))
    cases["not whole mappings: cuMemSetAccess"] = status(d.cuMemSetAccess(va, 2 * MB2, [access(0)], 1))
    cases["another device: cuMemSetAccess"] = status(d.cuMemSetAccess(va, MB2, [access(1)], 1))
    cases["a sub-range: cuMemUnmap"] = status(d.cuMemUnmap(va, MB2 // 2))
    cases["a mapping inside: cuMemAddressFree"] = status(d.cuMemAddressFree(va, 4 * MB2))
    cases["first release: cuMemRelease"] = status(d.cuMemRelease(handle))
    cases["double release: cuMemRelease"] = status(d.cuMemRelease(handle))
    cases["after release, mapped: cuMemUnmap"] = status(d.cuMemUnmap(va, MB2))
    cases["not the reserved size: cuMemAddressFree"] = status(d.cuMemAddressFree(va, MB2))
    cases["reserved size: cuMemAddressFree"] = status(d.cuMemAddressFree(va, 4 * MB2))
    with open("/proc/self/exe", "rb") as f:
        cases["not an exported allocation: cuMemImportFromShareableHandle"] = status(
            d.cuMemImportFromShareableHandle(f.fileno(), POSIX))
    value(d.cuCtxPopCurrent())
    print("OK " + json.dumps(cases), flush=True)


if __name__ == "__main__":
    main()
