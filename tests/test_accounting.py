"""GPU memory accounting: the start-up lock protocol between real processes, the vLLM facts the
accounting rests on (checked against the installed vLLM, whose GPU worker code ships in the CPU
build too), and the hook that gives the lock back."""

from __future__ import annotations

import inspect
import os
import time

import pytest

from test_broker import Peer, broker  # noqa: F401  (fixture)
from vllm_dedup import accounting
from vllm_dedup.broker import BrokerClient, registry_stats
from vllm_dedup.cli import format_status
from vllm_dedup.config import DedupConfig
from vllm_dedup.registry import startup_lock_name
from vllm_dedup.segments.host import HostSegment

GPU0 = "cuda:GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "cuda:GPU-11111111-1111-1111-1111-111111111111"
MB = 1 << 20


def test_startup_lock_serialises_engines_and_defers_frees_on_its_device(broker):  # noqa: F811
    import torch

    lock = startup_lock_name(GPU0)
    starting = Peer(broker.path, "lock", lock, "vllm-instance:A", GPU0)
    assert starting.result() == {"locked": lock}
    with BrokerClient(broker.path) as other, BrokerClient(broker.path) as leaving:
        other.hello("other", GPU0, "default")
        leaving.hello("leaving", GPU0, "default")
        with pytest.raises(TimeoutError, match=f"pid {starting.proc.pid}"):
            other.lock(lock, owner="vllm-instance:B", timeout_s=0.3)
        # An engine on the device exits while the other is profiling: its segment must stay.
        seg = HostSegment.create(torch.zeros(MB, dtype=torch.uint8), GPU0)
        leaving.publish(seg.fileno(), seg.nbytes, [("k", 0, seg.nbytes)])
        seg.close_fd()
        del seg
        leaving.close()
        time.sleep(0.2)
        stats = registry_stats(broker.path)
        (group,) = stats["groups"]
        assert (group["segments"], group["deferred_segments"], group["engines"]) == (1, 1, 2)
        human = format_status(stats)
        assert f"lock {lock} held by pid {starting.proc.pid}" in human
        assert "1 unheld segment(s) kept until a start-up on their device ends" in human
        assert starting.end() == 0  # start-up done: lock back, the deferred segment goes
        other.lock(lock, owner="vllm-instance:B", timeout_s=10)
        (group,) = registry_stats(broker.path)["groups"]
        assert (group["segments"], group["engines"]) == (0, 1)
        assert registry_stats(broker.path)["locks"] == {lock: os.getpid()}


def test_tp_ranks_share_their_instance_lock_and_take_every_gpu_at_once(broker):  # noqa: F811
    names = ",".join(sorted([startup_lock_name(GPU0), startup_lock_name(GPU1)]))
    rank0 = Peer(broker.path, "lock", names, "vllm-instance:A", GPU0)
    rank1 = Peer(broker.path, "lock", names, "vllm-instance:A", GPU1)
    assert rank0.result()["locked"] == names and rank1.result()["locked"] == names  # no waiting on each other
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
    """The order `accounting.begin_startup` relies on (lock taken before the snapshot)."""
    from vllm.v1.worker.gpu_worker import Worker

    source = inspect.getsource(Worker.init_device)
    assert 0 < source.index("get_external_weight_memory") < source.index("MemorySnapshot(")
    assert source.index("request_memory(") > source.index("MemorySnapshot(")
    assert "self.requested_memory" in inspect.getsource(Worker.determine_available_memory)
    assert "initialize_kv_cache" in inspect.getsource(Worker.initialize_from_config)


def test_external_bytes_shrink_vllms_budget_by_exactly_that_much():
    """vLLM's own `request_memory`: with E external bytes the engine's budget is B - E, and it
    starts in free memory where a plain engine (budget B) would not."""
    from types import SimpleNamespace

    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    gib = 1 << 30
    snapshot = MemorySnapshot(total_memory=80 * gib, free_memory=30 * gib, device="cpu", auto_measure=False)
    cache = SimpleNamespace(gpu_memory_utilization=0.45)
    budget = -(-80 * gib * 45 // 100)
    with pytest.raises(ValueError):
        request_memory(snapshot, cache, 0)  # 36 GiB wanted, 30 free
    assert request_memory(snapshot, cache, 12 * gib) == budget - 12 * gib


def test_external_mode_budget_ends_at_plain_minus_the_bytes_really_mapped():
    """vLLM budgets ``B - predicted`` at start-up (its own `request_memory`); after loading, the
    correction makes it ``B - shared``, whatever the prediction was."""
    from types import SimpleNamespace

    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    gib = 1 << 30
    snapshot = MemorySnapshot(total_memory=80 * gib, free_memory=80 * gib, device="cpu", auto_measure=False)
    cache = SimpleNamespace(gpu_memory_utilization=0.5)
    plain = request_memory(snapshot, cache, 0)
    try:
        for predicted, shared in ((10 * gib, 12 * gib), (10 * gib, 7 * gib), (0, 5 * gib), (3 * gib, 3 * gib)):
            accounting._session["predicted"] = predicted
            model = SimpleNamespace(external_weight_correction_bytes=accounting.correction(shared))
            worker = SimpleNamespace(requested_memory=request_memory(snapshot, cache, predicted),
                                     model_runner=SimpleNamespace(get_model=lambda m=model: m))
            assert accounting.correct_budget(worker) == shared - predicted
            assert worker.requested_memory == plain - shared
        accounting._session.clear()  # accounting="kv_cache": no prediction, no correction
        assert accounting.correction(5 * gib) == 0
    finally:
        accounting._session.clear()


def test_the_hook_gives_the_startup_lock_back_even_when_warm_up_fails(broker):  # noqa: F811
    from vllm.v1.worker.gpu_worker import Worker

    accounting.install()
    for name in ("load_model", "compile_or_warm_up_model"):
        assert getattr(Worker.__dict__[name], "__vllm_dedup_startup__", False), name
    client = BrokerClient(broker.path)
    client.hello("m", GPU0, "default")
    client.lock([startup_lock_name(GPU0)], owner="vllm-instance:X")
    accounting._session.update(client=client, device=GPU0, signature="s", locks=[startup_lock_name(GPU0)])
    try:
        with pytest.raises(AttributeError):  # not a real worker: the warm-up itself fails
            Worker.compile_or_warm_up_model(object())
        assert registry_stats(broker.path)["locks"] == {}
        accounting.end_startup()  # idempotent
    finally:
        accounting._session.clear()
        client.close()


def test_accounting_option_is_checked():
    assert DedupConfig.from_extra_config({"accounting": "external"}).accounting == "external"
    with pytest.raises(ValueError, match="accounting must be 'kv_cache' or 'external'"):
        DedupConfig.from_extra_config({"accounting": "kv"})
    with pytest.raises(ValueError, match="startup_lock_timeout_s"):
        DedupConfig.from_extra_config({"startup_lock_timeout_s": 0})
