"""Where no thread can be started (a pids limit: ``RuntimeError: can't start new thread``), the
engine's background threads are given up, not the engine: the load meter samples at its ends
only, the lease does not watch for a registry that restarts, content keys are computed in the
caller's thread, and a recorded load's tensors that no thread hashes have no key.  (The sharing
pass's and the staging copy's own fallbacks are tested beside them: `test_in_place.py`,
`test_staging.py`.)"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from vllm_dedup.engine.meter import LoadMeter
from vllm_dedup.registry.client import RegistryClient, registry_stats
from vllm_dedup.registry.lease import Lease


def no_thread_named(monkeypatch, prefix: str) -> list[str]:
    """Make every thread whose name starts with ``prefix`` fail to start, as the kernel's pids
    limit makes it fail; returns the names refused."""
    start, refused = threading.Thread.start, []

    def refuse(self):
        if self.name.startswith(prefix):
            refused.append(self.name)
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    return refused


def test_the_load_meter_without_its_thread_measures_the_ends(monkeypatch):
    refused = no_thread_named(monkeypatch, "vllm-dedup-meter")
    held = [0]
    with LoadMeter("cpu", live=lambda: held[0]) as meter:
        time.sleep(0.01)
        held[0] = 5 << 20  # still live at the end: the end's sample sees it
    assert refused == ["vllm-dedup-meter"]
    assert meter.seconds >= 0.01 and meter.peak_bytes >= 5 << 20


def test_a_lease_without_a_watcher_thread_says_so_and_keeps_serving(registry_server, monkeypatch, caplog):
    refused = no_thread_named(monkeypatch, "vllm-dedup-lease")
    lease = Lease(RegistryClient(registry_server.path, timeout_s=10), "m", "cpu", "default", "sig", timeout_s=10)
    try:
        lease.report({"load_path": "none"})
        with caplog.at_level(logging.WARNING, logger="vllm_dedup"):
            lease.watch()
        assert refused == ["vllm-dedup-lease"]
        assert "will not re-register" in caplog.text
        lease.report({"load_path": "full"})  # the lease goes on
        (engine,) = registry_stats(registry_server.path).engines
        assert engine.load["load_path"] == "full"
    finally:
        lease.close()


def test_content_keys_without_threads_are_computed_in_the_callers():
    import torch

    from vllm_dedup.content.keys import content_key, content_keys
    from vllm_dedup.content.views import tensor_bytes

    tensors = [torch.full((1024,), float(i)) for i in range(4)]
    loaders = [lambda t=t: content_key(tensor_bytes(t), "float32", tuple(t.shape), tuple(t.stride()))
               for t in tensors]
    want = [fn() for fn in loaders]
    with pytest.MonkeyPatch.context() as patch:
        refused = no_thread_named(patch, "vllm-dedup-key")
        assert content_keys(loaders, threads=2) == want
    assert refused


def test_a_recorded_load_without_hashing_threads_goes_on_and_leaves_no_keys(monkeypatch):
    import torch

    from test_engine import Tiny, checkpoint, recorded_load

    refused = no_thread_named(monkeypatch, "vllm-dedup-source")
    model = Tiny()
    recorder = recorded_load(model, checkpoint(), copy_decoder=False)
    assert refused and recorder.keys == {} and set(recorder.unhashable) >= {"embed", "q", "k"}
    assert torch.equal(model.embed.weight, checkpoint()["embed"])
