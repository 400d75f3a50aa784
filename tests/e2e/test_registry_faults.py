"""The registry failing under real vLLM engines (CPU backend, one process each), with the real
standalone daemon:

- killed (SIGKILL) while one engine is in the middle of publishing under the publish lock and
  another is starting: the first reclaims its lock from the registry that replaces it, the
  second maps what the first publishes: one resident copy, not two;
- hung (SIGSTOP): an engine starting meanwhile waits ``registry_timeout_s`` once and loads
  privately; the engine already running goes on answering.

Every engine's final tensors are checked against a reference load (`harness.references`).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from harness.engines import EngineProcess
from harness.oracle import differences
from harness.references import engine_reference
from helpers import wait_for
from vllm_dedup.config import DedupConfig
from vllm_dedup.errors import RegistryUnavailable
from vllm_dedup.registry.lease import STOP_AFTER_PUBLISHES_ENV

STOP_AFTER = 40  # publishes (of about 120 segments of SmolLM2) before the first engine stops itself


@pytest.fixture(scope="module")
def reference(smollm2) -> dict:
    return engine_reference(smollm2)


def state(pid: int) -> str:
    """The process's state letter (``T``: stopped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def stats_or_none(registry):
    try:
        return registry.stats()
    except RegistryUnavailable:
        return None


def check_exact(engine: EngineProcess, reference: dict) -> None:
    (tensors,) = engine.final_tensors()
    assert differences(tensors, reference["tensors"][0]) == []
    assert engine.generate() == reference["ids"]


def test_two_engines_starting_across_a_registry_kill_keep_one_copy(smollm2, registry, reference):
    # A stops itself (SIGSTOP) right after its 40th publish, holding the publish lock.
    a = EngineProcess(smollm2, "dedup", env={STOP_AFTER_PUBLISHES_ENV: str(STOP_AFTER)}, core=0)
    b = None
    try:
        assert wait_for(lambda: state(a.pid) == "T", 300), a.log()[-3000:]
        old = registry.stats()
        assert old.locks == {"publish:cpu:default": a.pid} and old.groups[0].segments == STOP_AFTER
        b = EngineProcess(smollm2, "dedup", core=1)
        assert wait_for(lambda: old_engines(registry) >= {a.pid, b.pid}, 300), b.log()[-3000:]  # b connected
        os.kill(old.registry_pid, signal.SIGKILL)
        # b, at its next call, finds the registry gone, starts it again and re-registers; the new
        # registry refuses it the lock while engines may still reclaim theirs.
        assert wait_for(lambda: (s := stats_or_none(registry)) is not None and s.registry_pid != old.registry_pid
                        and [e.pid for e in s.engines] == [b.pid], 300), b.log()[-3000:]
        assert registry.stats().locks == {}
        os.kill(a.pid, signal.SIGCONT)  # a re-registers its 40 segments, reclaims the lock, goes on
        a.wait_ready(300)
        b.wait_ready(300)
        stats = registry.stats()
        loads = {e.pid: e.load for e in stats.engines}
        la, lb = loads[a.pid], loads[b.pid]
        assert (la["reregistered"], lb["reregistered"]) == (1, 1)
        # a maps at most its tied head's packed copy from itself (cpu_linear="packed")
        assert la["shared_bytes"] <= 49152 * 576 * 2 and la["published_tensors"] > STOP_AFTER
        assert (lb["published_bytes"], lb["shared_bytes"]) == (0, la["published_bytes"] + la["shared_bytes"])
        assert la["private_bytes"] == lb["private_bytes"]  # the same small tensors, nothing more
        (group,) = stats.groups
        assert (group.segments, group.resident_bytes) == (la["published_tensors"], la["published_bytes"])  # one copy
        check_exact(a, reference)
        check_exact(b, reference)
    finally:
        if a.proc.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
        for engine in (a, b):
            if engine is not None:
                engine.stop()


def old_engines(registry) -> set[int]:
    stats = stats_or_none(registry)
    return {e.pid for e in stats.engines} if stats else set()


def test_a_hung_registry_never_hangs_start_up(smollm2, registry, reference):
    timeout_s = DedupConfig().registry_timeout_s  # the default README states
    a = EngineProcess(smollm2, "dedup", core=0).wait_ready(300)
    b = None
    registry_pid = registry.stats().registry_pid
    before = registry.stats().groups[0]
    os.kill(registry_pid, signal.SIGSTOP)
    try:
        b = EngineProcess(smollm2, "dedup", core=1)
        check_exact(a, reference)  # the running engine goes on meanwhile
        b.wait_ready(300)
        load = b.load_stats()
        assert timeout_s <= load["seconds"] < timeout_s + 30, load  # one bounded wait, then a private load
        assert f"did not answer within {timeout_s:g} s" in b.log()
        assert "loading without sharing" in b.log()
        check_exact(b, reference)
        check_exact(a, reference)
    finally:
        os.kill(registry_pid, signal.SIGCONT)
    try:
        stats = registry.stats()
        assert [e.pid for e in stats.engines] == [a.pid]  # b never registered
        (group,) = stats.groups
        assert (group.segments, group.resident_bytes) == (before.segments, before.resident_bytes)
        check_exact(b, reference)
    finally:
        for engine in (a, b):
            if engine is not None:
                engine.stop()


# Made to fail in the engine's own process: the source recorder (vllm-dedup's code around vLLM's
# load_weights) raises halfway through the checkpoint, as a bug in it would.
_BROKEN_RECORDER = '''
import wrapt


def _break(module):
    iterate = module.SourceRecorder.iterate

    def failing(self, weights):
        for i, item in enumerate(iterate(self, weights)):
            if i == 20:
                raise RuntimeError("a bug in the recording (a test)")
            yield item

    module.SourceRecorder.iterate = failing


wrapt.register_post_import_hook(_break, "vllm_dedup.engine.sources")
'''


def test_a_load_that_fails_inside_vllm_dedup_loads_again_privately_and_serves(smollm2, registry, plain_smollm2,
                                                                               same_tensors, tmp_path, monkeypatch):
    """A failure of vllm-dedup's own code inside a load never stops an engine that can load
    privately: the model given up, its layers forgotten by vLLM (which refuses a name twice),
    the engine loads again without sharing and holds exactly a plain load's tensors."""
    (tmp_path / "sitecustomize.py").write_text(_BROKEN_RECORDER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    with EngineProcess(smollm2, core=0) as engine:
        engine.wait_ready()
        log = engine.log()
        assert "a bug in the recording (a test)" in log and "loading again without sharing" in log, log[-3000:]
        same_tensors(engine, smollm2)
        assert engine.generate() == plain_smollm2
        assert engine.pid not in registry.engine_loads()  # nothing of it is in segments
