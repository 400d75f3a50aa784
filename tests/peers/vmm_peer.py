"""A process that creates, maps and reads CUDA segments through the driver layer
(`segments.vmm`, `segments.cudadrv`, `CudaSegment.attach`), for tests/integration/test_cuda_model.py.

    python tests/peers/vmm_peer.py SOCKET|-

Run with the CUDA driver model as its ``libcuda.so.1`` (``tests/cuda_model``: host memory behind
NVIDIA's documented contract, not a GPU), so "device" bytes are read through a mapping's address
on the host.  Answers one JSON command per stdin line with ``OK {...}`` or ``ERR {...}``; every
answer carries the model's counters (``stats``) and this thread's current device.  Commands:

- ``key {ordinal}``: the device key; ``push {ordinal}``: retain device ``ordinal``'s primary
  context and push it, as torch does when it makes a device current;
- ``hello {ordinal, signature}``: open a lease with the registry on that device;
- ``expect``: the registry's prediction of the bytes this engine will map;
- ``load {ordinal, tensors: {key: bytes}}``: what an engine's load does with its weights: map
  the resident ones, create and publish the others (one allocation each); ``recipe
  {signature, final: {key: bytes}}``: leave a recipe naming those final keys;
- ``load_in_place {ordinal, tensors: {key: bytes}}``: the same with publish in place's layout
  (`engine.in_place_packed`): the misses planned into packs (`packing.plan_packs` at the
  device's granularity), each pack a `CudaSegment.allocate`, its members written where they lie
  (as vLLM's weight loaders write), then `CudaSegment.freeze` and publish;
- ``create {ordinal, nbytes, members: [[key, offset, bytes], ...]}``: allocate, fill each member
  with `pattern`, protect, publish; ``map {ordinal, keys}``: acquire and map as the engine maps (whole packs);
- ``read``, ``write {key}`` (must fault), ``close``: every mapping held;
- ``allocate {ordinal, nbytes}``: `vmm.allocate` counting ``release_cached`` calls;
- ``fail {name, code, count}``: the model's next ``count`` calls of ``name`` return ``code``;
- ``defer``: a mapping dropped during a (pretend) graph capture and while the driver lock is held;
  ``defer_elsewhere``: a mapping dropped on another thread while this one (pretends to) capture;
- ``uuids``: the device keys, and each device's UUID as the driver resolves ``cuDeviceGetUuid`` for a caller built
  for CUDA 9.2 (v1) and 11.4 (v2), through ``cuGetProcAddress_v2``;
- ``memory {ordinal}``: `cudadrv.memory_info`; ``keep {ordinal, nbytes}``: a private allocation
  that is never exported (an engine's KV cache), held until the peer ends.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import sys
import threading

# Another cuda-bindings release (e.g. 12.x, installed with pip --target) ahead of the venv's.
if os.environ.get("VMM_PEER_BINDINGS"):
    sys.path.insert(0, os.environ["VMM_PEER_BINDINGS"])

import xxhash

from vllm_dedup.engine.resident import map_resident
from vllm_dedup.errors import SegmentError
from vllm_dedup.registry.client import RegistryClient
from vllm_dedup.segments import cudadrv, vmm
from vllm_dedup.segments.cuda import CudaSegment
from vllm_dedup.segments.packing import plan_packs

STATS = ("retained_contexts", "allocations", "mappings", "reservations", "synchronizes", "creates",
         "current_device", "context_depth", "create_calls")


def pattern(key: str, nbytes: int) -> bytes:
    """The bytes a member named ``key`` holds."""
    return random.Random(xxhash.xxh3_64_intdigest(key.encode())).randbytes(nbytes)


def model():
    return ctypes.CDLL("libcuda.so.1")  # the handle cuda-bindings loaded: one library per process


def stats() -> dict:
    out = (ctypes.c_longlong * len(STATS))()
    model().cudamodel_stats(out)
    return dict(zip(STATS, out))


class Peer:
    def __init__(self, sock: str):
        self.client = RegistryClient(sock) if sock != "-" else None
        self.held: dict[str, tuple[object, int, int]] = {}  # key -> (mapping, offset, bytes)
        self.keep: list = []  # segments, contexts: alive until the peer ends

    def read(self) -> dict:
        return {k: xxhash.xxh3_128_hexdigest(ctypes.string_at(m.va + off, n)) for k, (m, off, n) in self.held.items()}

    def op_key(self, ordinal):
        return {"key": cudadrv.device_key(ordinal), "ordinal_of": cudadrv.ordinal_of(cudadrv.device_key(ordinal))}

    def op_push(self, ordinal):
        drv = cudadrv.driver()
        drv.cuInit(0)
        _, ctx = drv.cuDevicePrimaryCtxRetain(drv.cuDeviceGet(ordinal)[1])
        assert drv.cuCtxPushCurrent(ctx)[0] == drv.CUresult.CUDA_SUCCESS
        return {}

    def op_hello(self, ordinal, signature=""):
        self.client.hello("vmm-peer", cudadrv.device_key(ordinal), "default", signature)
        return {}

    def op_expect(self):
        return {"bytes": self.client.expected_shared_bytes()}

    def resident(self, ordinal, keys) -> dict:
        """Acquire ``keys`` and map what is resident, as the engine does (`map_resident`); key ->
        (segment, hit).  Raises the first segment's error that could not be mapped."""
        hits = {}
        for mapped in map_resident(self.client, CudaSegment, cudadrv.device_key(ordinal), list(keys)):
            if mapped.error is not None:
                raise mapped.error
            hits.update({hit.key: (mapped.segment, hit) for hit in mapped.found.hits})
        return hits

    def op_load(self, ordinal, tensors):
        hits = self.resident(ordinal, tensors)
        shared = published = 0
        for key, nbytes in tensors.items():
            if key in hits:
                seg, hit = hits[key]
                self.held[key] = (seg._mapping, hit.offset, hit.nbytes)
                shared += nbytes
            else:
                mapping, fd = vmm.allocate(ordinal, nbytes)
                ctypes.memmove(mapping.va, pattern(key, nbytes), nbytes)
                mapping.protect()
                self.client.publish(fd, mapping.size, [(key, 0, nbytes)])
                os.close(fd)
                self.held[key] = (mapping, 0, nbytes)
                published += mapping.size
        return {"shared": shared, "published": published, "digests": self.read()}

    def op_load_in_place(self, ordinal, tensors):
        key = cudadrv.device_key(ordinal)
        hits = self.resident(ordinal, tensors)
        for k, (seg, hit) in hits.items():
            self.held[k] = (seg._mapping, hit.offset, hit.nbytes)
        misses = [k for k in tensors if k not in hits]
        plan = plan_packs([tensors[k] for k in misses], cudadrv.granularity(ordinal), in_order=True)
        for pack in plan.packs:
            seg = CudaSegment.allocate(pack.nbytes, key)
            members = [(misses[i], offset, tensors[misses[i]]) for i, offset in pack.members]
            for k, offset, n in members:
                ctypes.memmove(seg._mapping.va + offset, pattern(k, n), n)  # the weight loader's write
            seg.freeze()
            self.client.publish(seg.fileno(), seg.size, members)
            seg.close_fd()
            self.held.update({k: (seg._mapping, offset, n) for k, offset, n in members})
        return {"shared": sum(tensors[k] for k in hits), "segment_bytes": plan.segment_bytes,
                "private": [misses[i] for i in plan.private], "digests": self.read(),
                "read_only": all(m.read_only for m, _, _ in self.held.values())}

    def op_recipe(self, signature, final):
        self.client.put_recipe(json.dumps({"signature": signature, "id": signature, "final": final}).encode())
        return {}

    def op_create(self, ordinal, nbytes, members):
        mapping, fd = vmm.allocate(ordinal, nbytes)
        for key, offset, n in members:
            ctypes.memmove(mapping.va + offset, pattern(key, n), n)
            self.held[key] = (mapping, offset, n)
        mapping.protect()
        self.client.publish(fd, mapping.size, [tuple(m) for m in members])
        os.close(fd)
        return {"digests": self.read(), "size": mapping.size, "read_only": mapping.read_only}

    def op_map(self, ordinal, keys):
        sizes = {}
        for k, (seg, hit) in self.resident(ordinal, keys).items():
            self.held[k] = (seg._mapping, hit.offset, hit.nbytes)
            sizes[k] = seg.size
        return {"digests": self.read(), "sizes": sizes, "read_only": all(m.read_only for m, _, _ in self.held.values())}

    def op_read(self):
        return {"digests": self.read()}

    def op_write(self, key):
        mapping, offset, _ = self.held[key]
        print("WRITING", flush=True)
        ctypes.memset(mapping.va + offset, 0, 1)  # must fault: the mapping is read-only
        print("WROTE", flush=True)
        return {}

    def op_close(self):
        for mapping in {id(m): m for m, _, _ in self.held.values()}.values():
            mapping.close()
        self.held.clear()
        return {}

    def op_allocate(self, ordinal, nbytes):
        released = []
        try:
            mapping, fd = vmm.allocate(ordinal, nbytes, release_cached=lambda: released.append(1))
        except SegmentError as e:
            return {"error": str(e), "released": len(released)}
        inheritable = os.get_inheritable(fd)
        os.close(fd)
        size = mapping.size
        mapping.close()
        return {"size": size, "released": len(released), "inheritable": inheritable}

    def op_attach(self, ordinal, source):
        """`CudaSegment.attach` of a descriptor that cannot be mapped: a memfd that no driver
        exported (``memfd``), a 2 MiB allocation asked for 4 MiB (``small``), or the first 2 MiB
        of a 4 MiB one (``part``: the driver maps no part of an imported allocation).  Returns
        the error and whether attach closed the descriptor it took."""
        if source == "memfd":
            fd = os.memfd_create("not-cuda")
            os.ftruncate(fd, 2 << 20)
        else:
            mapping, fd = vmm.allocate(ordinal, 4 << 20 if source == "part" else 2 << 20)
            self.keep.append(mapping)
        try:
            CudaSegment.attach(fd, {"small": 4 << 20, "part": 2 << 20}.get(source, 1 << 20), cudadrv.device_key(ordinal))
        except SegmentError as e:
            try:
                os.fstat(fd)
                closed = False
            except OSError:
                closed = True
            return {"error": str(e), "closed": closed}
        return {"error": None}

    def op_uuids(self):
        lib = model()
        get = lib.cuGetProcAddress_v2
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_ulonglong,
                        ctypes.POINTER(ctypes.c_int)]
        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
        out = {}
        for version in (9020, 11040):
            fn, status = ctypes.c_void_p(), ctypes.c_int()
            assert get(b"cuDeviceGetUuid", ctypes.byref(fn), version, 0, ctypes.byref(status)) == 0
            uuids = []
            for dev in range(cudadrv.device_count()):
                buf = ctypes.create_string_buffer(16)
                assert proto(fn.value)(buf, dev) == 0
                uuids.append(buf.raw.hex())
            out[str(version)] = uuids
        from cuda.bindings import __version__

        return {"uuids": out, "keys": [cudadrv.device_key(i) for i in range(cudadrv.device_count())],
                "bindings": __version__}

    def op_memory(self, ordinal):
        free, total = cudadrv.memory_info(ordinal)
        return {"free": free, "total": total}

    def op_keep(self, ordinal, nbytes):
        mapping, fd = vmm.allocate(ordinal, nbytes)
        os.close(fd)  # never shared: only this process holds it
        self.keep.append(mapping)
        return {"size": mapping.size}

    def op_fail(self, name, code, count):
        model().cudamodel_fail(name.encode(), code, count)
        return {}

    def op_defer(self, ordinal):
        capturing = [True]
        mapping, fd = vmm.allocate(ordinal, 1, capturing=lambda: capturing[0])
        os.close(fd)
        del mapping  # its finalizer runs "during a capture": no synchronize, no unmap yet
        during = stats()
        capturing[0] = False
        released = vmm.release_deferred()
        after = stats()
        mapping, fd = vmm.allocate(ordinal, 1)
        os.close(fd)
        holder = [mapping]
        del mapping

        def drop_under_lock():  # a finalizer that runs while this thread holds the lock
            with cudadrv.lock:
                holder.clear()

        worker = threading.Thread(target=drop_under_lock, daemon=True)
        worker.start()
        worker.join(10)
        return {"during": during, "released": released, "after": after, "deadlocked": worker.is_alive(),
                "under_lock": stats()}

    def op_close_fails(self, ordinal, code, call="cuCtxSynchronize"):
        """A mapping whose close fails at ``call`` (``cuCtxSynchronize`` with ``code``: a capture
        begun outside torch, an earlier kernel's fault; or ``cuMemAddressFree``, the range
        unmapped already): the error is raised, and what is left is done by the next
        `vmm.release_deferred`, not forgotten."""
        mapping, fd = vmm.allocate(ordinal, 1)
        os.close(fd)
        model().cudamodel_fail(call.encode(), code, 1)
        try:
            mapping.close()
            error = None
        except SegmentError as e:
            error = str(e)
        failed = stats()
        return {"error": error, "failed": failed, "released": vmm.release_deferred()}

    def op_defer_elsewhere(self, ordinal):
        """This thread "captures" (a process-wide capture count, as `segments.cuda` keeps it);
        the last reference to a mapping goes on another thread, whose own stream is not
        capturing: its finalizer must defer the unmap too."""
        captures = [1]
        mapping, fd = vmm.allocate(ordinal, 1, capturing=lambda: captures[0] > 0)
        os.close(fd)
        holder = [mapping]
        del mapping
        other = threading.Thread(target=holder.clear)
        other.start()
        other.join(10)
        during = stats()
        captures[0] = 0
        released = vmm.release_deferred()
        return {"during": during, "released": released, "after": stats()}


def main() -> None:
    peer = Peer(sys.argv[1])
    print("OK " + json.dumps({"pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            out = getattr(peer, "op_" + cmd.pop("op"))(**cmd)
            print("OK " + json.dumps({**out, "stats": stats()}), flush=True)
        except Exception as e:  # the test decides what an error means
            print("ERR " + json.dumps({"type": type(e).__name__, "error": str(e),
                                       "segment_error": isinstance(e, SegmentError), "stats": stats()}), flush=True)
    if peer.client is not None:
        peer.client.close()


if __name__ == "__main__":
    main()
