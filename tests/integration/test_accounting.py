"""GPU memory accounting: the start-up lock protocol between real processes, the vLLM facts the
accounting rests on (checked against the installed vLLM, whose GPU worker code ships in the CPU
build too), and the hook that gives the lock back."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import PEERS, segment_peer, wait_for
from vllm_dedup.cli import format_status
from vllm_dedup.config import DedupConfig
from vllm_dedup.engine.session import EngineSession
from vllm_dedup.registry.client import RegistryClient, registry_stats
from vllm_dedup.registry.state import startup_lock_name
from vllm_dedup.segments.host import HostSegment

ROOT = Path(__file__).resolve().parents[2]
PATCHES = sorted((ROOT / "patches").glob("*.patch"))
GPU0 = "cuda:GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "cuda:GPU-11111111-1111-1111-1111-111111111111"
MB = 1 << 20


def test_startup_lock_serialises_engines_and_defers_frees_on_its_device(registry_server):
    import torch

    lock = startup_lock_name(GPU0)
    starting = segment_peer(registry_server.path, "lock", lock, "vllm-instance:A", GPU0)
    assert starting.read_json() == {"locked": lock}
    with RegistryClient(registry_server.path) as other, RegistryClient(registry_server.path) as leaving:
        other.hello("other", GPU0, "default")
        leaving.hello("leaving", GPU0, "default")
        with pytest.raises(TimeoutError, match=f"pid {starting.pid}"):
            other.lock(lock, owner="vllm-instance:B", timeout_s=0.3)
        # An engine on the device exits while the other is profiling: its segment must stay.
        seg = HostSegment.create_packed([(torch.zeros(MB, dtype=torch.uint8), 0)], MB, GPU0)
        leaving.publish(seg.fileno(), seg.nbytes, [("k", 0, seg.nbytes)])
        seg.close_fd()
        del seg
        leaving.close()
        assert wait_for(lambda: registry_stats(registry_server.path).groups[0].engines == 2)
        stats = registry_stats(registry_server.path)
        (group,) = stats.groups
        assert (group.segments, group.deferred_segments, group.engines) == (1, 1, 2)
        human = format_status(stats)
        assert f"lock {lock} held by pid {starting.pid}" in human
        assert "1 unheld segment(s) kept until a start-up on their device ends" in human
        assert starting.end() == 0  # start-up done: lock back, the deferred segment goes
        other.lock(lock, owner="vllm-instance:B", timeout_s=10)
        (group,) = registry_stats(registry_server.path).groups
        assert (group.segments, group.engines) == (0, 1)
        assert registry_stats(registry_server.path).locks == {lock: os.getpid()}


def test_tp_ranks_share_their_instance_lock_and_take_every_gpu_at_once(registry_server):
    names = ",".join(sorted([startup_lock_name(GPU0), startup_lock_name(GPU1)]))
    rank0 = segment_peer(registry_server.path, "lock", names, "vllm-instance:A", GPU0)
    rank1 = segment_peer(registry_server.path, "lock", names, "vllm-instance:A", GPU1)
    assert rank0.read_json()["locked"] == names and rank1.read_json()["locked"] == names  # no waiting
    with RegistryClient(registry_server.path) as other:
        other.hello("other", GPU1, "default")
        with pytest.raises(TimeoutError):
            other.lock(startup_lock_name(GPU1), owner="vllm-instance:B", timeout_s=0.3)
        rank0.kill()
        with pytest.raises(TimeoutError):  # rank 1 still holds it for the instance
            other.lock(startup_lock_name(GPU1), owner="vllm-instance:B", timeout_s=0.3)
        assert rank1.end() == 0
        other.lock(startup_lock_name(GPU1), owner="vllm-instance:B", timeout_s=10)


def test_vllm_takes_the_external_weight_figure_before_its_memory_snapshot():
    """The order `EngineSession.begin_startup` relies on (lock taken before the snapshot)."""
    from vllm.v1.worker.gpu_worker import Worker

    source = inspect.getsource(Worker.init_device)
    assert 0 < source.index("get_external_weight_memory") < source.index("MemorySnapshot(")
    assert source.index("request_memory(") > source.index("MemorySnapshot(")
    assert "self.requested_memory" in inspect.getsource(Worker.determine_available_memory)
    assert "initialize_kv_cache" in inspect.getsource(Worker.initialize_from_config)


def test_external_mode_budget_ends_at_plain_minus_the_bytes_really_mapped():
    """vLLM budgets ``B - predicted`` at start-up (its own `request_memory`); after loading, the
    session's correction makes it ``B - shared``, whatever the prediction was; a load that ended
    up private (no registry, a fallback) counts as nothing mapped."""
    from types import SimpleNamespace

    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    gib = 1 << 30
    snapshot = MemorySnapshot(total_memory=80 * gib, free_memory=80 * gib, device="cpu", auto_measure=False)
    cache = SimpleNamespace(gpu_memory_utilization=0.5)
    plain = request_memory(snapshot, cache, 0)
    for predicted, shared in ((10 * gib, 12 * gib), (10 * gib, 7 * gib), (10 * gib, 0), (0, 5 * gib),
                              (3 * gib, 3 * gib)):
        session = EngineSession()
        reported = session.plan_startup("external", predicted, snapshot.free_memory, snapshot.total_memory, 0.5)
        assert reported == predicted
        if shared:
            session.hold(object(), segment_bytes=shared, shared_bytes=shared)
        worker = SimpleNamespace(requested_memory=request_memory(snapshot, cache, reported), init_snapshot=snapshot,
                                 cache_config=cache)
        assert session.correct_budget(worker) == shared - predicted
        assert worker.requested_memory == plain - shared  # a prediction of 0 too
        assert session.correct_budget(worker) == 0 and session.correction_bytes == 0  # applied once
    # A start-up that failed after its prediction (vLLM's request_memory in init_device, a load
    # that raised) ends with nothing left to correct: not a later engine's budget (a plain one).
    session = EngineSession()
    session.plan_startup("external", 10 * gib, snapshot.free_memory, snapshot.total_memory, 0.5)
    session.end_startup()
    worker = SimpleNamespace(requested_memory=plain, init_snapshot=snapshot, cache_config=cache)
    assert session.correct_budget(worker) == 0 and worker.requested_memory == plain
    # A second engine in the same process (VLLM_ENABLE_V1_MULTIPROCESSING=0): its correction
    # counts its own load, not the first engine's.
    session = EngineSession()
    session.plan_startup("external", 10 * gib, snapshot.free_memory, snapshot.total_memory, 0.5)
    session.hold(object(), segment_bytes=12 * gib, shared_bytes=12 * gib)
    assert session.correction_bytes == 2 * gib
    session.budget_corrected = True
    session.plan_startup("external", 4 * gib, snapshot.free_memory, snapshot.total_memory, 0.5)
    session.hold(object(), segment_bytes=3 * gib, shared_bytes=3 * gib)
    assert session.correction_bytes == -1 * gib and session.segment_bytes == 15 * gib
    kv_cache_mode = EngineSession()  # accounting="kv_cache", room for the full budget: nothing reported
    assert kv_cache_mode.plan_startup("kv_cache", 5 * gib, 80 * gib, 80 * gib, 0.5) == 0
    kv_cache_mode.hold(object(), segment_bytes=5 * gib, shared_bytes=5 * gib)
    worker = SimpleNamespace(requested_memory=plain, init_snapshot=snapshot, cache_config=cache)
    assert kv_cache_mode.correct_budget(worker) == 0 and worker.requested_memory == plain


def test_kv_cache_mode_reports_the_bytes_to_map_only_when_the_full_budget_does_not_fit():
    gib = 1 << 30  # the budget: 0.45 of 80 GiB = 36 GiB
    for free, predicted, reported in ((80 * gib, 16 * gib, 0),   # fits: the saving goes to the KV cache
                                      (28 * gib, 16 * gib, 16 * gib),  # the creator's restart (issue 18)
                                      (19 * gib, 16 * gib, 0),   # does not fit either way: vLLM says so
                                      (28 * gib, 0, 0)):         # nothing to map
        session = EngineSession()
        assert session.plan_startup("kv_cache", predicted, free, 80 * gib, 0.45) == reported
        assert session.predicted == (reported or None)
    assert EngineSession().plan_startup("external", 16 * gib, 80 * gib, 80 * gib, 0.45) == 16 * gib


def test_a_start_up_after_a_failed_one_in_the_process_corrects_nothing_of_it():
    """A GPU engine that predicted 10 GiB failed to load; the next engine of the process must
    not have that prediction applied to its budget.  The next one is asked here on a config
    without a GPU (begin_startup returns at once: nothing predicted), which resets as a GPU
    engine's start-up does before anything else."""
    from types import SimpleNamespace

    gib = 1 << 30
    session = EngineSession()
    session.plan_startup("external", 10 * gib, 80 * gib, 80 * gib, 0.5)
    cpu = SimpleNamespace(device_config=SimpleNamespace(device="cpu"))
    assert session.begin_startup(DedupConfig(), cpu) == 0
    session.hold(object(), segment_bytes=14 * gib, shared_bytes=14 * gib)
    assert session.predicted is None and session.correction_bytes == 0


def test_the_start_up_connection_serves_only_the_engine_it_said_hello_for(registry_server, monkeypatch):
    """A second engine of the process with another share group (or model, or registry) gets a
    connection of its own, not the first one's, which said hello in the other group; a
    start-up connection no load holds is closed when the start-up ends, one held as a lease
    is kept."""
    from vllm_dedup.engine.session import _connection_for

    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(registry_server.path.parent))  # its socket: <dir>/test.sock
    mine = {"registry_namespace": registry_server.path.stem, "registry_address": "local", "on_registry_error": "fail"}
    config = DedupConfig(**mine, share_group="tenant-a")
    session = EngineSession()
    first = session.connect(config, "model-a", GPU0, "sig")
    assert first is not None
    session.startup_client, session.startup_for = first, _connection_for(config, "model-a", GPU0, "sig")
    try:
        assert session.connect(config, "model-a", GPU0, "sig") is first
        other_group = DedupConfig(**mine, share_group="tenant-b")
        second = session.connect(other_group, "model-a", GPU0, "sig")
        assert second is not first and second.group == "tenant-b"
        second.close()
        another_model = session.connect(config, "model-b", GPU0, "sig")
        assert another_model is not first
        another_model.close()
        session.end_startup()  # the load failed: nothing holds the connection
        assert session.startup_client is None
        assert wait_for(lambda: registry_stats(registry_server.path).groups == [])
        held = session.connect(config, "model-a", GPU0, "sig")
        session.startup_client, session.startup_for = held, _connection_for(config, "model-a", GPU0, "sig")
        session.hold(held, segment_bytes=0, shared_bytes=0)
        session.end_startup()
        assert [g.engines for g in registry_stats(registry_server.path).groups] == [1]  # still connected
    finally:
        for lease in session.leases:
            lease.close()


def test_a_lease_goes_with_the_model_it_was_held_for(registry_server, monkeypatch):
    """An engine in the user's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) deleted: once
    its model is collected, its lease is closed (the registry drops its holds) and its bytes
    leave the process's figures, so a later engine's guards do not count them."""
    import gc

    import torch.nn as nn

    from vllm_dedup.registry.lease import Lease

    session = EngineSession()
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    leases = [Lease(RegistryClient(registry_server.path), name, GPU0, "default", "sig") for name in ("a", "b")]
    session.hold(leases[0], segment_bytes=3 * MB, shared_bytes=2 * MB, model=model)
    session.hold(leases[1], segment_bytes=5 * MB, shared_bytes=0, model=other)
    assert [g.engines for g in registry_stats(registry_server.path).groups] == [2]
    del model
    gc.collect()
    assert (session.segment_bytes, session.shared_bytes, session.leases) == (5 * MB, 0, [leases[1]])
    assert wait_for(lambda: [g.engines for g in registry_stats(registry_server.path).groups] == [1])
    session.release(leases[0], 3 * MB, 2 * MB)  # released already: nothing changes
    assert session.segment_bytes == 5 * MB
    # One start-up connection held for a model and its drafter: closed with the last of them.
    target, drafter = nn.Linear(2, 2), nn.Linear(2, 2)
    session.hold(leases[1], segment_bytes=2 * MB, shared_bytes=MB, model=target)
    session.hold(leases[1], segment_bytes=MB, shared_bytes=MB, model=drafter)
    del drafter, other
    gc.collect()
    assert (session.segment_bytes, session.shared_bytes, session.leases) == (2 * MB, MB, [leases[1]])
    assert [g.engines for g in registry_stats(registry_server.path).groups] == [1]  # the target still holds it
    del target
    gc.collect()
    assert (session.segment_bytes, session.shared_bytes, session.leases) == (0, 0, [])
    assert wait_for(lambda: registry_stats(registry_server.path).groups == [])


def test_vllms_start_up_plan_is_warned_of_where_it_would_keep_a_kv_cache_grown_by_mapped_weights(monkeypatch):
    from vllm_dedup.engine.session import startup_plan_warning

    monkeypatch.delenv("VLLM_ENABLE_STARTUP_PLAN", raising=False)
    assert startup_plan_warning("kv_cache") is None
    monkeypatch.setenv("VLLM_ENABLE_STARTUP_PLAN", "1")
    assert "accounting='external'" in startup_plan_warning("kv_cache")
    assert startup_plan_warning("external") is None  # its KV cache is a plain load's


def test_an_engine_takes_the_start_up_locks_of_all_its_ranks():
    """vLLM's world size is ``pp * tp * pcp``: a PCP=2 engine has two ranks, each of which must
    take every visible GPU's lock at once (module docstring of `engine.session`)."""
    from types import SimpleNamespace

    from vllm_dedup.engine.session import _world_size

    pc = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1, prefill_context_parallel_size=2)
    assert _world_size(pc) == 2


STARTUP_STEPS = ["init_device", "load_model", "determine_available_memory", "initialize_from_config",
                 "compile_or_warm_up_model"]


@pytest.mark.parametrize("method", [*STARTUP_STEPS, "EngineCore.__init__"])
def test_the_hook_gives_the_startup_lock_back_even_when_the_method_fails(registry_server, monkeypatch, method):
    """Any start-up step from the lock (taken in ``init_device``) to the warm-up: an engine whose
    step raises (too little free memory, a checkpoint vLLM cannot read, a KV cache that does not
    fit) may live on, an engine in the user's own process.  Its start-up lock must not keep
    every other engine of the GPU waiting ``startup_lock_timeout_s``."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_dedup.engine import worker_hooks

    worker_hooks.install()
    for name in STARTUP_STEPS:
        assert getattr(Worker.__dict__[name], "__vllm_dedup_hook__", False), name
    assert getattr(EngineCore.__dict__["__init__"], "__vllm_dedup_hook__", False)
    client = RegistryClient(registry_server.path)
    client.hello("m", GPU0, "default")
    client.lock([startup_lock_name(GPU0)], owner="vllm-instance:X")
    session = EngineSession()
    session.startup_client, session.locks = client, [startup_lock_name(GPU0)]
    # Held as the load's lease (a later step failed): the connection stays open, so only the
    # unlock can give the lock back.
    session.hold(client, segment_bytes=0, shared_bytes=0)
    monkeypatch.setattr(EngineSession, "_current", session)
    try:
        with pytest.raises(AttributeError):  # not a real worker (or config): the method itself fails
            if method == "EngineCore.__init__":  # after the workers' steps, the engine core's own
                EngineCore.__init__(object.__new__(EngineCore), None, None, False)
            else:
                getattr(Worker, method)(object(), *([None] if method == "initialize_from_config" else []))
        assert registry_stats(registry_server.path).locks == {}
        session.end_startup()  # idempotent
    finally:
        client.close()


def test_accounting_option_is_checked():
    assert DedupConfig.from_extra_config({"accounting": "external"}).accounting == "external"
    with pytest.raises(ValueError, match="accounting must be 'kv_cache' or 'external'"):
        DedupConfig.from_extra_config({"accounting": "kv"})
    with pytest.raises(ValueError, match="startup_lock_timeout_s"):
        DedupConfig.from_extra_config({"startup_lock_timeout_s": 0})


@pytest.mark.slow  # imports vLLM's Worker in a child process (about 7 s each)
@pytest.mark.parametrize("patched", [False, True], ids=["installed", "patched"])
def test_the_budget_correction_is_applied_once_with_or_without_the_patches(tmp_path, patched):
    """patches/0002 applies the correction in ``Worker.load_model`` from the model's attribute;
    the plugin's wrapper applies it after ``Worker.load_model``.  On a vLLM with the patches the
    wrapper must not be installed, or the budget would be corrected twice.  Either way it ends at
    what vLLM's ``request_memory`` gives for the bytes really mapped."""
    worker_py = "-"
    if patched:
        import vllm

        site = Path(vllm.__file__).resolve().parents[1]
        tree = tmp_path / "vllm" / "v1" / "worker"
        tree.mkdir(parents=True)
        for name in ("gpu_worker.py", "cpu_worker.py"):
            shutil.copy(site / "vllm" / "v1" / "worker" / name, tree / name)
        for patch in PATCHES[:2]:  # 0001 (guards) and 0002 (accounting): the Worker's hooks
            proc = subprocess.run(["patch", "--batch", "-p1", "-d", str(tmp_path), "-i", str(patch)],
                                  capture_output=True, text=True)
            assert proc.returncode == 0, proc.stdout
        worker_py = str(tree / "gpu_worker.py")
    peer = PEERS / "patched_worker_peer.py"
    proc = subprocess.run([sys.executable, str(peer), worker_py], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("OK ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][3:])
    assert got["requested"] == got["expected"]
    assert ("Worker.load_model" in got["wrapped"]) is not patched
    assert ("Worker.compile_or_warm_up_model" in got["wrapped"]) is not patched
    assert ("Worker.sleep" in got["wrapped"]) is not patched  # the patch's guard is there instead


# Engines starting on the CUDA driver model (tests/cuda_model: host memory behind NVIDIA's
# documented contract, not a GPU; its device memory is its live allocations, held anywhere).
# Scale: 1 GB of the example is 2 MiB here: an 80 GB GPU, 16 GB of weights.
UTILIZATION = 0.45
DEVICE_MB = 160
WEIGHTS = {f"w{i}": 8 * MB for i in range(4)}  # 32 MiB, one allocation each
FINE_TUNE = {"w0": 8 * MB, "w1": 8 * MB, "t2": 8 * MB, "t3": 8 * MB}  # half of it retrained


@pytest.fixture
def engines(model_lib):
    from test_cuda_model import Model

    m = Model(model_lib)
    yield m
    for p in m.peers:
        p.end()


def start_engine(engines, registry_server, name: str, accounting: str, tensors: dict, check_memory=None):
    """One engine's start-up as vLLM 0.32's GPU worker sizes it, on the driver model: the
    loader's `EngineSession.plan_startup` (what ``get_external_weight_memory`` reports), vLLM's
    ``MemorySnapshot`` and ``request_memory`` (the budget, and the start-up check of free
    memory), loading (map what is resident, publish the rest), the session's budget correction,
    and the KV cache as ``determine_available_memory`` sizes it (budget minus the memory the
    load took; no activations), allocated on the device.  Raises vLLM's ValueError where vLLM
    would refuse the engine.  Returns the peer and its figures (bytes)."""
    from types import SimpleNamespace

    from test_cuda_model import ask
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    p = engines.peer(registry_server.path, name, devices=1, CUDAMODEL_MEMORY_MB=str(DEVICE_MB))
    ask(p, "hello", ordinal=0, signature="llama")
    predicted = ask(p, "expect")["bytes"]
    before = ask(p, "memory", ordinal=0)
    session = EngineSession()
    external = session.plan_startup(accounting, predicted, before["free"], before["total"], UTILIZATION)
    snapshot = MemorySnapshot(total_memory=before["total"], free_memory=before["free"], device="cpu",
                              auto_measure=False)
    cache = SimpleNamespace(gpu_memory_utilization=UTILIZATION)
    if check_memory is not None:
        check_memory(snapshot, cache)
    worker = SimpleNamespace(requested_memory=request_memory(snapshot, cache, external), init_snapshot=snapshot,
                             cache_config=cache)
    loaded = ask(p, "load", ordinal=0, tensors=tensors)
    session.hold(object(), loaded["shared"] + loaded["published"], loaded["shared"])
    session.correct_budget(worker)
    after = ask(p, "memory", ordinal=0)
    kv = worker.requested_memory - (before["free"] - after["free"])
    kept = ask(p, "keep", ordinal=0, nbytes=kv)
    assert "error" not in kept, kept
    ask(p, "recipe", signature="llama", final=tensors)
    return p, {"external": external, "requested": worker.requested_memory, "shared": loaded["shared"],
               "published": loaded["published"], "kv": kv, "free": ask(p, "memory", ordinal=0)["free"]}


@pytest.mark.heavy
@pytest.mark.parametrize("accounting", ["kv_cache", "external"])
def test_the_engine_that_created_the_segments_restarts_while_another_maps_them(registry_server, engines, accounting):
    """Blue/green restart of the creator (issue 18): A publishes the weights, B maps them, A
    exits (its segments stay: B maps them), A starts again.  In ``kv_cache`` mode B's budget
    holds none of the weights, so A's full budget no longer fits in the free memory; A's
    restart maps everything and needs only a plain load's KV cache of its own, so it reports the
    bytes it maps and starts.  Its KV cache is a plain load's either way."""
    from vllm.v1.worker.utils import request_memory

    budget, weights = 72 * MB, sum(WEIGHTS.values())
    a, first = start_engine(engines, registry_server, "A", accounting, WEIGHTS)
    assert (first["external"], first["published"], first["kv"]) == (0, weights, budget - weights)
    b, second = start_engine(engines, registry_server, "B", accounting, WEIGHTS)
    assert second["shared"] == weights
    assert second["kv"] == (budget if accounting == "kv_cache" else budget - weights)
    assert a.end() == 0

    def full_budget_check(snapshot, cache):  # what the restart met before: vLLM refuses it
        if accounting == "kv_cache":
            assert snapshot.free_memory < budget
            with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
                request_memory(snapshot, cache, 0)

    _, again = start_engine(engines, registry_server, "A2", accounting, WEIGHTS, full_budget_check)
    assert (again["external"], again["shared"], again["published"]) == (weights, weights, 0)
    assert again["requested"] == budget - weights and again["kv"] == first["kv"]


@pytest.mark.heavy
def test_an_engine_that_maps_less_than_predicted_fails_with_vllms_message_not_out_of_memory(registry_server, engines):
    """``external`` mode: the registry predicts the base model's 32 MiB for a fine-tune that
    maps 16 MiB.  vLLM approves ``budget - 32 MiB`` against the free memory; once loaded the
    budget must grow by 16 MiB, which the device no longer has.  The correction runs vLLM's
    check again and fails with its message; applied unchecked, the KV cache allocation would
    run out of device memory."""
    from test_cuda_model import ask

    start_engine(engines, registry_server, "A", "external", WEIGHTS)
    start_engine(engines, registry_server, "B", "external", WEIGHTS)  # free: 160 - 72 - 40 = 48 MiB
    with pytest.raises(ValueError, match="less than the engine's budget after excluding external"):
        start_engine(engines, registry_server, "C", "external", FINE_TUNE)
    c = engines.peers[-1]
    left = ask(c, "memory", ordinal=0)["free"]  # C loaded 16 MiB of its own: 32 MiB free
    unchecked = 72 * MB - 16 * MB - 16 * MB  # budget + 16 MiB, minus what C's load took: its KV cache
    assert left < unchecked
    assert "out of memory" in ask(c, "keep", ordinal=0, nbytes=unchecked)["error"]


def test_registry_timeout_s_is_checked():
    assert DedupConfig().registry_timeout_s == 10.0  # README states this default
    for bad in (0, -1, True, "10", 3601):
        with pytest.raises(ValueError, match="registry_timeout_s"):
            DedupConfig.from_extra_config({"registry_timeout_s": bad})


def test_a_registry_that_failed_the_start_up_is_not_waited_for_again_by_its_load(monkeypatch):
    """A hung registry costs one ``registry_timeout_s`` per start-up: where the start-up lock's
    request failed (a RegistryTimeout), the load's own connect does not try the same registry
    again; the next start-up does (it may be back), and so does one of another registry."""
    from vllm_dedup.errors import RegistryTimeout, RegistryUnavailable
    from vllm_dedup.registry import discovery

    tried = []

    def open_registry(namespace, address, *args, **kwargs):
        tried.append(namespace)
        raise RegistryUnavailable("no registry here (a test)")

    monkeypatch.setattr(discovery, "open_registry", open_registry)
    config = DedupConfig.from_extra_config({"registry_timeout_s": 1})

    class Hung:
        def lock(self, *args, **kwargs):
            raise RegistryTimeout("the registry did not answer within 1 s (a test)")

        def close(self):
            pass

    session = EngineSession()
    assert not session.take_startup_locks(config, Hung(), [startup_lock_name(GPU0)], "vllm-instance:X")
    assert session.connect(config, "m", GPU0, "sig") is None and tried == []  # no second wait
    other = DedupConfig.from_extra_config({"registry_namespace": "team-b"})
    assert session.connect(other, "m", GPU0, "sig") is None and tried == ["team-b"]
    session.end_startup()
    assert session.connect(config, "m", GPU0, "sig") is None and tried == ["team-b", config.registry_namespace]
