"""The CUDA segment backend's driver layer (`segments.cudadrv`, `segments.vmm`,
`CudaSegment.attach`) against the CUDA driver model, with real processes and a real registry.

THE DRIVER HERE IS A MODEL (``tests/cuda_model``): NVIDIA's documented driver contract over host
memory, not a GPU.  It catches what breaks the contract (sizes, offsets, reservations, a missing
current context, double releases, leaks, the context left current); it cannot show what only
hardware does (kernels, NVML memory, a GPU page fault).  Those checks are in
``benchmarks/gpu_check.py``.  Each test's CUDA code runs in children (`tests/peers/vmm_peer.py`)
that load the model as their ``libcuda.so.1``; "device" bytes are read through the mapping's
address on the host.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest
import xxhash

import cuda_model
from harness.procs import PeerProcess
from helpers import PEERS, wait_for
from peers.vmm_peer import pattern
from vllm_dedup.registry.client import registry_stats

# cuda-bindings 12.x beside the venv (scripts/ensure-venv.sh installs it there, off the path).
BINDINGS_12 = Path(__file__).resolve().parents[2] / ".venv" / "cuda-bindings-12"
MB = 1 << 20
OUT_OF_MEMORY, NOT_SUPPORTED = 2, 801  # CUresult values
# Errors the reference lets any call return for an earlier asynchronous launch, or a capture
ILLEGAL_ADDRESS, STREAM_CAPTURE_IMPLICIT = 700, 906


class Model:
    """Children of one test on the driver model; their allocations carry the test's tag."""

    def __init__(self, lib: Path):
        self.lib, self.tag = lib, f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.peers: list[PeerProcess] = []

    def peer(self, sock, name: str, devices: int = 2, **env: str) -> PeerProcess:
        p = PeerProcess([PEERS / "vmm_peer.py", sock], name, env=cuda_model.child_env(self.lib, self.tag, devices, **env))
        p.read_json()
        self.peers.append(p)
        return p

    def holders(self) -> list[int]:
        return cuda_model.holders(self.tag)


@pytest.fixture
def model(model_lib):
    m = Model(model_lib)
    yield m
    for p in m.peers:
        p.end()


def ask(peer: PeerProcess, op: str, **args) -> dict:
    """One command; the reply (an ``ERR`` reply has ``type`` and ``error``)."""
    peer.send({"op": op, **args})
    return peer.read_json(("OK ", "ERR "))


def digest(key: str, nbytes: int) -> str:
    return xxhash.xxh3_128_hexdigest(pattern(key, nbytes))


def test_the_model_enforces_the_documented_preconditions(model_lib):
    """The model is strict: each broken precondition gets the documented error code."""
    p = PeerProcess([PEERS / "cuda_contract_peer.py"], "contract", env=cuda_model.child_env(model_lib, "contract"))
    got = p.read_json()
    p.end()
    success = "CUDA_SUCCESS"
    invalid, context, device = "CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_INVALID_CONTEXT", "CUDA_ERROR_INVALID_DEVICE"
    assert got == {
        "before cuInit: cuDeviceGetCount": "CUDA_ERROR_NOT_INITIALIZED",
        "no context: cuMemCreate": context, "no context: cuMemAddressReserve": context,
        "no context: cuCtxSynchronize": context, "no context: cuMemGetInfo": context,
        "empty stack: cuCtxPopCurrent": context,
        "release without retain: cuDevicePrimaryCtxRelease": context,
        "size not a granularity multiple: cuMemCreate": invalid, "flags not 0: cuMemCreate": invalid,
        "no such device: cuMemCreate": device,
        "more than the device's memory: cuMemCreate": "CUDA_ERROR_OUT_OF_MEMORY",
        "alignment 0 (the driver's default): cuMemMap": invalid,
        "alignment 4096, below the granularity: cuMemMap": invalid,
        "no handle type requested: cuMemExportToShareableHandle": invalid,
        "reservation not granularity-aligned: cuMemMap": invalid, "offset not 0: cuMemMap": invalid,
        "larger than the allocation: cuMemMap": invalid, "outside any reservation: cuMemMap": invalid,
        "part of the allocation: cuMemMap": success, "over a mapped range: cuMemMap": invalid,
        "not whole mappings: cuMemSetAccess": invalid, "another device: cuMemSetAccess": device,
        "a sub-range: cuMemUnmap": invalid, "a mapping inside: cuMemAddressFree": invalid,
        "first release: cuMemRelease": success, "double release: cuMemRelease": invalid,
        "after release, mapped: cuMemUnmap": success, "not the reserved size: cuMemAddressFree": invalid,
        "reserved size: cuMemAddressFree": success,
        "not an exported allocation: cuMemImportFromShareableHandle": invalid,
    }


@pytest.mark.heavy
def test_two_and_three_processes_map_one_allocation_which_outlives_its_creator(registry_server, model):
    a = model.peer(registry_server.path, "A")
    ask(a, "hello", ordinal=0)
    created = ask(a, "create", ordinal=0, nbytes=3 * MB, members=[["w", 0, 3 * MB]])
    want = {"w": digest("w", 3 * MB)}
    assert created["digests"] == want and created["size"] == 4 * MB and created["read_only"] is True
    # The handle is released once mapped: the mapping (and the descriptors) keep the memory.
    assert created["stats"]["allocations"] == 0 and created["stats"]["mappings"] == 1
    others = []
    for name in ("B", "C"):
        p = model.peer(registry_server.path, name)
        ask(p, "hello", ordinal=0)
        mapped = ask(p, "map", ordinal=0, keys=["w"])
        assert mapped["digests"] == want and mapped["read_only"] is True
        assert mapped["stats"]["allocations"] == 0 and mapped["stats"]["mappings"] == 1
        others.append(p)
    b, c = others
    # The registry (this process) holds the registry's descriptor; A, B, C each a mapping.
    assert set(model.holders()) == {os.getpid(), a.pid, b.pid, c.pid}
    assert a.end() == 0
    for p in (b, c):
        assert ask(p, "read")["digests"] == want
    assert ask(b, "close")["stats"]["mappings"] == 0
    assert ask(c, "read")["digests"] == want
    assert set(model.holders()) == {os.getpid(), c.pid}
    assert b.end() == 0 and c.end() == 0
    assert wait_for(lambda: registry_stats(registry_server.path).groups == [])
    assert wait_for(lambda: model.holders() == [])  # the last holder let go: the memory is freed


@pytest.mark.heavy
def test_a_write_through_a_read_only_mapping_kills_the_writer(registry_server, model):
    """Under the model a write faults with SIGSEGV (mprotect); on a GPU the kernel faults instead."""
    a = model.peer(registry_server.path, "A")
    ask(a, "hello", ordinal=0)
    ask(a, "create", ordinal=0, nbytes=MB, members=[["w", 0, MB]])
    w = model.peer(registry_server.path, "W")
    ask(w, "hello", ordinal=0)
    ask(w, "map", ordinal=0, keys=["w"])
    w.send({"op": "write", "key": "w"})
    assert w.proc.wait(timeout=60) == -signal.SIGSEGV
    assert "WROTE" not in w.proc.stdout.read()
    b = model.peer(registry_server.path, "B")
    ask(b, "hello", ordinal=0)
    assert ask(b, "map", ordinal=0, keys=["w"])["digests"] == {"w": digest("w", MB)}
    assert ask(a, "read")["digests"] == {"w": digest("w", MB)}


def test_device_key_needs_no_context_and_survives_renumbering(model):
    p = model.peer("-", "K", devices=3)
    keys = []
    for ordinal in range(3):
        got = ask(p, "key", ordinal=ordinal)
        assert got["ordinal_of"] == ordinal
        assert (got["stats"]["retained_contexts"], got["stats"]["context_depth"]) == (0, 0)
        keys.append(got["key"])
    assert len(set(keys)) == 3 and all(k.startswith("cuda:GPU-") for k in keys)
    ask(p, "push", ordinal=0)  # as torch does: device 0's primary context current
    for ordinal in range(3):
        s = ask(p, "key", ordinal=ordinal)["stats"]
        assert (s["retained_contexts"], s["current_device"], s["context_depth"]) == (1, 0, 1)
    # Another process numbers the same GPUs differently; the keys name the same devices.
    v = model.peer("-", "V", devices=3, CUDA_VISIBLE_DEVICES="2,0")
    assert [ask(v, "key", ordinal=i)["key"] for i in range(2)] == [keys[2], keys[0]]


def test_create_and_attach_on_device_1_leave_device_0_current(registry_server, model):
    a = model.peer(registry_server.path, "A")
    ask(a, "push", ordinal=0)
    ask(a, "hello", ordinal=1)
    for key in ("x", "y"):
        s = ask(a, "create", ordinal=1, nbytes=MB, members=[[key, 0, MB]])["stats"]
        # torch's context on device 0 plus the backend's on device 1, retained once per process.
        assert (s["current_device"], s["context_depth"], s["retained_contexts"]) == (0, 1, 2)
    b = model.peer(registry_server.path, "B")
    ask(b, "push", ordinal=0)
    ask(b, "hello", ordinal=1)
    mapped = ask(b, "map", ordinal=1, keys=["x", "y"])
    assert mapped["digests"] == {"x": digest("x", MB), "y": digest("y", MB)}
    s = ask(b, "close")["stats"]
    assert (s["current_device"], s["context_depth"], s["retained_contexts"], s["mappings"]) == (0, 1, 2, 0)


def test_a_pack_is_mapped_whole_for_one_member(registry_server, model):
    # The driver refuses to map part of an imported allocation (an H200 did, CudaSegment.mapped_bytes).
    members = [["p0", 0, MB], ["p1", 2 * MB, MB], ["p2", 4 * MB, 3 * MB // 2]]
    a = model.peer(registry_server.path, "A")
    ask(a, "hello", ordinal=0)
    assert ask(a, "create", ordinal=0, nbytes=4 * MB + 3 * MB // 2, members=members)["size"] == 6 * MB
    b = model.peer(registry_server.path, "B")
    ask(b, "hello", ordinal=0)
    first = ask(b, "map", ordinal=0, keys=["p0"])
    assert first["sizes"] == {"p0": 6 * MB}  # all three granules, for a member in the first
    assert first["digests"] == {"p0": digest("p0", MB)}
    last = ask(b, "map", ordinal=0, keys=["p2"])
    assert last["sizes"] == {"p2": 6 * MB}
    assert last["digests"] == {"p0": digest("p0", MB), "p2": digest("p2", 3 * MB // 2)}
    assert ask(b, "close")["stats"]["mappings"] == 0


@pytest.mark.parametrize("unsupported, words", [("vmm", "virtual memory management"),
                                                ("posix_fd", "POSIX file-descriptor memory handles")])
def test_a_device_that_cannot_share_memory_gives_a_clear_segment_error(model, unsupported, words):
    p = model.peer("-", "U", CUDAMODEL_UNSUPPORTED=unsupported)
    got = ask(p, "allocate", ordinal=0, nbytes=MB)
    assert words in got["error"] and "keeps them private" in got["error"]
    attached = ask(p, "attach", ordinal=0, source="memfd")
    assert words in attached["error"] and attached["closed"] is True
    s = attached["stats"]
    assert (s["allocations"], s["mappings"], s["reservations"], s["context_depth"]) == (0, 0, 0, 0)


def test_attach_refuses_what_it_cannot_map_and_closes_the_descriptor(model):
    p = model.peer("-", "R")
    foreign = ask(p, "attach", ordinal=0, source="memfd")
    assert "not a CUDA allocation" in foreign["error"] and foreign["closed"] is True
    short = ask(p, "attach", ordinal=0, source="small")
    assert "cannot map 4194304 bytes" in short["error"] and short["closed"] is True
    s = short["stats"]  # only the 2 MiB allocation's own mapping is left
    assert (s["allocations"], s["mappings"], s["reservations"], s["context_depth"]) == (0, 1, 1, 0)
    part = ask(p, "attach", ordinal=0, source="part")  # as an H200's driver answered
    assert "CUDA_ERROR_NOT_SUPPORTED" in part["error"] and part["closed"] is True
    s = part["stats"]  # the two allocations' own mappings
    assert (s["allocations"], s["mappings"], s["reservations"], s["context_depth"]) == (0, 2, 2, 0)


def test_out_of_memory_is_retried_once_after_returning_cached_blocks(model):
    p = model.peer("-", "O")
    ask(p, "fail", name="cuMemCreate", code=OUT_OF_MEMORY, count=1)
    assert ask(p, "allocate", ordinal=0, nbytes=MB) | {"stats": None} == {"size": 2 * MB, "released": 1, "stats": None,
                                                                           "inheritable": False}
    ask(p, "fail", name="cuMemCreate", code=OUT_OF_MEMORY, count=2)
    got = ask(p, "allocate", ordinal=0, nbytes=MB)
    assert "out of memory" in got["error"] and "cached blocks" in got["error"] and got["released"] == 1
    ask(p, "fail", name="cuMemCreate", code=NOT_SUPPORTED, count=1)
    other = ask(p, "allocate", ordinal=0, nbytes=MB)
    assert "CUDA_ERROR_NOT_SUPPORTED" in other["error"] and other["released"] == 0  # only OOM is retried
    s = other["stats"]
    assert (s["allocations"], s["mappings"], s["reservations"]) == (0, 0, 0)


@pytest.mark.parametrize("call", ["cuMemExportToShareableHandle", "cuMemAddressReserve", "cuMemMap",
                                  "cuMemSetAccess"])
def test_a_failing_driver_call_leaves_nothing_allocated_or_mapped(model, call):
    p = model.peer("-", "F")
    ask(p, "fail", name=call, code=OUT_OF_MEMORY if call == "cuMemAddressReserve" else 1, count=1)
    got = ask(p, "allocate", ordinal=0, nbytes=MB)
    assert f"{call} failed" in got["error"]
    s = got["stats"]
    assert (s["allocations"], s["mappings"], s["reservations"], s["context_depth"]) == (0, 0, 0, 0)


def test_a_finalizer_during_graph_capture_defers_the_unmap(model):
    p = model.peer("-", "D")
    got = ask(p, "defer", ordinal=0)
    assert got["during"]["mappings"] == 1 and got["during"]["synchronizes"] == 0  # nothing synchronized
    assert got["released"] == 1
    assert got["after"]["mappings"] == 0 and got["after"]["synchronizes"] == 1
    assert got["deadlocked"] is False and got["under_lock"]["mappings"] == 0  # re-entrant: it ran under the lock


@pytest.mark.parametrize("bindings", ["13", "12"])
def test_mig_instances_of_one_gpu_get_distinct_device_keys(model, bindings):
    """Two MIG instances of one GPU: ``cuDeviceGetUuid`` v1 names both by their parent GPU, only
    v2 by their own UUID (the model answers by the version the caller asks for, as the driver
    does).  cuda-bindings 12 resolves ``cuDeviceGetUuid`` to v1 and offers ``_v2`` beside it;
    13 resolves it to v2.  Either way the device keys must differ, or two instances would share
    one registry index and one start-up lock."""
    env = {"CUDAMODEL_MIG": "1"}
    if bindings == "12":
        if not (BINDINGS_12 / "cuda" / "bindings").is_dir():
            pytest.fail(f"cuda-bindings 12 is not installed at {BINDINGS_12}: run scripts/ensure-venv.sh")
        env["VMM_PEER_BINDINGS"] = str(BINDINGS_12)
    p = model.peer("-", "MIG", devices=2, **env)
    got = ask(p, "uuids")
    assert got["bindings"].split(".")[0] == bindings
    v1, v2 = got["uuids"]["9020"], got["uuids"]["11040"]
    assert v1[0] == v1[1] and v2[0] != v2[1]
    assert got["keys"][0] != got["keys"][1]
    assert [k.replace("-", "")[len("cuda:GPU"):] for k in got["keys"]] == v2


def test_a_device_whose_create_fails_although_its_attributes_say_yes_is_refused_after_one_try(model):
    """WSL2: the POSIX-descriptor attribute reads 1, ``cuMemCreate`` fails INVALID_VALUE.  The
    failure is remembered per device: later segments on it fail at once, without the driver."""
    p = model.peer("-", "W", CUDAMODEL_UNSUPPORTED="create")
    first = ask(p, "allocate", ordinal=0, nbytes=MB)
    assert "CUDA_ERROR_INVALID_VALUE" in first["error"] and "cannot create shareable" in first["error"]
    assert first["stats"]["create_calls"] == 1
    again = ask(p, "allocate", ordinal=0, nbytes=MB)
    assert again["error"] == first["error"] and again["stats"]["create_calls"] == 1
    attached = ask(p, "attach", ordinal=0, source="memfd")
    assert attached["error"] == first["error"] and attached["closed"] is True
    other = ask(p, "allocate", ordinal=1, nbytes=MB)  # another device is tried on its own
    assert "device 1" in other["error"] and other["stats"]["create_calls"] == 2
    s = other["stats"]
    assert (s["allocations"], s["mappings"], s["reservations"], s["context_depth"]) == (0, 0, 0, 0)


def test_a_driver_that_refuses_read_only_mappings_maps_read_write_and_says_so_once(registry_server, model):
    """Where ``cuMemSetAccess`` refuses ``PROT_READ``, creator and importers keep read-write
    mappings (documented fallback: `vmm.Mapping.protect`), sharing still works, one warning per
    process says that a stray write is not caught, and such a write indeed is not."""
    env = {"CUDAMODEL_UNSUPPORTED": "read_only"}
    a = model.peer(registry_server.path, "A", **env)
    ask(a, "hello", ordinal=0)
    for key in ("w", "x"):
        created = ask(a, "create", ordinal=0, nbytes=MB, members=[[key, 0, MB]])
        assert created["read_only"] is False
    b = model.peer(registry_server.path, "B", **env)
    ask(b, "hello", ordinal=0)
    mapped = ask(b, "map", ordinal=0, keys=["w", "x"])
    assert mapped["digests"] == {"w": digest("w", MB), "x": digest("x", MB)} and mapped["read_only"] is False
    for p in (a, b):
        assert p.log().count("refuses read-only mappings") == 1, p.log()
    b.send({"op": "write", "key": "w"})
    assert b.read_json() is not None  # the write went through: nothing faults here
    assert ask(a, "read")["digests"]["w"] != digest("w", MB)


@pytest.mark.parametrize("code, name", [(STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"),
                                        (ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS")])
def test_a_close_that_fails_leaves_its_range_to_the_next_release_not_forgotten(model, code, name):
    """The handle is released once mapped, so a range forgotten by a failed close would keep
    its allocation until the process exits."""
    p = model.peer("-", "C")
    got = ask(p, "close_fails", ordinal=0, code=code)
    assert got["error"].startswith(f"cuCtxSynchronize failed: {name} ("), got["error"]
    assert (got["failed"]["mappings"], got["failed"]["reservations"]) == (1, 1)
    assert got["released"] == 1
    s = got["stats"]
    assert (s["allocations"], s["mappings"], s["reservations"], s["context_depth"]) == (0, 0, 0, 0)


def test_a_close_whose_free_fails_leaves_only_the_free_to_the_next_release(model):
    """After ``cuMemUnmap`` the range is a reservation only (NVIDIA's reference): the retry
    frees it, rather than unmapping it again (which fails) and forgetting the reservation."""
    p = model.peer("-", "C")
    got = ask(p, "close_fails", ordinal=0, code=OUT_OF_MEMORY, call="cuMemAddressFree")
    assert got["error"].startswith("cuMemAddressFree failed"), got["error"]
    assert (got["failed"]["mappings"], got["failed"]["reservations"]) == (0, 1)
    assert got["released"] == 1
    s = got["stats"]
    assert (s["allocations"], s["mappings"], s["reservations"], s["context_depth"]) == (0, 0, 0, 0)
    assert "could not unmap" not in p.log()


def test_a_close_whose_context_pop_fails_after_the_free_leaves_nothing_to_free_again(model):
    """The range is freed already when leaving the device's context fails: freeing it again
    later could free another reservation that has taken its addresses."""
    p = model.peer("-", "C")
    got = ask(p, "close_fails", ordinal=0, code=1, call="cuCtxPopCurrent")
    assert got["error"].startswith("cuCtxPopCurrent failed"), got["error"]
    assert (got["failed"]["mappings"], got["failed"]["reservations"]) == (0, 0)
    assert got["released"] == 0  # nothing was left to the retry


def test_a_map_that_fails_says_so_when_freeing_its_reservation_fails_too(model):
    """``cuMemMap``'s error is the one raised; the reservation it leaves is freed by the next
    release, not leaked."""
    p = model.peer("-", "F")
    ask(p, "fail", name="cuMemMap", code=OUT_OF_MEMORY, count=1)
    ask(p, "fail", name="cuMemAddressFree", code=OUT_OF_MEMORY, count=1)
    got = ask(p, "allocate", ordinal=0, nbytes=MB)
    assert "cuMemMap failed" in got["error"], got["error"]
    assert (got["stats"]["mappings"], got["stats"]["reservations"]) == (0, 1)
    s = ask(p, "allocate", ordinal=0, nbytes=MB)["stats"]  # the next allocation releases what was left first
    assert (s["allocations"], s["mappings"], s["reservations"], s["context_depth"]) == (0, 0, 0, 0)


def test_an_earlier_launchs_error_at_set_access_fails_the_import_instead_of_mapping_it_writable(registry_server,
                                                                                              model):
    """Only a refusal (invalid value, not supported) means the driver has no read-only
    mappings; any other error of ``cuMemSetAccess`` fails this import (its tensors stay
    private), and the next import is read-only again."""
    a = model.peer(registry_server.path, "A")
    ask(a, "hello", ordinal=0)
    ask(a, "create", ordinal=0, nbytes=MB, members=[["w", 0, MB]])
    b = model.peer(registry_server.path, "B")
    ask(b, "hello", ordinal=0)
    ask(b, "fail", name="cuMemSetAccess", code=ILLEGAL_ADDRESS, count=1)
    failed = ask(b, "map", ordinal=0, keys=["w"])
    assert failed["segment_error"] and "cuMemSetAccess failed: CUDA_ERROR_ILLEGAL_ADDRESS" in failed["error"], failed
    assert (failed["stats"]["mappings"], failed["stats"]["reservations"]) == (0, 0)
    mapped = ask(b, "map", ordinal=0, keys=["w"])
    assert mapped["read_only"] is True and mapped["digests"] == {"w": digest("w", MB)}
    assert "refuses read-only mappings" not in b.log()


def test_an_exported_descriptor_is_not_inherited_by_a_program_vllm_runs(model):
    """The reference promises no close-on-exec for ``cuMemExportToShareableHandle``'s descriptor
    (nor does the model give it): a compiler vLLM execs must not keep the allocation alive."""
    assert ask(model.peer("-", "X"), "allocate", ordinal=0, nbytes=MB)["inheritable"] is False


def test_a_create_that_fails_otherwise_than_by_refusing_does_not_refuse_the_device(model):
    p = model.peer("-", "T")
    ask(p, "fail", name="cuMemCreate", code=ILLEGAL_ADDRESS, count=1)
    first = ask(p, "allocate", ordinal=0, nbytes=MB)
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in first["error"] and "cannot create shareable" not in first["error"]
    assert ask(p, "allocate", ordinal=0, nbytes=MB)["size"] == 2 * MB


def test_a_finalizer_on_another_thread_during_a_capture_defers_the_unmap(model):
    """A capture runs on this thread; the last reference to a mapping goes on another thread,
    whose own stream captures nothing.  The capture check is process-wide (`segments.cuda`
    counts captures on every thread), so that finalizer defers too: no synchronize mid-capture."""
    p = model.peer("-", "E")
    got = ask(p, "defer_elsewhere", ordinal=0)
    assert got["during"]["mappings"] == 1 and got["during"]["synchronizes"] == 0
    assert got["released"] == 1 and got["after"]["mappings"] == 0 and got["after"]["synchronizes"] == 1


def _smollm2_on_a_gpu(layers: int) -> dict[str, int]:
    """Bytes of each weight of SmolLM2-135M's first ``layers`` layers as vLLM's GPU model holds
    them in bfloat16 (q, k, v merged into ``qkv_proj``; gate and up into ``gate_up_proj``;
    hidden 576, 9 heads and 3 KV heads of 64, intermediate 1536, vocabulary 49152, tied
    embeddings), at least the loader's default ``min_tensor_bytes`` (1 MiB)."""
    hidden, intermediate, kv = 576, 1536, 3 * 64
    shapes = {"embed_tokens": (49152, hidden)}
    for i in range(layers):
        shapes |= {f"{i}.qkv_proj": (hidden + 2 * kv, hidden), f"{i}.o_proj": (hidden, hidden),
                   f"{i}.gate_up_proj": (2 * intermediate, hidden), f"{i}.down_proj": (hidden, intermediate)}
    return {name: rows * cols * 2 for name, (rows, cols) in shapes.items() if rows * cols * 2 >= 1 << 20}


def test_publish_in_place_costs_the_first_engine_a_private_load_and_the_second_nothing(registry_server, model):
    """Issue 27, item 5, on the driver model: the first engine allocates its weights' packs
    (`CudaSegment.allocate`), its weight loaders write them where they lie, and it publishes
    them (`CudaSegment.freeze`): the device's used memory grows by the weights plus the packs'
    padding, within 5% of a private load's bytes.  A second engine maps all of them: the device's
    used memory does not grow."""
    tensors = _smollm2_on_a_gpu(layers=4)
    weights = sum(tensors.values())
    a = model.peer(registry_server.path, "A", devices=1)
    ask(a, "hello", ordinal=0)
    free0 = ask(a, "memory", ordinal=0)["free"]
    first = ask(a, "load_in_place", ordinal=0, tensors=tensors)
    grown = free0 - ask(a, "memory", ordinal=0)["free"]
    assert first["private"] == [] and first["shared"] == 0 and first["read_only"] is True
    assert grown == first["segment_bytes"] and weights <= grown <= 1.05 * weights, (grown, weights)
    want = {k: digest(k, n) for k, n in tensors.items()}
    assert first["digests"] == want

    b = model.peer(registry_server.path, "B", devices=1)
    ask(b, "hello", ordinal=0)
    second = ask(b, "load_in_place", ordinal=0, tensors=tensors)
    assert second["shared"] == weights and second["segment_bytes"] == 0 and second["digests"] == want
    assert ask(b, "memory", ordinal=0)["free"] == free0 - grown  # the second engine costs the device nothing
    assert a.end() == 0
    assert ask(b, "read")["digests"] == want  # the first engine's segments outlive it
