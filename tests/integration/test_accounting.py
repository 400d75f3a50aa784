"""GPU memory accounting: the start-up lock protocol between real processes, the vLLM facts the
accounting rests on (checked against the installed vLLM, whose GPU worker code ships in the CPU
build too), and the hook that gives the lock back."""

from __future__ import annotations

import inspect
import os
import time

import pytest

from test_broker import segment_peer
from vllm_dedup.cli import format_status
from vllm_dedup.config import DedupConfig
from vllm_dedup.engine.session import EngineSession
from vllm_dedup.registry.client import BrokerClient, registry_stats
from vllm_dedup.registry.state import startup_lock_name
from vllm_dedup.segments.host import HostSegment

GPU0 = "cuda:GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "cuda:GPU-11111111-1111-1111-1111-111111111111"
MB = 1 << 20


def test_startup_lock_serialises_engines_and_defers_frees_on_its_device(broker):
    import torch

    lock = startup_lock_name(GPU0)
    starting = segment_peer(broker.path, "lock", lock, "vllm-instance:A", GPU0)
    assert starting.read_json() == {"locked": lock}
    with BrokerClient(broker.path) as other, BrokerClient(broker.path) as leaving:
        other.hello("other", GPU0, "default")
        leaving.hello("leaving", GPU0, "default")
        with pytest.raises(TimeoutError, match=f"pid {starting.pid}"):
            other.lock(lock, owner="vllm-instance:B", timeout_s=0.3)
        # An engine on the device exits while the other is profiling: its segment must stay.
        seg = HostSegment.create(torch.zeros(MB, dtype=torch.uint8), GPU0)
        leaving.publish(seg.fileno(), seg.nbytes, [("k", 0, seg.nbytes)])
        seg.close_fd()
        del seg
        leaving.close()
        time.sleep(0.2)
        stats = registry_stats(broker.path)
        (group,) = stats.groups
        assert (group.segments, group.deferred_segments, group.engines) == (1, 1, 2)
        human = format_status(stats)
        assert f"lock {lock} held by pid {starting.pid}" in human
        assert "1 unheld segment(s) kept until a start-up on their device ends" in human
        assert starting.end() == 0  # start-up done: lock back, the deferred segment goes
        other.lock(lock, owner="vllm-instance:B", timeout_s=10)
        (group,) = registry_stats(broker.path).groups
        assert (group.segments, group.engines) == (0, 1)
        assert registry_stats(broker.path).locks == {lock: os.getpid()}


def test_tp_ranks_share_their_instance_lock_and_take_every_gpu_at_once(broker):
    names = ",".join(sorted([startup_lock_name(GPU0), startup_lock_name(GPU1)]))
    rank0 = segment_peer(broker.path, "lock", names, "vllm-instance:A", GPU0)
    rank1 = segment_peer(broker.path, "lock", names, "vllm-instance:A", GPU1)
    assert rank0.read_json()["locked"] == names and rank1.read_json()["locked"] == names  # no waiting
    with BrokerClient(broker.path) as other:
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
    session's correction makes it ``B - shared``, whatever the prediction was."""
    from types import SimpleNamespace

    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    gib = 1 << 30
    snapshot = MemorySnapshot(total_memory=80 * gib, free_memory=80 * gib, device="cpu", auto_measure=False)
    cache = SimpleNamespace(gpu_memory_utilization=0.5)
    plain = request_memory(snapshot, cache, 0)
    for predicted, shared in ((10 * gib, 12 * gib), (10 * gib, 7 * gib), (0, 5 * gib), (3 * gib, 3 * gib)):
        session = EngineSession()
        session.predicted = predicted  # what begin_startup asked the registry for
        session.hold(object(), segment_bytes=shared, shared_bytes=shared)
        worker = SimpleNamespace(requested_memory=request_memory(snapshot, cache, predicted))
        assert session.correct_budget(worker) == shared - predicted
        assert worker.requested_memory == plain - shared
        assert session.correct_budget(worker) == 0  # applied once
    kv_cache_mode = EngineSession()  # accounting="kv_cache": no prediction, no correction
    kv_cache_mode.hold(object(), segment_bytes=5 * gib, shared_bytes=5 * gib)
    worker = SimpleNamespace(requested_memory=plain)
    assert kv_cache_mode.correct_budget(worker) == 0 and worker.requested_memory == plain


def test_the_hook_gives_the_startup_lock_back_even_when_warm_up_fails(broker, monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_dedup.engine import worker_hooks

    worker_hooks.install()
    for name in ("load_model", "compile_or_warm_up_model"):
        assert getattr(Worker.__dict__[name], "__vllm_dedup_hook__", False), name
    client = BrokerClient(broker.path)
    client.hello("m", GPU0, "default")
    client.lock([startup_lock_name(GPU0)], owner="vllm-instance:X")
    session = EngineSession()
    session.startup_client, session.locks = client, [startup_lock_name(GPU0)]
    monkeypatch.setattr(EngineSession, "_current", session)
    try:
        with pytest.raises(AttributeError):  # not a real worker: the warm-up itself fails
            Worker.compile_or_warm_up_model(object())
        assert registry_stats(broker.path).locks == {}
        session.end_startup()  # idempotent
    finally:
        client.close()


def test_accounting_option_is_checked():
    assert DedupConfig.from_extra_config({"accounting": "external"}).accounting == "external"
    with pytest.raises(ValueError, match="accounting must be 'kv_cache' or 'external'"):
        DedupConfig.from_extra_config({"accounting": "kv"})
    with pytest.raises(ValueError, match="startup_lock_timeout_s"):
        DedupConfig.from_extra_config({"startup_lock_timeout_s": 0})


def test_registry_timeout_s_is_checked():
    assert DedupConfig().registry_timeout_s == 10.0  # README states this default
    for bad in (0, -1, True, "10", 3601):
        with pytest.raises(ValueError, match="registry_timeout_s"):
            DedupConfig.from_extra_config({"registry_timeout_s": bad})
