"""The registry dies and comes back: engines re-register what they hold, once per segment, and a
newcomer maps it again.  Real processes (lease peers), the real standalone daemon, SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.procs import PeerProcess, memfd_holders, processes_matching
from helpers import PEERS, run_cli, wait_for
from vllm_dedup.errors import RegistryUnavailable
from vllm_dedup.registry.client import RegistryClient, registry_answers, registry_stats, shutdown_registry
from vllm_dedup.config import DedupConfig
from vllm_dedup.engine.session import EngineSession
from vllm_dedup.registry.daemon import RECLAIM_GRACE_ENV, launch_daemon, start_daemon
from vllm_dedup.registry.lease import Lease
from vllm_dedup.registry.wire import ensure_private_dir
from vllm_dedup.segments.host import RECIPE_MEMFD_NAME

PEER = PEERS / "lease_peer.py"
MB = 1 << 20


def lease_peer(sock: Path, *args: str, restart: bool = True) -> PeerProcess:
    """A lease peer (`tests/peers/lease_peer.py`); ``restart=False``: it starts no daemon."""
    return PeerProcess([PEER, sock, *args], f"lease peer {' '.join(args)}",
                       env=None if restart else {"LEASE_PEER_RESTART": "none"})


def stats_or_none(sock: Path):
    try:
        return registry_stats(sock)
    except RegistryUnavailable:
        return None


def recipes(sock: Path) -> list[bytes]:
    with RegistryClient(sock) as client:
        client.hello("probe", "cpu", "default", "sig")
        return client.get_recipes("sig")


def test_engines_re_register_what_they_hold_with_a_registry_that_comes_back(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(run))
    sock = run / "vllm-dedup.sock"
    start_daemon(sock)
    peers = []
    try:
        a = lease_peer(sock, "publish", "k", str(8 * MB))
        peers.append(a)
        digest = a.read_json()["digest"]
        b = lease_peer(sock, "map", "k")
        peers.append(b)
        assert b.read_json()["digest"] == digest
        for restart in (1, 2):
            old = registry_stats(sock)
            assert (len(old.engines), old.groups[0].segments) == (2, 1)
            os.kill(old.registry_pid, signal.SIGKILL)  # no clean-up of any kind in the registry
            # The peers notice, the first to reconnect starts a daemon again, both re-register.
            assert wait_for(lambda: (s := stats_or_none(sock)) is not None and s.registry_pid != old.registry_pid
                            and len(s.engines) == 2 and all(e.load.get("reregistered") == restart for e in s.engines),
                            timeout_s=30), stats_or_none(sock)
            new = registry_stats(sock)
            (group,) = new.groups
            assert (group.segments, group.engines, group.resident_bytes) == (1, 2, 8 * MB)  # stored once
            assert sorted(e.pid for e in new.engines) == sorted([a.pid, b.pid])
            assert recipes(sock)  # the recipe came back with its engine
            # `vllm-dedup status` shows them re-registered, `restart` times each.
            table = run_cli("status", check=True).stdout.splitlines()
            for peer, model in ((a, "peer-publish"), (b, "peer-map")):
                row = next(line.split() for line in table if line.lstrip().startswith(f"{peer.pid} "))
                assert row[-2:] == [str(restart), model], row
            for peer in (a, b):
                peer.send("digest")
                assert peer.read_json() == {"digest": digest, "reregistrations": restart}
            with lease_peer(sock, "map", "k") as newcomer:  # a later engine maps again
                assert newcomer.read_json()["digest"] == digest
        assert a.end() == 0
        assert wait_for(lambda: len(registry_stats(sock).engines) == 1)
        assert registry_stats(sock).groups[0].segments == 1  # b still holds it
    finally:
        for peer in peers:
            peer.end()
        shutdown_registry(sock)
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 15)
    assert memfd_holders() == [] and memfd_holders(RECIPE_MEMFD_NAME) == []


def test_engines_re_register_with_a_ray_registry_actor_brought_back_by_the_next_engine(registry, ray_address):
    """The Ray form: a SIGKILLed registry actor is not restarted by Ray (``max_restarts=0``) nor by
    the engines holding leases; the next engine's `connect_registry` (or the Serve helper) creates
    it again on the same node's socket, and every live engine re-registers with it."""
    from vllm_dedup.registry.daemon import is_daemon
    from vllm_dedup.registry.ray_actor import ensure_actor

    def bring_back() -> Path | None:  # what the next engine does when it finds no registry
        try:
            return Path(ensure_actor("vllm-dedup", address=ray_address))
        except RegistryUnavailable:  # the old actor not yet marked dead by Ray
            return None

    def engines_own(signum, frame):  # vLLM's shutdown handler, in an engine's main thread
        pass

    before = signal.signal(signal.SIGTERM, engines_own)
    try:
        sock = bring_back()
        # ray.init set SIGTERM to sys.exit, and ray.shutdown left it so: the handler is put back
        assert signal.getsignal(signal.SIGTERM) is engines_own
    finally:
        signal.signal(signal.SIGTERM, before)
    assert sock == registry.socket
    a = lease_peer(sock, "publish", "k", str(8 * MB), restart=False)
    b = None
    try:
        digest = a.read_json()["digest"]
        b = lease_peer(sock, "map", "k", restart=False)
        assert b.read_json()["digest"] == digest
        old = registry_stats(sock)
        assert not is_daemon(old.registry_pid) and len(old.engines) == 2
        os.kill(old.registry_pid, signal.SIGKILL)
        assert wait_for(lambda: stats_or_none(sock) is None, 15)
        time.sleep(2)
        assert stats_or_none(sock) is None  # nobody brought it back on their own
        assert not registry.daemon_pids()
        assert wait_for(lambda: bring_back() == sock, 60)
        assert wait_for(lambda: (s := stats_or_none(sock)) is not None and len(s.engines) == 2
                        and all(e.load.get("reregistered") == 1 for e in s.engines), 30), stats_or_none(sock)
        new = registry_stats(sock)
        assert new.registry_pid != old.registry_pid and not is_daemon(new.registry_pid)
        assert (new.groups[0].segments, new.groups[0].resident_bytes) == (1, 8 * MB)  # stored once
        with lease_peer(sock, "map", "k", restart=False) as newcomer:  # a later engine maps again
            assert newcomer.read_json()["digest"] == digest
    finally:
        for peer in (a, b):
            if peer is not None:
                peer.end()


@pytest.mark.heavy
def test_a_lock_held_when_the_registry_dies_is_reclaimed_and_the_newcomer_maps(tmp_path, monkeypatch):
    """Two engines starting across a registry kill: A holds the publish lock and has published
    half its tensors, B waits for the lock; the registry is SIGKILLed, B starts it again first.
    The new registry lets A reclaim its lock (B is refused meanwhile), A publishes the rest, B
    maps everything: one copy, not two."""
    run = tmp_path / "run"
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(run))
    # The daemon b starts inherits this: 4 s rather than 10 to reclaim (a needs well under 1 s).
    monkeypatch.setenv("VLLM_DEDUP_RECLAIM_GRACE_S", "4")
    sock = run / "vllm-dedup.sock"
    start_daemon(sock)
    a = lease_peer(sock, "publish-locked", "k1,k2", str(4 * MB))
    b = None
    try:
        assert a.read_json() == {"published": ["k1"]}
        b = lease_peer(sock, "share", "k1,k2", str(4 * MB))
        b.read("LOCKING")
        time.sleep(0.5)  # b polls the lock a holds
        old = registry_stats(sock)
        assert old.locks == {"publish:cpu:default": a.pid}
        os.kill(old.registry_pid, signal.SIGKILL)
        # b notices at its next poll, starts a registry again and re-registers (it holds nothing).
        assert wait_for(lambda: (s := stats_or_none(sock)) is not None and s.registry_pid != old.registry_pid
                        and [e.pid for e in s.engines] == [b.pid], 30), stats_or_none(sock)
        time.sleep(0.5)
        assert registry_stats(sock).locks == {}  # free, yet b still waits: the reclaim period
        a.send("go")  # a's next publish finds the registry gone: it re-registers k1, reclaims the lock
        got_a, got_b = a.read_json(timeout_s=30), b.read_json(timeout_s=30)
        assert got_a["reregistrations"] == 1 and got_b["reregistrations"] == 1
        assert (got_b["mapped"], got_b["published"]) == (["k1", "k2"], [])
        assert got_b["digests"] == got_a["digests"]
        (group,) = registry_stats(sock).groups
        assert (group.segments, group.resident_bytes) == (2, 8 * MB)  # one copy
    finally:
        for peer in (a, b):
            if peer is not None:
                peer.end()
        shutdown_registry(sock)
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 15)
    assert memfd_holders() == []


def test_a_lock_not_reclaimed_in_time_is_lost_and_what_it_protects_stays_private(tmp_path, monkeypatch):
    """A holds the publish lock and is stopped (SIGSTOP) past the new registry's reclaim period;
    B takes the lock meanwhile and publishes.  When A wakes, its reclaim is refused: its next
    publish fails instead of publishing a second copy."""
    from vllm_dedup.registry.server import RegistryServer
    from vllm_dedup.registry.state import Registry

    run = tmp_path / "run"
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(run))
    sock = run / "vllm-dedup.sock"
    start_daemon(sock)
    a = lease_peer(sock, "publish-locked", "k1,k2", str(4 * MB), restart=False)
    b = server = None
    try:
        assert a.read_json() == {"published": ["k1"]}
        os.kill(a.pid, signal.SIGSTOP)
        os.kill(registry_stats(sock).registry_pid, signal.SIGKILL)
        assert wait_for(lambda: stats_or_none(sock) is None, 15)
        server = RegistryServer(Registry(), sock, reclaim_grace_s=1.0).start()  # finds the dead one's socket
        begin = time.monotonic()
        b = lease_peer(sock, "share", "k1,k2", str(4 * MB), "hold", restart=False)
        b.read("HOLDING", timeout_s=30)
        assert time.monotonic() - begin >= 1.0  # refused during the reclaim period
        os.kill(a.pid, signal.SIGCONT)
        a.send("go")
        assert a.read("ERR ", timeout_s=30).startswith("registry lock(s) publish:cpu:default were lost")
        b.send("go")
        got_b = b.read_json(timeout_s=30)
        assert (got_b["mapped"], got_b["published"]) == ([], ["k1", "k2"])  # a's k1 was not back yet
        stats = server.stats()
        assert sorted(e.pid for e in stats.engines) == sorted([a.pid, b.pid])  # a re-registered what it holds
        keys = sorted(k for seg in server.registry.segments.values() for k, _, _ in seg.keys)
        assert keys == ["k1", "k1", "k2"]  # k2 once: a published nothing without its lock
    finally:
        if a.proc.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
        for peer in (a, b):
            if peer is not None:
                peer.end()
        if server is not None:
            server.stop()
    assert memfd_holders() == []


def test_a_hung_registry_costs_one_timeout_and_the_connection_is_not_reused(tmp_path, monkeypatch):
    """A SIGSTOPped registry accepts connections but never answers: a call waits its timeout once,
    fails with RegistryTimeout, and every later call on that connection fails at once (a late
    reply must never answer a later request).  Once it runs again, a new connection works."""
    from vllm_dedup.errors import RegistryTimeout

    run = tmp_path / "run"
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(run))
    sock = run / "vllm-dedup.sock"
    start_daemon(sock)
    pid = registry_stats(sock).registry_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        # SIGSTOP is a group stop each thread enters on its own way back to user space: on a
        # busy machine a thread may not be stopped yet when the signal call returns.
        assert wait_for(lambda: _all_threads_stopped(pid), 10), f"registry {pid} did not stop"
        client = RegistryClient(sock, timeout_s=1.0)  # connecting works: the kernel accepts for it
        begin = time.monotonic()
        try:
            client.stats()
            raise AssertionError("a stopped registry answered")
        except RegistryTimeout:
            pass
        assert 1.0 <= time.monotonic() - begin < 5
        begin = time.monotonic()
        for call in (client.stats, lambda: client.hello("x", "cpu", "default")):
            try:
                call()
                raise AssertionError("a timed-out connection was used again")
            except RegistryTimeout:
                pass
        assert time.monotonic() - begin < 2 and not client.hung_up()  # no call waited out the 1 s timeout
        client.close()
        os.kill(pid, signal.SIGCONT)
        assert registry_stats(sock).registry_pid == pid  # it answers again
    finally:
        # Whatever failed above, this daemon must not outlive the test: later tests in this
        # worker check that no process but theirs holds a segment.
        os.kill(pid, signal.SIGCONT)
        shutdown_registry(sock)
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 15)


def test_a_registry_killed_between_the_round_trips_of_an_acquire_is_recovered_from(tmp_path, monkeypatch):
    """An acquire of more keys than one message carries (`wire.MAX_FDS`) takes several round
    trips (the sharing pass and a replay ask for every key at once).  The registry SIGKILLed
    between two is a hang-up like any other: the lease re-registers with the next registry (a
    daemon started again) and acquires there, rather than failing every later call of the load;
    and its new connection keeps the lease's reply timeout, not what was left of the window."""
    from vllm_dedup.registry import messages as m
    from vllm_dedup.registry import wire

    run = tmp_path / "run"
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(run))
    sock = run / "vllm-dedup.sock"
    start_daemon(sock)
    first = registry_stats(sock).registry_pid
    client = RegistryClient(sock, timeout_s=10)
    lease = Lease(client, "m", "cpu", "default", "sig", start_daemon, timeout_s=10)
    acquires = []
    original = client._call

    def killed_before_the_second(request, *args, **kwargs):
        if isinstance(request, m.Acquire):
            acquires.append(request)
            if len(acquires) == 2:
                os.kill(first, signal.SIGKILL)
                assert wait_for(lambda: not os.path.exists(f"/proc/{first}") or
                                open(f"/proc/{first}/stat").read().split(") ")[1].startswith("Z"), 10)
        return original(request, *args, **kwargs)

    monkeypatch.setattr(client, "_call", killed_before_the_second)
    try:
        keys = [f"k{i}" for i in range(wire.MAX_FDS + 50)]  # two round trips
        assert lease.acquire(keys) == []  # nothing published: no hits, and no error
        assert len(acquires) == 2 and lease.reregistrations == 1
        stats = registry_stats(sock)
        assert stats.registry_pid != first and [e.pid for e in stats.engines] == [os.getpid()]
        assert lease.expected_shared_bytes() == 0  # later calls of the load work
        assert lease._client.timeout_s == 10
    finally:
        lease.close()
        shutdown_registry(sock)
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 15)


def test_a_load_report_with_a_long_string_is_cut_and_re_registers(tmp_path, monkeypatch):
    """An engine's report may hold an exception's text (why packed weights stay private); the
    registry refuses a string over `messages.MAX_STRING`.  The lease sends it cut, and sends
    the same again when it re-registers: kept as given, it failed every re-registration."""
    from vllm_dedup.registry.messages import MAX_STRING

    run = tmp_path / "run"
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(run))
    sock = run / "vllm-dedup.sock"
    start_daemon(sock)
    lease = Lease(RegistryClient(sock, timeout_s=10), "m", "cpu", "default", "sig", start_daemon, timeout_s=10)
    try:
        lease.report({"private_linears": "x" * (MAX_STRING + 100), "huge": 1 << 70, "load_path": "none"})
        lease.watch()
        old = registry_stats(sock)
        os.kill(old.registry_pid, signal.SIGKILL)
        assert wait_for(lambda: (s := stats_or_none(sock)) is not None and s.registry_pid != old.registry_pid
                        and [e.load.get("reregistered") for e in s.engines] == [1], timeout_s=30), stats_or_none(sock)
        (engine,) = registry_stats(sock).engines
        assert engine.load["private_linears"] == "x" * MAX_STRING and "huge" not in engine.load
        assert engine.load["load_path"] == "none"
    finally:
        lease.close()
        shutdown_registry(sock)
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 15)


def test_a_kept_recipe_the_new_registry_refuses_is_dropped_and_the_rest_re_registers(tmp_path, monkeypatch):
    """A recipe kept from a registry of another version (whose limits it met) may be refused by
    the one that comes back: dropped, with a warning, instead of failing every re-registration
    (segments, locks and the other recipes with it)."""
    run = tmp_path / "run"
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(run))
    sock = run / "vllm-dedup.sock"
    start_daemon(sock)
    lease = Lease(RegistryClient(sock, timeout_s=10), "m", "cpu", "default", "sig", start_daemon, timeout_s=10)
    good = b'{"signature": "sig", "id": "r1", "final": {}}'
    try:
        lease.report({"load_path": "none"})
        lease.put_recipe(good)
        lease.keep_recipe(b'{"signature": "' + b"s" * 5000 + b'", "id": "r0", "final": {}}')
        lease.watch()
        old = registry_stats(sock)
        os.kill(old.registry_pid, signal.SIGKILL)
        assert wait_for(lambda: (s := stats_or_none(sock)) is not None and s.registry_pid != old.registry_pid
                        and [e.load.get("reregistered") for e in s.engines] == [1], timeout_s=30), stats_or_none(sock)
        assert recipes(sock) == [good]
    finally:
        lease.close()
        shutdown_registry(sock)
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 15)


def test_a_daemon_slower_to_start_than_asked_is_a_registry_unavailable_not_a_crash(tmp_path):
    """On a busy machine the daemon's launcher can take longer than the caller waits: that is
    `RegistryUnavailable` (an engine's lease retries on it), never ``subprocess.TimeoutExpired``
    (which ended a lease's watcher thread during the chaos soak, after a registry kill)."""
    sock = tmp_path / "run" / "vllm-dedup.sock"
    with pytest.raises(RegistryUnavailable, match="did not start"):
        start_daemon(sock, idle_exit_s=2.0, timeout_s=0.001)
    # The launcher goes on, and its daemon answers, then goes: nothing is left behind.
    assert wait_for(lambda: registry_answers(sock), 30)
    shutdown_registry(sock)
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 30)


# --- a lease on a registry still starting (Note [a lease on a registry still starting]) ----------
def test_a_lease_given_a_daemon_launch_says_hello_on_its_first_call(tmp_path):
    sock = tmp_path / "run" / "vllm-dedup.sock"
    lease = Lease(launch_daemon(sock, idle_exit_s=5.0), "model-a", "cpu", "default", "sig", timeout_s=10)
    try:
        assert lease.launching and lease.engine_id is None
        assert wait_for(lambda: registry_answers(sock), 30)
        assert registry_stats(sock).engines == []  # the daemon serves; the lease has not said hello
        assert lease.get_recipes("sig") == []
        assert not lease.launching and lease.engine_id is not None
        (engine,) = registry_stats(sock).engines
        assert (engine.pid, engine.model) == (os.getpid(), "model-a")
        lease.report({"load_path": "none"})  # the same connection serves every later call
        assert [e.load for e in registry_stats(sock).engines] == [{"load_path": "none"}]
        assert lease.reregistrations == 0
    finally:
        lease.close()
        shutdown_registry(sock)
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 30)


def test_a_daemon_that_cannot_start_fails_the_leases_first_call_at_once_with_its_words(tmp_path, monkeypatch):
    """The daemon refuses its environment: the launcher's exit status says so, and the lease's
    first call fails with the daemon's message instead of waiting out its timeout; the calls
    after it fail at once too (Note [a launcher that returns when ready])."""
    monkeypatch.setenv(RECLAIM_GRACE_ENV, "soon")
    sock = tmp_path / "run" / "vllm-dedup.sock"
    lease = Lease(launch_daemon(sock), "model-a", "cpu", "default", "sig", timeout_s=10)
    try:
        start = time.monotonic()
        with pytest.raises(RegistryUnavailable, match="(?s)did not start.*'soon' is not a number of seconds"):
            lease.get_recipes("sig")
        assert time.monotonic() - start < 10  # the daemon's 30 s wait was not waited out
        assert not lease.launching
        start = time.monotonic()
        with pytest.raises(RegistryUnavailable):
            lease.report({"load_path": "none"})
        assert time.monotonic() - start < 2
        lease.watch()  # holds nothing: no watcher starting the daemon again and again
        assert lease._watcher is None
    finally:
        lease.close()
    assert not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode())


def test_a_daemon_waits_for_the_engine_that_started_it_however_long_its_load(tmp_path):
    """Note [the engine a daemon waits for]: the engine that starts the daemon says hello when
    its load first needs the registry, which may be long after the daemon's idle period.  The
    daemon stays until then; once that engine has said hello and gone, or has exited without
    a word, it is idle as before.  A lease closed before its first call leaves no descriptor."""
    sock = tmp_path / "run" / "vllm-dedup.sock"
    launch = launch_daemon(sock, idle_exit_s=0.5, awaited_pid=os.getpid())
    lease = Lease(launch, "model-a", "cpu", "default", "sig", timeout_s=10)
    try:
        assert wait_for(lambda: registry_answers(sock), 30)
        time.sleep(3)  # six idle periods, with nothing connected: this engine is still "loading"
        assert registry_answers(sock)
        assert lease.get_recipes("sig") == []
    finally:
        lease.close()
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 15)

    other = tmp_path / "run-2" / "vllm-dedup.sock"
    loading = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        launch = launch_daemon(other, idle_exit_s=0.5, awaited_pid=loading.pid)
        Lease(launch, "model-b", "cpu", "default", "sig", timeout_s=10).close()  # before its first call
        assert launch._err.closed
        assert wait_for(lambda: registry_answers(other), 30)
        time.sleep(3)
        assert registry_answers(other)
    finally:
        loading.kill()  # not reaped yet: a zombie has exited too
        gone = wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(other).encode()), 15)
        loading.wait()
    assert gone


def test_a_daemon_that_gave_way_to_one_since_gone_is_launched_again(tmp_path):
    """Note [one daemon per socket]: the lock is held by a daemon exiting (idle) as another
    engine launches one: that one gives way (exit 0) and nothing answers; the launch starts
    the daemon again, which serves.  Several launches at once leave one daemon serving."""
    import fcntl

    sock = tmp_path / "run" / "vllm-dedup.sock"
    ensure_private_dir(sock.parent)
    exiting = open(f"{sock}.lock", "w")
    fcntl.flock(exiting, fcntl.LOCK_EX)  # its lock held, its socket closed
    try:
        launch = launch_daemon(sock, idle_exit_s=60)  # this test stops the daemons itself
        assert launch._launcher.wait(30) == 0  # its daemon gave way
        assert not registry_answers(sock)
    finally:
        Path(f"{sock}.lock").unlink()  # as a daemon exiting does, before its lock goes
        exiting.close()
    launch.wait(30)
    assert registry_answers(sock)
    shutdown_registry(sock)
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 15)

    launches = [launch_daemon(sock, idle_exit_s=60) for _ in range(3)]
    for launch in launches:
        launch.wait(30)
    assert len(processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode())) == 1
    shutdown_registry(sock)
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 15)


@pytest.mark.parametrize("on_error", ["fallback", "fail"])
def test_an_engine_that_starts_the_daemon_waits_for_it_only_when_failures_stop_it(tmp_path, monkeypatch, on_error):
    """`EngineSession.connect`: the lease of the engine that starts the daemon connects on first
    use; under ``on_registry_error="fail"`` it has connected already, and a daemon that cannot
    start stops the engine there, before it loads anything."""
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "no-ray"))
    config = DedupConfig(on_registry_error=on_error, registry_address="local")
    lease = EngineSession().connect(config, "model-a", "cpu", "sig")
    try:
        assert lease.launching == (on_error == "fallback")
        assert lease.get_recipes("sig") == [] and not lease.launching
    finally:
        lease.close()
        shutdown_registry(lease.path)
    monkeypatch.setenv(RECLAIM_GRACE_ENV, "soon")
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(tmp_path / "run-2"))
    if on_error == "fail":
        with pytest.raises(RegistryUnavailable, match="(?s)cannot reach the weight registry.*'soon' is not a number"):
            EngineSession().connect(config, "model-a", "cpu", "sig")
    else:
        lease = EngineSession().connect(config, "model-a", "cpu", "sig")
        with pytest.raises(RegistryUnavailable, match="'soon' is not a number"):
            lease.get_recipes("sig")
        lease.close()


def test_an_engine_connects_to_a_registry_whose_stats_are_too_big_to_send(tmp_path, monkeypatch):
    """Every engine's locks, hello strings and report go into each `stats` reply, which has a
    size limit (`wire.MAX_REPLY`): 70 clients holding 64 locks of 4096-character names each
    pass it.  An engine connecting asks which process serves the registry without a request
    (``SO_PEERCRED``), so it still connects and loads with sharing."""
    from vllm_dedup.registry import wire

    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "no-ray"))
    sock = tmp_path / "run" / "vllm-dedup.sock"
    start_daemon(sock)
    holders = []
    try:
        for i in range(70):
            client = RegistryClient(sock)
            client.hello(f"holder-{i}", "cpu", "default")
            client.lock([f"{i}-{j}-".ljust(4096, "x") for j in range(64)], timeout_s=5)
            holders.append(client)
        with pytest.raises(RegistryUnavailable, match=f"exceeds the limit of {wire.MAX_REPLY}"):
            registry_stats(sock)
        lease = EngineSession().connect(DedupConfig(registry_address="local"), "model-a", "cpu", "sig")
        assert lease is not None, "the engine fell back to loading privately"
        try:
            assert lease.get_recipes("sig") == [] and lease.engine_id is not None
        finally:
            lease.close()
    finally:
        for client in holders:
            client.close()
        assert wait_for(lambda: stats_or_none(sock) is not None)  # small again
        shutdown_registry(sock)
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 15)


@pytest.mark.parametrize("on_error", ["fallback", "fail"])
def test_a_start_up_lock_on_a_daemon_that_cannot_start_never_stops_a_fallback_engine(tmp_path, monkeypatch,
                                                                                     on_error):
    """A GPU engine's first registry call is its start-up lock: a daemon it started that cannot
    start is a warning under ``fallback`` (no lock, the start-up connection dropped), and stops
    the engine only under ``fail``."""
    monkeypatch.setenv(RECLAIM_GRACE_ENV, "soon")
    sock = tmp_path / "run" / "vllm-dedup.sock"
    session = EngineSession()
    lease = Lease(launch_daemon(sock), "model-a", "cuda:GPU-0", "default", "sig", timeout_s=10)
    session.startup_client = lease
    config = DedupConfig(on_registry_error=on_error, startup_lock_timeout_s=5)
    try:
        if on_error == "fail":
            with pytest.raises(RegistryUnavailable, match="(?s)start-up lock.*'soon' is not a number"):
                session.take_startup_locks(config, lease, ["startup:cuda:GPU-0"], "vllm-instance:a")
        else:
            assert not session.take_startup_locks(config, lease, ["startup:cuda:GPU-0"], "vllm-instance:a")
            assert session.startup_client is None and session.locks == []
    finally:
        lease.close()


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in state T (stopped), from /proc/PID/task/*/stat."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return bool(states) and all(s == "T" for s in states)


def test_the_serve_helper_starts_a_registry_actor_with_the_keep_warm_s_it_is_given(ray_address, smollm2):
    """`build_dedup_app` passes its loader's ``keep_warm_s`` here: an actor this call creates
    keeps unmapped segments that long (a restarted Serve replica maps them); a registry running
    already keeps its own setting."""
    import ray

    from vllm_dedup.serve import dedup_engine_kwargs, ensure_registry

    ray.init(address=ray_address, logging_level="WARNING", log_to_driver=False)
    try:
        sock = ensure_registry("t-keep-warm", keep_warm_s=7.0)
        try:
            assert registry_stats(sock).keep_warm_s == 7.0
            assert ensure_registry("t-keep-warm", keep_warm_s=0.0) == sock
            assert registry_stats(sock).keep_warm_s == 7.0
        finally:
            shutdown_registry(sock)
        # A standalone daemon that engines started before Ray serves the node's socket: it is
        # the node's registry (engines connect to what answers there), not an actor's failure.
        from vllm_dedup.registry.daemon import is_daemon
        from vllm_dedup.registry.wire import socket_path

        daemon_sock = socket_path("t-daemon-first")
        start_daemon(daemon_sock, idle_exit_s=60.0)
        try:
            assert ensure_registry("t-daemon-first") == daemon_sock
            assert is_daemon(registry_stats(daemon_sock).registry_pid)
        finally:
            shutdown_registry(daemon_sock)
        # Engines sent to the standalone daemon get no actor made for them.
        from vllm_dedup.serve import build_dedup_app

        def actors(namespace: str) -> list[str]:
            return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]

        build_dedup_app({"m": smollm2}, loader_config={"registry_address": "local"}, namespace="t-local")
        assert actors("t-local") == []
        build_dedup_app({"m": smollm2}, namespace="t-local")  # ... and those of this cluster do
        assert len(actors("t-local")) == 1
        shutdown_registry(socket_path("t-local"))
        # A loader option put in the engine's own arguments would be overwritten: said, not lost.
        with pytest.raises(ValueError, match="engine_kwargs sets model_loader_extra_config.*loader_config"):
            dedup_engine_kwargs({"model_loader_extra_config": {"share_group": "x"}})
    finally:
        ray.shutdown()


def test_a_lease_closed_while_watching_says_nothing_went_away(registry_server, caplog):
    """`Lease.close` closes the connection its watcher polls: the watcher sees a closed
    connection, but nothing went away, and the engine that let go must not log that the
    registry did (every ``del llm`` of a process would)."""
    import logging
    import threading

    lease = Lease(RegistryClient(registry_server.path, timeout_s=10), "m", "cpu", "default", "sig", timeout_s=10)
    lease.report({"load_path": "none"})
    with caplog.at_level(logging.WARNING, logger="vllm_dedup"):
        lease.watch()
        time.sleep(0.3)  # the watcher is polling the connection now
        lease.close()
        assert wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("vllm-dedup-lease")], 10)
    assert "went away" not in caplog.text


def test_a_forked_child_lets_go_of_the_parents_registry_connection(registry_server, monkeypatch):
    """Note [a forked child's session]: a child forked while an engine of this process holds
    a lease (vLLM forks its engine processes on the CPU) closes its copy of the connection and
    starts a session of its own, so the registry drops the parent's engine as soon as the
    parent lets go, however long the child lives."""
    import gc

    from torch import nn

    session = EngineSession()
    monkeypatch.setattr(EngineSession, "_current", session)
    lease = Lease(RegistryClient(registry_server.path, timeout_s=10), "engine-A", "cpu", "default", "sig",
                  timeout_s=10)
    lease.report({"load_path": "none"})
    model = nn.Linear(2, 2)
    session.hold(lease, 1 << 20, 0, model)
    to_parent, from_child = os.pipe()
    to_child, from_parent = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: says what it sees, then lives until the parent is done
        fresh = EngineSession.current()
        os.write(from_child, b"1" if fresh is not session and fresh.segment_bytes == 0 else b"0")
        os.read(to_child, 1)
        os._exit(0)
    try:
        assert os.read(to_parent, 1) == b"1"  # a session of its own
        assert [e.model for e in registry_stats(registry_server.path).engines] == ["engine-A"]
        del model
        gc.collect()  # the parent's engine goes: its lease closes
        assert wait_for(lambda: registry_stats(registry_server.path).engines == [], 10), \
            "the child's copy of the connection kept the parent's engine registered"
    finally:
        os.write(from_parent, b"x")
        os.waitpid(pid, 0)
        for fd in (to_parent, from_child, to_child, from_parent):
            os.close(fd)
