"""Where no thread can be started (a pids limit: ``RuntimeError: can't start new thread``), the
engine's background threads are given up, not the engine: the load meter samples at its ends
only, and the lease does not watch for a registry that restarts.  (The sharing pass's and the
staging copy's own fallbacks are tested beside them: `test_in_place.py`, `test_staging.py`.)"""

from __future__ import annotations

import logging
import threading
import time

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
