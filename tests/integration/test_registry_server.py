"""Host segments, the registry and the registry, with real processes sharing real memory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from harness.procs import PeerProcess, fd_targets, pss_parts
from helpers import segment_peer, wait_for
from vllm_dedup.errors import RegistryUnavailable
from vllm_dedup.registry.client import RegistryClient, registry_stats
from vllm_dedup.registry.server import RegistryServer
from vllm_dedup.registry.state import Registry, RegistryStats

MB = 1 << 20


def pss_shmem(peer: PeerProcess) -> int:
    """The peer's PSS of shared memory (memfd pages), bytes."""
    return pss_parts(peer.pid)["Pss_Shmem"]


def stats(server: RegistryServer) -> RegistryStats:
    return registry_stats(server.path)


def test_second_process_maps_the_same_bytes_and_pages_count_once(registry_server):
    a = segment_peer(registry_server.path, "publish", "k1", str(64 * MB))
    published = a.read_json()
    b = segment_peer(registry_server.path, "map", "k1")
    mapped = b.read_json()
    assert mapped == {"hit": True, "digest": published["digest"]}
    # 64 MiB resident once, mapped (and populated) by two processes: each is charged half.
    assert wait_for(lambda: abs(pss_shmem(a) - 32 * MB) < 4 * MB and abs(pss_shmem(b) - 32 * MB) < 4 * MB)
    (group,) = stats(registry_server).groups
    assert group.resident_bytes == 64 * MB and group.saved_bytes == 0
    assert a.end() == 0 and b.end() == 0


def test_sigkill_drops_the_lease_and_the_survivor_keeps_its_bytes(registry_server):
    a = segment_peer(registry_server.path, "publish", "k2", str(8 * MB))
    digest = a.read_json()["digest"]
    b = segment_peer(registry_server.path, "map", "k2")
    assert b.read_json()["digest"] == digest
    a.kill()
    assert wait_for(lambda: len(stats(registry_server).engines) == 1)
    assert stats(registry_server).groups[0].segments == 1  # still held by b
    c = segment_peer(registry_server.path, "map", "k2")  # a newcomer maps what survived
    assert c.read_json()["digest"] == digest
    assert b.end() == 0 and c.end() == 0
    assert wait_for(lambda: stats(registry_server).groups == [])  # nobody holds it: freed


@pytest.mark.heavy
def test_keep_warm_holds_an_unmapped_segment_then_frees_it(tmp_path):
    server = RegistryServer(Registry(keep_warm_s=4.0), tmp_path / "run" / "w.sock").start()
    try:
        a = segment_peer(server.path, "publish", "k3", str(MB))
        digest = a.read_json()["digest"]
        assert a.end() == 0
        assert wait_for(lambda: stats(server).engines == [])
        assert stats(server).groups[0].segments == 1  # nobody maps it, still resident
        b = segment_peer(server.path, "map", "k3")  # within keep_warm_s: maps instead of loading
        assert b.read_json()["digest"] == digest
        assert b.end() == 0
        ended = time.monotonic()
        assert wait_for(lambda: stats(server).groups == [], timeout_s=10)
        assert time.monotonic() - ended >= 3.0  # kept warm again before it was freed
    finally:
        server.stop()


def test_write_through_a_shared_mapping_faults(registry_server):
    a = segment_peer(registry_server.path, "publish", "k4", str(MB))
    digest = a.read_json()["digest"]
    w = segment_peer(registry_server.path, "write", "k4")
    assert w.proc.wait(timeout=60) == -signal.SIGSEGV
    assert "WROTE" not in w.proc.stdout.read()
    w.end()
    b = segment_peer(registry_server.path, "map", "k4")
    assert b.read_json()["digest"] == digest  # the bytes are unchanged
    assert a.end() == 0 and b.end() == 0


def test_share_groups_never_see_each_other(registry_server):
    a = segment_peer(registry_server.path, "publish", "k5", str(MB), "group-a")
    a.read_json()
    other = segment_peer(registry_server.path, "map", "k5", "group-b")
    assert other.read_json() == {"hit": False}
    same = segment_peer(registry_server.path, "map", "k5", "group-a")
    assert same.read_json()["hit"] is True
    for p in (a, other, same):
        assert p.end() == 0


INTRUDER = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(json.dumps({"op": "stats"}).encode())
print(s.recv(65536).decode())
"""


def stdlib_python_for(uid: int) -> str:
    """An interpreter that ``uid`` can run: the intruder needs only the standard library, and
    the tests' own interpreter may sit in a checkout other users cannot enter (mode 0700)."""
    for candidate in (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"):
        probe = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", candidate, "-c",
                                "import json, socket"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return candidate
    raise AssertionError(f"no Python interpreter on this machine can be run by uid {uid}")


def test_another_uid_is_refused_even_through_loose_permissions():
    """The kernel's permission checks are loosened on purpose, and the intruder skips the
    client's own checks: only the registry's SO_PEERCRED check stands in the way."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a peer as another uid (CI runs as root)")
    python = stdlib_python_for(65534)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        server = RegistryServer(Registry(), run / "x.sock").start()
        try:
            os.chmod(tmp, 0o755)
            os.chmod(run, 0o755)
            os.chmod(server.path, 0o777)
            proc = subprocess.run(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", INTRUDER,
                 str(server.path)], capture_output=True, text=True, timeout=60,
            )
            reply = json.loads(proc.stdout)
            assert "refused" in reply["error"] and "uid 65534" in reply["error"]
            assert "groups" not in reply
            assert list(server.refused_uids) == [65534]
        finally:
            server.stop()


def test_bad_requests_get_errors_and_the_registry_keeps_serving(registry_server):
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    raw.connect(str(registry_server.path))
    for payload in (b"not json", json.dumps({"op": "nope"}).encode(), json.dumps({"op": "acquire", "keys": []}).encode()):
        raw.send(payload)
        assert "error" in json.loads(raw.recv(65536))
    raw.close()
    client = RegistryClient(registry_server.path)
    with pytest.raises(RegistryUnavailable, match="hello sent twice"):
        client.hello("m", "cpu", "g")
        client.hello("m", "cpu", "g")
    client.close()
    assert stats(registry_server).engines == []


def test_connections_leak_no_descriptors(registry_server):
    def fd_count() -> int:
        """This process's sockets and memfds: what the registry opens (pipes are the test's)."""
        return sum(k.startswith(("socket:", "/memfd:")) for k in fd_targets())

    a = segment_peer(registry_server.path, "publish", "k7", str(MB))
    a.read_json()
    before = fd_count()
    for _ in range(5):
        p = segment_peer(registry_server.path, "map", "k7")
        assert p.read_json()["hit"]
        assert p.end() == 0
    assert wait_for(lambda: fd_count() == before)
    assert a.end() == 0
    assert wait_for(lambda: stats(registry_server).groups == [])
    # The publisher's connection and the segment's own descriptor are both closed.
    assert wait_for(lambda: fd_count() == before - 2)


def test_status_command_reports_the_registry(tmp_path, monkeypatch):
    from helpers import run_cli

    run = tmp_path / "run"
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(run))
    missing = run_cli("status")
    assert missing.returncode == 1 and "no registry for namespace 'vllm-dedup'" in missing.stderr
    server = RegistryServer(Registry(), run / "vllm-dedup.sock").start()
    try:
        a = segment_peer(server.path, "publish", "k8", str(2 * MB), "g1")
        a.read_json()
        b = segment_peer(server.path, "map", "k8", "g1")
        b.read_json()
        data = json.loads(run_cli("status", "--json", check=True).stdout)
        (group,) = data["groups"]
        assert (group["share_group"], group["engines"], group["segments"], group["resident_bytes"],
                group["shared_bytes"]) == ("g1", 2, 1, 2 * MB, 2 * MB)
        assert sorted(e["pid"] for e in data["engines"]) == sorted([a.pid, b.pid])
        human = run_cli("status", check=True).stdout
        assert "g1" in human and "2.1 MB" in human
        assert a.end() == 0 and b.end() == 0
    finally:
        server.stop()


def test_a_lock_waits_for_its_holder_and_is_freed_when_the_holder_dies(registry_server):
    holder = segment_peer(registry_server.path, "lock", "publish:cpu:default")
    assert holder.read_json() == {"locked": "publish:cpu:default"}
    with RegistryClient(registry_server.path) as client:
        client.hello("m", "cpu", "default")
        assert registry_stats(registry_server.path).locks == {"publish:cpu:default": holder.pid}
        with pytest.raises(TimeoutError, match=f"held by engine pid {holder.pid}"):
            with client.locked("publish:cpu:default", timeout_s=0.3):
                pass
        with client.locked("publish:cpu:other"):  # other names are independent
            pass
        holder.kill()  # no unlock: the lock goes with the connection
        start = time.monotonic()
        with client.locked("publish:cpu:default", timeout_s=10):
            assert registry_stats(registry_server.path).locks == {"publish:cpu:default": os.getpid()}
        assert time.monotonic() - start < 5
        assert registry_stats(registry_server.path).locks == {}
    holder.end()


def test_lock_waiters_get_the_lock_one_after_another(registry_server):
    inside, overlaps, rounds, errors = [], [], [], []

    def worker(n: int) -> None:
        try:
            with RegistryClient(registry_server.path) as client:
                client.hello(f"m{n}", "cpu", "default")
                for _ in range(5):
                    with client.locked("publish:cpu:default", timeout_s=30):
                        inside.append(n)
                        if len(inside) > 1:
                            overlaps.append(list(inside))
                        time.sleep(0.01)
                        inside.remove(n)
                        rounds.append(n)
        except BaseException as e:  # seen by the assertions below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert sorted(rounds) == [0] * 5 + [1] * 5 + [2] * 5  # every waiter got its turns
    assert overlaps == []


def test_a_segment_one_lease_acquired_twice_stays_held_until_both_are_released(registry_server):
    """A replay maps a segment and the sharing pass acquires it again (another key of its pack),
    then gives that one back: the registry holds a segment once per engine, so the lease must
    not tell it before the replay's acquire is given back too."""
    from rawclient import KEY, NBYTES, publisher
    from vllm_dedup.registry.lease import Lease

    with publisher(registry_server):
        lease = Lease(RegistryClient(registry_server.path), "m", "cpu", "default", "sig")
        try:
            first, second = (lease.acquire([KEY])[0] for _ in range(2))
            for found in (first, second):
                os.close(found.fd)
            assert first.segment == second.segment
            assert stats(registry_server).groups[0].mapped_bytes == 2 * NBYTES  # the publisher and this engine
            lease.release([second.segment])
            assert stats(registry_server).groups[0].mapped_bytes == 2 * NBYTES
            lease.release([first.segment])
            assert stats(registry_server).groups[0].mapped_bytes == NBYTES
        finally:
            lease.close()


def test_a_registry_that_stops_leaves_the_socket_of_one_started_since_on_its_path(tmp_path):
    path = tmp_path / "run" / "r.sock"
    old = RegistryServer(Registry(), path).start()
    path.unlink()  # as if it had been removed by hand; a new registry serves the path now
    new = RegistryServer(Registry(), path).start()
    try:
        old.stop()
        RegistryClient(path).close()  # the new one still answers there
    finally:
        new.stop()
    assert not path.exists()


def test_a_registry_whose_loop_dies_stops_and_its_waiter_returns(tmp_path):
    """An error outside one connection's handling ends the serving thread; the registry must then
    stop as a stop would, so that a daemon or Ray actor blocked in `wait` exits and frees the
    node's name, rather than living on with nobody serving its socket."""
    path = tmp_path / "run" / "r.sock"
    server = RegistryServer(Registry(), path)

    def expire():
        raise RuntimeError("a bug in the registry's expiry")

    server.registry.expire = expire
    waiter = threading.Thread(target=server.wait, daemon=True)
    with pytest.MonkeyPatch.context() as patch:  # the thread's traceback is expected, not a test failure
        patch.setattr(threading, "excepthook", lambda args: None)
        server.start()
        waiter.start()
        waiter.join(timeout=10)
    assert not waiter.is_alive(), "wait() did not return after the serving thread died"
    assert not path.exists()
    with pytest.raises(RegistryUnavailable):
        RegistryClient(path, timeout_s=1).close()


def test_a_registry_whose_backlog_is_full_is_not_replaced_and_start_does_not_block(tmp_path):
    """A hung registry (its loop stopped, its listen backlog full) still owns its path: a new
    registry's start must say so, not block in its probe's connect as a blocking socket would."""
    path = tmp_path / "run" / "r.sock"
    path.parent.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(0)  # accepts nothing: one pending connection fills it
    waiting = []
    try:
        for _ in range(2):
            client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            client.setblocking(False)
            try:
                client.connect(str(path))
            except BlockingIOError:
                pass
            waiting.append(client)
        result = []
        starter = threading.Thread(target=lambda: result.append(_start_error(path)), daemon=True)
        starter.start()
        starter.join(timeout=10)
        assert not starter.is_alive(), "start() blocked on a registry whose backlog is full"
        assert "backlog is full" in str(result[0])
        assert path.exists()  # the hung registry's socket is left where it is
    finally:
        for sock in waiting + [listener]:
            sock.close()


def _start_error(path: Path) -> Exception | None:
    try:
        RegistryServer(Registry(), path).start().stop()
    except RegistryUnavailable as e:
        return e
    return None
