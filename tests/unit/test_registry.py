"""The registry's start-up locks, deferred frees and shared-bytes prediction, in-process.

The same `Registry` serves engines through the registry (tests/test_registry_server.py and
tests/test_accounting.py drive it from real processes); here its rules are checked directly.
"""

from __future__ import annotations

import pytest

from vllm_dedup.registry.state import Registry, startup_lock_name

GPU0, GPU1 = "cuda:GPU-00000000-0000-0000-0000-000000000000", "cuda:GPU-11111111-1111-1111-1111-111111111111"


@pytest.fixture
def reg():
    closed: list[int] = []
    registry = Registry(close=closed.append)
    registry.closed = closed
    return registry


def engine(reg: Registry, pid: int, device: str = GPU0, signature: str = "") -> int:
    return reg.add_engine(pid, 0, f"model-{pid}", device, "default", signature)


def test_no_segment_of_a_device_is_freed_while_its_startup_lock_is_held(reg):
    a, b, starting = engine(reg, 1), engine(reg, 2, GPU1), engine(reg, 3)
    seg = reg.publish(a, 100, 2 << 20, [("k0", 0, 2 << 20)])
    reg.publish(b, 101, 2 << 20, [("k1", 0, 2 << 20)])
    assert reg.try_lock(starting, startup_lock_name(GPU0)) is None
    reg.drop_engine(a)  # its segment on GPU0 is unheld now
    reg.drop_engine(b)  # GPU1 has no start-up in progress
    assert reg.closed == [101]
    assert reg.stats().groups[0].deferred_segments == 1
    assert [h.segment for h in reg.acquire(starting, ["k0"])] == [seg]  # still resident, and mappable
    reg.release(starting, [seg])
    assert reg.closed == [101]
    reg.unlock(starting, startup_lock_name(GPU0))
    assert reg.closed == [101, 100]
    assert reg.segments == {}


def test_a_starting_engine_that_dies_frees_what_waited_for_it(reg):
    a, starting = engine(reg, 1), engine(reg, 2)
    reg.publish(a, 100, 4096, [("k", 0, 4096)])
    reg.try_lock(starting, startup_lock_name(GPU0))
    reg.drop_engine(a)
    assert reg.closed == []
    reg.drop_engine(starting)  # crashed mid start-up: lock and deferral end with it
    assert reg.closed == [100] and reg.locks == {}


def test_keep_warm_expiry_waits_for_the_startup_lock():
    closed = []
    reg = Registry(keep_warm_s=1.0, close=closed.append)
    a, starting = engine(reg, 1), engine(reg, 2)
    reg.publish(a, 100, 4096, [("k", 0, 4096)])
    reg.drop_engine(a)
    reg.try_lock(starting, startup_lock_name(GPU0))
    assert reg.expire(now=1e12) == 0 and closed == []
    reg.unlock(starting, startup_lock_name(GPU0))
    assert reg.expire(now=1e12) == 1 and closed == [100]


def test_ranks_of_one_instance_share_a_lock_other_instances_wait(reg):
    rank0, rank1, other = engine(reg, 10), engine(reg, 11, GPU1), engine(reg, 20)
    names = sorted([startup_lock_name(GPU0), startup_lock_name(GPU1)])
    assert reg.try_lock(rank0, names, owner="vllm-instance:A") is None
    assert reg.try_lock(rank1, names, owner="vllm-instance:A") is None  # shared, no wait
    assert reg.try_lock(other, names[:1], owner="vllm-instance:B") == 10
    reg.unlock(rank0, names)
    assert reg.try_lock(other, names[:1], owner="vllm-instance:B") == 11  # rank 1 still holds it
    reg.drop_engine(rank1)
    assert reg.try_lock(other, names[:1], owner="vllm-instance:B") is None


def test_locks_are_all_or_nothing_so_two_multi_gpu_engines_cannot_deadlock(reg):
    a, b = engine(reg, 1), engine(reg, 2)
    g0, g1 = startup_lock_name(GPU0), startup_lock_name(GPU1)
    assert reg.try_lock(a, [g1]) is None
    assert reg.try_lock(b, [g0, g1]) == 1
    assert list(reg.locks) == [g1]  # b took nothing, not even the free GPU0 lock
    assert reg.try_lock(a, [g0, g1]) is None  # a can take the rest: no one holds part of it
    reg.unlock(a, [g0, g1])
    assert reg.try_lock(b, [g0, g1]) is None


def test_expected_shared_bytes_come_from_the_newest_recipe_of_that_signature(reg):
    first = engine(reg, 1, signature="m|tp1.0")
    reg.publish(first, 100, 6 << 20, [("k0", 0, 2 << 20), ("k1", 2 << 20, 4 << 20)])
    reg.put_recipe(first, 200, 10, "m|tp1.0", "ckpt-a", {"k0": 2 << 20, "k1": 4 << 20})
    assert reg.expected_shared_bytes(GPU0, "default", "m|tp1.0") == 6 << 20
    assert reg.expected_shared_bytes(GPU0, "default", "m|tp2.0") == 0  # never loaded
    assert reg.expected_shared_bytes(GPU1, "default", "m|tp1.0") == 0  # nothing resident there
    assert reg.expected_shared_bytes(GPU0, "other-group", "m|tp1.0") == 0
    # A fine-tune's recipe, newer, names k0 and a key of its own that is not resident.
    reg.put_recipe(first, 201, 10, "m|tp1.0", "ckpt-b", {"k0": 2 << 20, "k9": 4 << 20})
    assert reg.expected_shared_bytes(GPU0, "default", "m|tp1.0") == 2 << 20
    assert [r.id for r in reg.recipes_for(first, "m|tp1.0")] == ["ckpt-b", "ckpt-a"]
    reg.drop_engine(first)  # segment freed: nothing left to map, the recipes stay
    assert reg.expected_shared_bytes(GPU0, "default", "m|tp1.0") == 0
    assert reg.closed == [100]


def test_a_recipe_of_the_same_checkpoint_replaces_the_old_one_and_old_ones_go_beyond_the_limit(reg):
    from vllm_dedup.registry.state import MAX_RECIPES

    e = engine(reg, 1)
    reg.put_recipe(e, 300, 10, "sig", "same", {})
    reg.put_recipe(e, 301, 10, "sig", "same", {})
    assert reg.closed == [300] and [r.fd for r in reg.recipes_for(e, "sig")] == [301]
    for i in range(MAX_RECIPES):
        reg.put_recipe(e, 400 + i, 10, "sig", f"other-{i}", {})
    assert reg.closed == [300, 301]  # the oldest went
    assert len(reg.recipes_for(e, "sig")) == MAX_RECIPES
    reg.close()
    assert sorted(reg.closed) == sorted([300, 301, *range(400, 400 + MAX_RECIPES)])


def test_recipes_of_many_signatures_keep_at_most_the_limit_the_oldest_going_first(reg, monkeypatch):
    """A peer drawing new signatures cannot make the registry keep descriptors without end."""
    import vllm_dedup.registry.state as state

    monkeypatch.setattr(state, "MAX_KEPT_RECIPES", 5)
    e = engine(reg, 1)
    for i in range(12):
        reg.put_recipe(e, 500 + i, 10, f"sig-{i % 4}", f"r{i}", {})
    assert reg.closed == list(range(500, 507))  # in the order they were kept, whatever their signature
    assert sum(len(reg.recipes_for(e, f"sig-{i}")) for i in range(4)) == 5
    assert [r.fd for r in reg.recipes_for(e, "sig-3")] == [511, 507]  # newest first
    assert all(reg.recipes.values())  # no slot left empty


def test_recipes_are_kept_within_a_byte_budget_and_only_the_newest_keeps_its_final_keys(reg, monkeypatch):
    """A recipe may be 64 MiB, and its parsed final keys several times that on the heap: the
    bytes kept in all are bounded (the oldest going first), and an older recipe of a signature
    drops its final keys (`expected_shared_bytes` reads the newest's only)."""
    import vllm_dedup.registry.state as state

    monkeypatch.setattr(state, "MAX_KEPT_RECIPE_BYTES", 100)
    e = engine(reg, 1)
    for i in range(4):
        reg.put_recipe(e, 600 + i, 40, "sig", f"r{i}", {f"k{i}": 8})
    assert reg.closed == [600, 601]  # 4 x 40 bytes: two went, the oldest first
    assert [(r.fd, r.final) for r in reg.recipes_for(e, "sig")] == [(603, {"k3": 8}), (602, {})]


def test_an_engine_publishes_at_most_the_key_budget_and_nothing_past_it_is_recorded(reg, monkeypatch):
    """One connection publishing without end (the same sealed memfd, new keys each time) grew
    the registry by about 23 MB per 0.9 MB request until it was killed."""
    import vllm_dedup.registry.state as state

    monkeypatch.setattr(state, "MAX_KEYS_PER_ENGINE", 10)
    e = engine(reg, 1)
    reg.publish(e, 700, 4096, [(f"a{i}", 0, 8) for i in range(6)])
    with pytest.raises(ValueError, match="at most 10 content keys; this one has published 6"):
        reg.publish(e, 701, 4096, [(f"b{i}", 0, 8) for i in range(5)])
    assert len(reg.segments) == 1 and (GPU0, "default", "b0") not in reg.index and 701 not in reg.closed
    reg.publish(e, 702, 4096, [(f"c{i}", 0, 8) for i in range(4)])  # within it


def test_an_engine_holds_at_most_the_lock_limit(reg):
    from vllm_dedup.registry.state import MAX_LOCKS_PER_ENGINE

    e, other = engine(reg, 1), engine(reg, 2)
    assert reg.try_lock(e, [f"n{i}" for i in range(MAX_LOCKS_PER_ENGINE - 1)]) is None
    assert reg.try_lock(e, ["n0", "last"]) is None  # one held already: 64 in all
    with pytest.raises(ValueError, match=f"at most {MAX_LOCKS_PER_ENGINE} registry locks"):
        reg.try_lock(e, "one-more")
    assert "one-more" not in reg.locks
    assert reg.try_lock(other, "one-more") is None  # the limit is each engine's


def test_a_registry_replacing_a_dead_one_grants_only_reclaims_for_a_while(reg, monkeypatch):
    import vllm_dedup.registry.state as state

    now = [1000.0]
    monkeypatch.setattr(state.time, "monotonic", lambda: now[0])
    holder, newcomer = engine(reg, 10), engine(reg, 11)
    reg.begin_reclaim(10.0)
    assert reg.try_lock(newcomer, "publish:cpu:default") == 0  # refused: the reclaim period
    assert reg.try_lock(holder, "publish:cpu:default", reclaim=True) is None  # what it held before
    now[0] += 10.0
    assert reg.try_lock(newcomer, "publish:cpu:default") == 10  # held by the one that reclaimed it
    reg.unlock(holder, "publish:cpu:default")
    assert reg.try_lock(newcomer, "publish:cpu:default") is None
    assert reg.try_lock(holder, "publish:cpu:default", reclaim=True) == 11  # a late reclaim is refused


def test_a_fresh_registry_has_no_reclaim_period(reg):
    assert reg.try_lock(engine(reg, 10), "publish:cpu:default") is None


@pytest.mark.parametrize("value, args, said", [
    ("ten", [], "$VLLM_DEDUP_RECLAIM_GRACE_S: 'ten' is not a number of seconds; give e.g. 10, or unset it"),
    # inf would refuse every new lock for good; nan and a negative would turn the grace off unsaid
    ("inf", [], "$VLLM_DEDUP_RECLAIM_GRACE_S: 'inf' is not a finite number of seconds >= 0"),
    ("nan", [], "'nan' is not a finite number of seconds >= 0"),
    ("-5", [], "$VLLM_DEDUP_RECLAIM_GRACE_S: '-5' is not a finite number"),
    (None, ["--reclaim-grace-s", "inf"], "argument --reclaim-grace-s: 'inf' is not a finite number"),
    (None, ["--keep-warm-s", "inf"], "argument --keep-warm-s: 'inf' is not a finite number of seconds >= 0"),
    (None, ["--idle-exit-s", "-1"], "argument --idle-exit-s: '-1' is not a finite number of seconds >= 0"),
])
def test_a_daemon_given_a_bad_period_says_what_to_fix_and_takes_no_lock(tmp_path, monkeypatch, capsys,
                                                                        value, args, said):
    from vllm_dedup.registry import daemon

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    if value is None:
        monkeypatch.delenv(daemon.RECLAIM_GRACE_ENV, raising=False)
    else:
        monkeypatch.setenv(daemon.RECLAIM_GRACE_ENV, value)
    with pytest.raises(SystemExit) as exited:
        daemon.main(["--socket", str(run / "r.sock"), *args])
    assert exited.value.code == 2
    assert said in capsys.readouterr().err
    assert list(run.iterdir()) == []


def test_a_daemon_that_cannot_serve_leaves_no_lock_file(tmp_path, capsys):
    """A failure while the server starts (here a socket path longer than Linux allows) takes
    the daemon's ``<socket>.lock`` with it, so no lock file is left for the next one to find."""
    from vllm_dedup.registry import daemon

    run = tmp_path / ("r" * 100)
    run.mkdir(mode=0o700)
    assert daemon.main(["--socket", str(run / "vllm-dedup.sock")]) == 1
    assert "Linux allows a Unix socket at most 107" in capsys.readouterr().err
    assert list(run.iterdir()) == []


def test_a_socket_path_longer_than_linux_allows_says_how_to_shorten_it(tmp_path):
    from vllm_dedup.errors import RegistryUnavailable
    from vllm_dedup.registry.client import RegistryClient
    from vllm_dedup.registry.server import RegistryServer

    deep = tmp_path / ("d" * (120 - len(str(tmp_path))))
    for start in (lambda: RegistryServer(Registry(), deep / "r.sock").start(), lambda: RegistryClient(deep / "r.sock")):
        with pytest.raises(RegistryUnavailable, match="VLLM_DEDUP_RUNTIME_DIR.*shorter.*shorter registry_namespace"):
            start()
    assert not deep.exists() or not any(deep.iterdir())  # nothing bound


def test_a_daemon_locks_the_lock_file_at_its_path_not_one_a_daemon_exiting_unlinked(tmp_path, monkeypatch):
    """Note [one daemon per socket]: a daemon that opened the lock file before the daemon
    exiting unlinked it, and locks it after, holds a lock the next daemon would not see."""
    import fcntl
    import os
    from pathlib import Path

    from vllm_dedup.registry import daemon

    sock = tmp_path / "r.sock"
    lock_path = Path(f"{sock}.lock")
    lock_path.write_text("")  # the exiting daemon's
    real_flock, opened = fcntl.flock, []

    def flock(f, op):
        if not opened:
            lock_path.unlink()  # it exits between this daemon's open and its lock
        opened.append(os.fstat(f.fileno()).st_ino)
        return real_flock(f, op)

    monkeypatch.setattr(daemon.fcntl, "flock", flock)
    lock = daemon._socket_lock(sock)
    monkeypatch.undo()
    try:
        assert lock is not None and len(opened) == 2
        assert os.fstat(lock.fileno()).st_ino == os.stat(lock_path).st_ino  # (inode numbers are reused)
        assert daemon._socket_lock(sock) is None  # the next daemon sees it held
    finally:
        lock.close()


def test_a_known_segment_gains_only_the_keys_that_lie_within_it(reg):
    """A re-registration (the same uid) from a peer that says another size: a key past the
    stored segment's end would fail every later acquire of that key (`AcquireReply`)."""
    first = reg.publish(engine(reg, 1), 101, 4096, [("a", 0, 4096)], uid="u")
    again = reg.publish(engine(reg, 2), 102, 8192, [("a", 0, 4096), ("b", 4096, 4096)], uid="u")
    assert again == first and 102 in reg.closed
    assert (GPU0, "default", "a") in reg.index and (GPU0, "default", "b") not in reg.index
    assert reg.segments[first].keys == [("a", 0, 4096)]


def test_a_key_two_engines_published_stays_found_when_the_first_copy_goes(reg):
    """Two engines that missed a key at the same moment each publish it; the index names the
    first copy, and when that copy is freed the second one, still resident, must be found."""
    a, b, c = engine(reg, 1), engine(reg, 2), engine(reg, 3)
    first = reg.publish(a, 101, 8192, [("k", 0, 4096), ("only-a", 4096, 4096)])
    second = reg.publish(b, 102, 8192, [("other", 0, 4096), ("k", 4096, 4096)])
    assert reg.index[(GPU0, "default", "k")] == (first, 0, 4096)
    reg.drop_engine(a)
    assert 101 in reg.closed and first not in reg.segments
    assert reg.index[(GPU0, "default", "k")] == (second, 4096, 4096)
    assert (GPU0, "default", "only-a") not in reg.index
    assert [(h.key, h.segment, h.offset) for h in reg.acquire(c, ["k", "only-a"])] == [("k", second, 4096)]


def test_a_uid_names_a_segment_only_in_its_own_device_and_group(reg):
    """A publish on another device that repeats a resident segment's uid makes a segment of its
    own there, and takes nothing away from the first: engines of the first pair still find
    keys by that uid, and a re-registration there still joins the first segment."""
    a, other = engine(reg, 1), engine(reg, 2, GPU1)
    first = reg.publish(a, 101, 4096, [("k", 0, 4096)], uid="u")
    elsewhere = reg.publish(other, 102, 4096, [("k", 0, 4096)], uid="u")
    assert elsewhere != first and 102 not in reg.closed
    reader = engine(reg, 3)
    assert [h.segment for h in reg.acquire(reader, ["k"], uids=["u"])] == [first]
    again = reg.publish(engine(reg, 4), 103, 4096, [("k", 0, 4096)], uid="u")
    assert again == first and 103 in reg.closed
    reg.drop_engine(other)  # frees the other device's copy; the first pair's uid stays
    assert 102 in reg.closed
    assert [h.segment for h in reg.acquire(engine(reg, 5), ["k"], uids=["u"])] == [first]


def test_a_daemon_started_under_a_low_descriptor_limit_raises_it_to_the_hard_one(tmp_path):
    """Each segment published keeps a registry descriptor (a CPU engine publishes one per
    tensor); an engine run from a script often has a soft limit of 1024, which its daemon
    inherits.  A real daemon, started from a child with a soft limit of 256."""
    import resource
    import subprocess
    import sys
    import textwrap

    from harness.procs import processes_matching
    from helpers import wait_for
    from vllm_dedup.registry.client import registry_stats, shutdown_registry

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    expected = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    if expected <= 256:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    sock = tmp_path / "run" / "vllm-dedup.sock"
    code = textwrap.dedent("""
        import resource, sys
        from pathlib import Path
        from vllm_dedup.registry.daemon import start_daemon
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        start_daemon(Path(sys.argv[1]), idle_exit_s=30)
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(sock)], capture_output=True, text=True, timeout=120)
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        pid = registry_stats(sock).registry_pid
        with open(f"/proc/{pid}/limits") as f:
            (line,) = [line for line in f if line.startswith("Max open files")]
        assert int(line.split()[3]) == expected, line
    finally:
        shutdown_registry(sock)
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 30)


def test_re_publishing_a_segment_adds_keys_up_to_a_limit_and_a_lookup_by_uid_is_direct(reg):
    """A publish naming a known uid costs the registry no descriptor, and each may name up to
    `messages.MAX_ITEMS` keys: a peer repeating it grew one segment without bound (and each
    acquire by uid scanned its keys).  Keys stop at `MAX_SEGMENT_KEYS`; a key past it is not
    indexed (a freed segment must take every key the index names for it along)."""
    from vllm_dedup.registry.state import MAX_SEGMENT_KEYS

    owner, peer = engine(reg, 1), engine(reg, 2)
    seg = reg.publish(owner, 101, 4096, [("a", 0, 8)], uid="u")
    for round_ in range(3):
        reg.publish(peer, 200 + round_, 4096, [(f"{round_}-{i}", 0, 8) for i in range(MAX_SEGMENT_KEYS // 2)], uid="u")
    assert len(reg.segments[seg].keys) == MAX_SEGMENT_KEYS == len(reg.segments[seg].where)
    assert (GPU0, "default", "2-0") not in reg.index and (GPU0, "default", "1-0") in reg.index
    reader = engine(reg, 3)
    assert [(h.segment, h.offset) for h in reg.acquire(reader, ["a", "1-5", "2-0"], uids=["u"] * 3)] == [(seg, 0)] * 2
    for each in (owner, peer, reader):
        reg.drop_engine(each)
    assert seg not in reg.segments and not reg.index  # every key it had went with it


def test_an_engine_dropping_many_segments_reindexes_once(reg, monkeypatch):
    """A CPU engine publishes one segment per tensor; freeing each with a pass over every
    segment of its pair took time quadratic in them (0.8 s on the serving thread for 700 of
    6000).  The keys they leave are pointed at other copies in one pass per pair."""
    keeper, dropped = engine(reg, 1), engine(reg, 2)
    for i in range(50):
        reg.publish(keeper, 1000 + i, 4096, [(f"k{i}", 0, 4096)])
        reg.publish(dropped, 2000 + i, 4096, [(f"k{i}", 0, 4096), (f"own{i}", 0, 8)])
    reg.drop_engine(keeper)  # the index's copies go: it names the dropped engine's now
    passes = []
    original = reg._reindex
    monkeypatch.setattr(reg, "_reindex", lambda *args: passes.append(args) or original(*args))
    again = engine(reg, 3)
    for i in range(50):
        reg.publish(again, 3000 + i, 4096, [(f"k{i}", 0, 4096)])
    reg.drop_engine(dropped)
    assert len(passes) == 1 and passes[0][2] == {f"own{i}" for i in range(50)}  # one pass; no copy of those
    assert all(reg.index[(GPU0, "default", f"k{i}")][0] in reg.engines[again].segments for i in range(50))
    assert not any(key.startswith("own") for _, _, key in reg.index)


def test_a_freed_segments_keys_go_to_the_oldest_copy_whether_it_holds_few_keys_or_many(reg):
    """`_reindex` looks a segment's keys up in those left, or those left in the segment's keys,
    whichever are fewer (one client's 65,536 orphans against 4,000 one-key segments held the
    serving thread 15.7 s): either way each key goes to the oldest segment holding it."""
    first, few, many = engine(reg, 1), engine(reg, 2), engine(reg, 3)
    reg.publish(first, 100, 4096, [(f"k{i}", 0, 8) for i in range(4)])
    one = reg.publish(few, 101, 4096, [("k1", 0, 8)])  # fewer keys than the 4 orphans
    lots = reg.publish(many, 102, 4096, [(f"k{i}", 8, 8) for i in range(1, 100)])  # more
    reg.drop_engine(first)
    assert reg.index[(GPU0, "default", "k1")] == (one, 0, 8)
    assert [reg.index[(GPU0, "default", f"k{i}")] for i in (2, 3)] == [(lots, 8, 8)] * 2
    assert (GPU0, "default", "k0") not in reg.index


def test_metrics_zero_a_group_that_went_away_once_then_forget_it(reg):
    """A (device, share group) gone from the stats reads 0 on the next update and is set no more
    after it: a long-lived registry does not keep every group it ever saw."""
    from vllm_dedup.registry.metrics import RegistryMetrics
    from vllm_dedup.registry.state import GroupStats, RegistryStats

    class Recorder:  # what the exporter tells Ray's gauges: Ray's export itself is test_serve's
        def __init__(self):
            self.sets = []

        def set(self, value, tags):
            self.sets.append((tags.get("share_group"), value))

    groups = [GroupStats("cpu", "a", engines=1, resident_bytes=10), GroupStats("cpu", "b", engines=2)]
    metrics = RegistryMetrics(lambda: RegistryStats(list(groups), [], {}, 0, 0.0, 1), node="n")
    recorders = {field: Recorder() for field in metrics._gauges}
    metrics._gauges, metrics._collisions = recorders, Recorder()
    metrics.update()
    assert recorders["engines"].sets == [("a", 1), ("b", 2)]
    groups.pop()  # group b goes away
    for recorder in recorders.values():
        recorder.sets.clear()
    metrics.update()
    assert recorders["engines"].sets == [("a", 1), ("b", 0)]
    assert recorders["resident_bytes"].sets == [("a", 10), ("b", 0)]
    recorders["engines"].sets.clear()
    metrics.update()
    assert recorders["engines"].sets == [("a", 1)]


def test_collisions_count_each_engines_latest_report_once_and_outlive_the_engine(reg):
    a, b = engine(reg, 1), engine(reg, 2)
    reg.report(a, {"collisions": 2})
    reg.report(a, {"collisions": 3})  # a second report of one engine replaces its first
    reg.report(b, {"collisions": 1})
    assert reg.stats().collisions == 4
    reg.drop_engine(a)
    assert reg.stats().collisions == 4  # over the registry's life
