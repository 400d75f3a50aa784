"""Hostile and broken clients against a real registry on a real socket: a client that never reads
its replies, hundreds of connections at once, descriptors that are not sealed memfds, field
values out of range, empty and oversized messages, a registry out of descriptors.  In each case
the registry answers with a clear error, keeps serving the others and leaks nothing.

The registry runs in the test process, so ``/proc/self/fd`` shows its descriptors.
(Property-based tests of the same protocol: test_protocol_fuzz.py.)
"""

from __future__ import annotations

import json
from collections import Counter
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import wait_for
from rawclient import (DESCRIPTOR_KINDS, KEY, NBYTES, RawClient, descriptor, engine_ids, fd_kind, fd_kinds, memfd,
                       publisher, registry_state, well_behaved)
from vllm_dedup.errors import ProtocolError, RegistryUnavailable
from vllm_dedup.registry import wire
from vllm_dedup.registry.client import RegistryClient
from vllm_dedup.registry.server import RegistryServer
from vllm_dedup.registry.state import Registry


@pytest.fixture
def published(registry_server):
    """The registry, with one engine holding a published segment of ``KEY``."""
    with publisher(registry_server):
        yield registry_server


def test_a_client_that_never_reads_is_dropped_while_others_get_prompt_answers(published):
    before = fd_kinds()
    flood = RawClient(published.path)
    flood.hello()
    flood.sock.setblocking(False)
    request = json.dumps({"op": "acquire", "keys": [KEY]}).encode()  # each reply carries a descriptor
    sent, dropped, slowest = 0, False, 0.0
    deadline = time.monotonic() + 30
    while not dropped and time.monotonic() < deadline:
        try:
            for _ in range(50):
                flood.sock.send(request)
                sent += 1
        except BlockingIOError:  # the registry reads at its own pace
            pass
        except (BrokenPipeError, ConnectionResetError):
            dropped = True
        slowest = max(slowest, well_behaved(published))
    assert dropped, f"the registry never dropped a client that sent {sent} requests and read no reply"
    assert slowest < 2.0, f"a well-behaved client waited {slowest:.1f} s for its answers"
    assert wait_for(lambda: len(engine_ids(published)) == 1)  # the flooder's lease is gone
    flood.close()
    # Its queued replies' descriptors (duplicates of the segment's) and its socket are closed.
    assert wait_for(lambda: fd_kinds() == before), f"{fd_kinds() - before} leaked, {before - fd_kinds()} lost"
    assert well_behaved(published) < 2.0


def test_hundreds_of_simultaneous_connections_are_all_served_and_leak_nothing(published):
    n = 320
    before = fd_kinds()
    start, connected, finish = threading.Barrier(n), threading.Barrier(n + 1), threading.Event()
    errors, hits = [], []

    def engine(i: int) -> None:
        try:
            start.wait(timeout=60)  # every thread connects at the same moment
            with RegistryClient(published.path, timeout_s=60) as client:
                client.hello(f"model-{i}", "cpu", "default")
                (found,) = client.acquire([KEY])
                fd = found.fd
                hits.append(fd_kind(fd))
                os.close(fd)
                connected.wait(timeout=120)
                finish.wait(timeout=120)
        except BaseException as e:  # seen by the assertions below, not lost in the thread
            errors.append(f"engine {i}: {e!r}")
            connected.abort()

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        try:
            connected.wait(timeout=120)
        except threading.BrokenBarrierError:  # an engine failed: its error is in ``errors``
            pass
        assert errors == [], f"{len(errors)} engines failed, e.g. {errors[:3]}"
        stats = RegistryClient(published.path).stats()
        assert len(stats.engines) == n + 1 and stats.groups[0].mapped_bytes == (n + 1) * NBYTES
    finally:
        finish.set()
        for t in threads:
            t.join(timeout=60)
    assert hits == ["memfd"] * n
    assert wait_for(lambda: len(engine_ids(published)) == 1)
    assert wait_for(lambda: fd_kinds() == before), f"{fd_kinds() - before} leaked, {before - fd_kinds()} lost"


REFUSALS = {
    "unsealed memfd": "the memfd is not sealed read-only (missing F_SEAL_WRITE (or F_SEAL_FUTURE_WRITE), F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL)",
    "memfd without sealing": "the memfd is not sealed read-only (missing F_SEAL_WRITE (or F_SEAL_FUTURE_WRITE), F_SEAL_SHRINK, F_SEAL_GROW)",
    "memfd sealed but writable": "the memfd is not sealed read-only (missing F_SEAL_WRITE (or F_SEAL_FUTURE_WRITE))",
    "memfd too small": f"the memfd holds {NBYTES // 2} bytes, fewer than the {NBYTES} expected",
    "pipe": "the descriptor is a pipe, not a memfd",
    "socket": "the descriptor is a socket, not a memfd",
    "regular file": "the descriptor is a regular file, not a memfd",
    "directory": "the descriptor is a directory, not a memfd",
}


@pytest.mark.parametrize("kind", [k for k in DESCRIPTOR_KINDS if k != "sealed memfd"])
def test_publish_refuses_a_descriptor_that_is_not_a_sealed_memfd(registry_server, kind):
    request = {"op": "publish", "nbytes": NBYTES, "keys": [[KEY, 0, NBYTES]]}
    with RawClient(registry_server.path) as raw:
        raw.hello()
        fds_before, state_before = fd_kinds(), registry_state(registry_server)
        fd = descriptor(kind, NBYTES)
        reply = raw.ask(request, [fd])
        os.close(fd)
        assert reply == {"error": f"request 'publish': {REFUSALS[kind]}"}
        assert fd_kinds() == fds_before  # the registry closed its copy
        assert registry_state(registry_server) == state_before  # nothing registered
        fd = descriptor("sealed memfd", NBYTES)  # the same connection publishes a real segment
        assert "segment" in raw.ask(request, [fd])
        os.close(fd)
        with RegistryClient(registry_server.path) as client:
            client.hello("m", "cpu", "default")
            (found,) = client.acquire([KEY])
            os.close(found.fd)
            assert found.hits[0].nbytes == NBYTES


def test_a_cuda_segment_that_is_a_socket_is_refused_and_the_lease_ends_with_its_client(registry_server):
    """A CUDA export cannot be inspected, but it is never a socket: kept as a segment, the
    sender's own connection would never hang up, and its lease, with the start-up lock every
    engine of the GPU waits for, would outlive it."""
    raw = RawClient(registry_server.path)
    raw.hello(device="cuda:GPU-0")
    assert raw.ask({"op": "lock", "names": ["startup:cuda:GPU-0"]}).get("granted")
    reply = raw.ask({"op": "publish", "nbytes": 0, "keys": [[KEY, 0, 0]]}, [raw.sock.fileno()])
    assert reply == {"error": "request 'publish': a socket is no CUDA export descriptor"}
    raw.close()
    assert wait_for(lambda: not registry_server.registry.engines and not registry_server.registry.locks, 10)


BAD_FIELDS = [
    ({"op": "hello", "pid": -1, "model": "m", "device": "cpu", "group": "g"},
     "request 'hello' field 'pid' must be between 1 and"),
    ({"op": "hello", "pid": 1, "model": "m" * 5000, "device": "cpu", "group": "g"},
     "request 'hello' field 'model' holds 5000 characters; the limit is 4096"),
    ({"op": "acquire", "keys": [f"k{i}" for i in range(wire.MAX_FDS + 1)]},
     f"request 'acquire': at most {wire.MAX_FDS} keys per request, not {wire.MAX_FDS + 1}"),
    ({"op": "acquire", "keys": ["k"] * 70000}, "request 'acquire' field 'keys' holds 70000 items; the limit is"),
    ({"op": "publish", "nbytes": -8, "keys": [[KEY, 0, 8]]}, "request 'publish' field 'nbytes' must be between 0 and"),
    ({"op": "publish", "nbytes": 2**64, "keys": [[KEY, 0, 8]]}, "field 'nbytes' must be between 0 and"),
    ({"op": "publish", "nbytes": NBYTES, "keys": [[KEY, -1, 8]]}, "field 'keys'[0][1] must be between 0 and"),
    ({"op": "publish", "nbytes": NBYTES, "keys": [[KEY, NBYTES - 4, 8]]},
     f"request 'publish': key 0 ({NBYTES - 4} + 8 bytes) ends past nbytes {NBYTES}"),
    ({"op": "publish", "nbytes": NBYTES, "keys": []}, "request 'publish': no keys"),
    ({"op": "put_recipe", "nbytes": (64 << 20) + 1}, "field 'nbytes' must be between 0 and 67108864"),
    ({"op": "report", "load": {"collisions": "many"}}, "request 'report': load 'collisions' must be an int >= 0"),
    ({"op": "report", "load": {"collisions": -3}}, "request 'report': load 'collisions' must be an int >= 0"),
    ({"op": "report", "load": {"shared_bytes": "x"}}, "request 'report': load 'shared_bytes' must be an int >= 0"),
    ({"op": "report", "load": {f"n{i}": i for i in range(100)}}, "request 'report': load holds 100 entries"),
    # Each report goes into every stats reply: one of 1 MB strings from 17 engines refused stats to all.
    ({"op": "report", "load": {"note": "a" * 5000}}, "request 'report': load 'note' is over 4096 characters"),
    ({"op": "report", "load": {"n": 2**64}}, "request 'report': load 'n' does not fit in 64 bits"),
    ({"op": "lock", "names": ["x" * 5000]}, "field 'names'[0] holds 5000 characters"),
    ({"op": "release", "segments": [1.5]}, "field 'segments'[0] must be int, got float"),
    ({"op": "x" * 100_000}, "unknown op 'xxxxxxxx"),
]


@pytest.mark.parametrize("request_, error", BAD_FIELDS, ids=[f"{r['op'][:10]}-{i}" for i, (r, _) in enumerate(BAD_FIELDS)])
def test_field_values_out_of_range_are_refused_and_change_nothing(published, request_, error):
    with RawClient(published.path) as raw:
        if request_["op"] != "hello":
            raw.hello()
        else:
            raw.ask({"op": "stats"})  # the registry has accepted the connection: its socket is counted
        fds_before, state_before = fd_kinds(), registry_state(published)
        fd = memfd(NBYTES) if request_["op"] in ("publish", "put_recipe") else None
        wire.send(raw.sock, request_, [fd] if fd is not None else [])  # framed as a real client would
        reply, _ = raw.recv()
        if fd is not None:
            os.close(fd)
        assert error in reply["error"] and len(reply["error"]) < 500
        assert registry_state(published) == state_before and fd_kinds() == fds_before
        assert "groups" in raw.ask({"op": "stats"})  # the connection still serves
    assert well_behaved(published) < 2.0


@pytest.mark.parametrize("size", ["1e300", "-4096", "true", '"8"'])
def test_a_recipe_whose_final_sizes_are_not_byte_counts_is_refused(published, size):
    """Its sizes are summed into every later engine's `expected_shared_bytes`: one out of range
    made that reply break the protocol for each of them."""
    key = KEY  # `publisher`'s segment
    writer, reader = RegistryClient(published.path), RegistryClient(published.path)
    try:
        writer.hello("m", "cpu", "default")
        reader.hello("m", "cpu", "default")
        recipe = f'{{"signature": "m", "id": "r1", "final": {{"{key}": {size}}}}}'.encode()
        with pytest.raises(RegistryUnavailable, match="final sizes must be whole numbers of bytes"):
            writer.put_recipe(recipe)
        assert reader.expected_shared_bytes() == 0
        writer.put_recipe(f'{{"signature": "m", "id": "r2", "final": {{"{key}": {NBYTES}}}}}'.encode())
        assert reader.expected_shared_bytes() == NBYTES
        with pytest.raises(RegistryUnavailable, match="signature and id are at most 4096 characters"):
            writer.put_recipe(f'{{"signature": "{"m" * 5000}", "id": "r3", "final": {{}}}}'.encode())
        with RawClient(published.path) as raw:  # 42 bytes said, 64 MiB kept: the budget counts what is kept
            raw.hello()
            data = b'{"signature": "m", "id": "r4", "final": {}}'
            fd = memfd(64 << 20, data=data)
            assert "holds more than" in raw.ask({"op": "put_recipe", "nbytes": len(data)}, [fd])["error"]
            os.close(fd)
    finally:
        writer.close()
        reader.close()


def test_an_error_reply_never_breaks_the_registry(published):
    """An op of 150,000 DEL characters: quoted whole in the error, the reply would be 750 kB."""
    with RawClient(published.path) as raw:
        wire.send(raw.sock, {"op": "\x7f" * 150_000})
        reply, _ = raw.recv()
        assert reply["error"].startswith("unknown op '\\x7f\\x7f") and len(reply["error"]) < 500
    assert well_behaved(published) < 2.0


def test_a_number_no_double_holds_is_refused_and_stats_still_answer(published):
    """``1e400`` reads as infinity, which no stats reply could carry back (``allow_nan=False``):
    kept in an engine's report, it would have broken every engine's stats on the node."""
    with RawClient(published.path) as raw:
        raw.hello()
        assert "1e400 is not a finite number" in raw.ask(b'{"op": "report", "load": {"x": 1e400}}')["error"]
        assert "groups" in raw.ask({"op": "stats"})


def test_empty_and_oversized_datagrams_are_answered_and_the_lease_kept(published):
    with RawClient(published.path) as raw:
        engine = raw.hello()
        assert raw.ask(b"") == {"error": "bad request: empty registry message"}
        reply = raw.ask(b"{" + b" " * (wire.INLINE_MAX + 10) + b"}")  # over the inline limit: truncated
        assert reply["error"].startswith("bad request: registry message truncated")
        reply = raw.ask({"$memfd": 100})  # a carrier without its descriptor
        assert reply["error"] == "bad request: a registry message of 100 bytes announced, but no memfd attached"
        fd = memfd(7, data=b"[1,2,3]")
        assert raw.ask({"$memfd": 7}, [fd])["error"] == "bad request: registry message must be a JSON object, got list"
        os.close(fd)
        fd = memfd(7, seals=0, data=b"{}")
        reply = raw.ask({"$memfd": 7}, [fd])
        assert reply["error"] == ("bad request: a registry message's memfd is refused: the memfd is not sealed read-only "
                                  "(missing F_SEAL_WRITE (or F_SEAL_FUTURE_WRITE), F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL)")
        os.close(fd)
        assert raw.ask(b"[" * 50_000)["error"] == "bad request: registry message is nested too deeply"
        assert raw.ask(b'{"op": "report", "load": {"x": NaN}}')["error"].startswith("bad request: registry message is not JSON (NaN")
        assert engine in {e.id for e in registry_state(published)[2].values()}
        assert raw.ask({"op": "expect"}) == {"bytes": 0}
    assert well_behaved(published) < 2.0


def test_messages_too_big_for_a_datagram_travel_in_a_memfd(published):
    """A reply larger than a datagram can be (the stats of many engines with long names) and a
    request as large (a publish of many keys) both arrive whole."""
    long = "m" * 4000
    clients = [RegistryClient(published.path) for _ in range(60)]
    try:
        for c in clients:
            c.hello(long, "cpu", "default", signature=long)
        stats = RegistryClient(published.path).stats()  # about 500 kB of JSON
        assert len(stats.engines) == 61 and sum(e.model == long for e in stats.engines) == 60
        keys = [(f"{KEY}-{i:05}", i * 2, 2) for i in range(NBYTES // 2)]  # 4096 keys: about 300 kB
        fd = memfd(NBYTES)
        clients[0].publish(fd, NBYTES, keys)
        os.close(fd)
        (found,) = clients[1].acquire([keys[-1][0]])
        os.close(found.fd)
        (hit,) = found.hits
        assert (hit.offset, hit.nbytes) == (NBYTES - 2, 2)
    finally:
        for c in clients:
            c.close()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b, pytest.raises(ProtocolError, match="exceeds the limit"):
        wire.send(a, {"op": "stats", "pad": "x" * wire.MAX_MESSAGE})


def test_the_connection_limit_refuses_newcomers_with_a_clear_error(tmp_path):
    server = RegistryServer(Registry(), tmp_path / "run" / "limit.sock", max_connections=3).start()
    try:
        clients = [RegistryClient(server.path) for _ in range(3)]
        for c in clients:
            c.hello("m", "cpu", "default")
        extra = RegistryClient(server.path)
        with pytest.raises(RegistryUnavailable, match="serving its limit of 3 connections"):
            extra.hello("m", "cpu", "default")
        extra.close()
        clients.pop().close()
        assert wait_for(lambda: len(engine_ids(server)) == 2)
        with RegistryClient(server.path) as late:
            assert late.hello("m", "cpu", "default") > 0
        for c in clients:
            c.close()
    finally:
        server.stop()


def test_a_registry_out_of_descriptors_keeps_serving_and_recovers(published):
    """With no descriptor left in its process, the registry can neither accept a connection nor
    receive a descriptor: the connection waits, the message is answered with an error, and both
    work once descriptors are free again."""
    raw = RawClient(published.path)
    raw.hello()
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    segment = memfd(NBYTES)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(map(int, os.listdir("/proc/self/fd"))) + 1, hard))
        while True:  # take every free number below the limit
            try:
                fillers.append(os.dup(0))
            except OSError:
                break
        waiting.connect(str(published.path))  # queued: the registry cannot accept it now
        time.sleep(0.3)
        reply = raw.ask({"op": "publish", "nbytes": NBYTES, "keys": [[KEY + "x", 0, NBYTES]]}, [segment])
        assert reply["error"].startswith("bad request: registry message truncated")
        assert "descriptors" in reply["error"]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in fillers:
            os.close(fd)
    os.close(segment)
    waiting.settimeout(5)
    waiting.send(b'{"op":"stats"}')
    assert "groups" in json.loads(waiting.recv(1 << 16))
    waiting.close()
    raw.close()
    assert well_behaved(published) < 2.0


def test_a_client_waits_while_the_registry_backlog_is_full(tmp_path):
    """A registry too busy to accept fills its listen backlog; a client connecting meanwhile
    waits until it is accepted instead of failing at once.  A bare listener with a backlog of
    one stands for the busy registry (a real one's backlog takes 4096 connections to fill)."""
    path = tmp_path / "run" / "busy.sock"
    wire.ensure_private_dir(path.parent)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(0)
    first = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    first.connect(str(path))  # the backlog is full now
    accepted = []
    later = threading.Timer(0.3, lambda: accepted.extend(listener.accept()[0] for _ in range(2)))
    later.start()
    start = time.monotonic()
    with RegistryClient(path, timeout_s=10):
        waited = time.monotonic() - start
    later.join()
    assert waited >= 0.25 and len(accepted) == 2
    for s in (*accepted, first, listener):
        s.close()


ACQUIRER_NEAR_ITS_FD_LIMIT = r"""
import json, os, resource, sys, time
from vllm_dedup.registry.client import RegistryClient
client = RegistryClient(sys.argv[1])
client.hello("reader", "cpu", "default")
top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (top + 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    client.acquire(sys.argv[2:])
    error = ""
except Exception as e:
    error = f"{type(e).__name__}: {e}"
print(json.dumps({"error": error, "closed_by_us": str(client.closed_by_us or "")}), flush=True)
time.sleep(60)  # alive: whatever the registry still holds for it, it holds for a live engine
"""


def test_an_acquire_reply_the_engine_cannot_read_holds_nothing_for_it(registry_server):
    """Near its descriptor limit, an engine cannot receive an acquire reply's descriptors (the
    kernel truncates them).  The registry holds those segments for it already; the engine, not
    knowing their ids, could never release them.  It closes the connection instead (Note [a
    reply that cannot be read] in ``client.py``), and the registry lets go of them while the
    engine lives on."""
    owner = RegistryClient(registry_server.path)
    owner.hello("owner", "cpu", "default")
    keys = [f"uint8[4096]/[1]:{i:032x}" for i in range(12)]
    for key in keys:
        fd = memfd(4096)
        owner.publish(fd, 4096, [(key, 0, 4096)])
        os.close(fd)
    reader = subprocess.Popen([sys.executable, "-c", ACQUIRER_NEAR_ITS_FD_LIMIT, str(registry_server.path), *keys],
                              stdout=subprocess.PIPE, text=True)
    try:
        said = json.loads(reader.stdout.readline())
        assert said["error"].startswith("ProtocolError") and "descriptors" in said["error"], said
        assert reader.poll() is None
        # Only the owner's lease is left, and every segment is held once: by the owner.
        wait_for(lambda: len(engine_ids(registry_server)) == 1)
        with registry_server._mutex:
            holds = [len(e.segments) for e in registry_server.registry.engines.values()]
        assert holds == [len(keys)], holds
        assert said["closed_by_us"], said
    finally:
        reader.kill()
        reader.wait()
        owner.close()


def test_an_acquire_whose_reply_cannot_be_sent_hangs_up_and_holds_nothing(registry_server, monkeypatch):
    """An acquire records its holds, then its reply (over 64 KiB of JSON) needs a memfd the
    registry cannot make (out of descriptors or memory: a model, failing on the registry's
    thread only).  An error reply would leave holds the engine was never told of, resident
    for its lifetime; the registry hangs up instead, which drops them with the lease."""
    import errno

    key = "k" * 4000
    owner = RegistryClient(registry_server.path)
    owner.hello("m", "cpu", "default")
    fd = memfd(8192)
    owner.publish(fd, 8192, [(key, 0, 8192)])
    os.close(fd)
    reader = RegistryClient(registry_server.path)
    reader.hello("m", "cpu", "default")
    real = wire.sealed_memfd

    def no_memfd(*args, **kwargs):
        if threading.current_thread().name == "vllm-dedup-registry":
            raise OSError(errno.EMFILE, "Too many open files")
        return real(*args, **kwargs)

    monkeypatch.setattr(wire, "sealed_memfd", no_memfd)
    with pytest.raises(RegistryUnavailable, match="closed the connection|went away"):
        reader.acquire([key] * 20)  # 20 hits of a 4000-character key: an 80 KB reply
    assert wait_for(lambda: len(engine_ids(registry_server)) == 1, 10)
    left = engine_ids(registry_server)
    with registry_server._mutex:
        assert [s.holders for s in registry_server.registry.segments.values()] == [left]
    reader.close()
    owner.close()


@pytest.mark.parametrize("call", ["acquire", "publish"])
def test_a_lease_out_of_descriptors_after_the_registry_recorded_a_hold_leaves_none(published, monkeypatch, call):
    """The registry records the hold before the lease keeps its own descriptor of the segment
    (to re-register it after a registry restart).  Where that ``dup`` fails (EMFILE), the lease
    could neither release nor re-register the hold: it closes its connection, so the registry
    drops it, and no descriptor is left open.  The failing ``dup`` is a model of a process at
    its descriptor limit: it fails in this (the engine's) thread only, never in the registry's."""
    import errno

    from vllm_dedup.registry import lease as lease_module
    from vllm_dedup.registry.lease import Lease

    owner = RegistryClient(published.path)  # a segment with a uid: the kind a lease keeps a descriptor of
    owner.hello("owner", "cpu", "default")
    fd = memfd(NBYTES)
    owner.publish(fd, NBYTES, [("uint8[8192]/[1]:" + "c7" * 16, 0, NBYTES)], uid="d" * 32)
    os.close(fd)
    lease = Lease(RegistryClient(published.path), "reader", "cpu", "default", "sig")
    before = fd_kinds()
    real_dup, engine_thread = os.dup, threading.current_thread()

    def dup(fd):
        if threading.current_thread() is engine_thread:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_dup(fd)

    monkeypatch.setattr(lease_module.os, "dup", dup)
    try:
        with pytest.raises(RegistryUnavailable, match="out of descriptors"):
            if call == "acquire":
                lease.acquire([KEY, "uint8[8192]/[1]:" + "c7" * 16])
            else:
                fd = memfd(NBYTES)
                try:
                    lease.publish(fd, NBYTES, [("uint8[8192]/[1]:" + "b6" * 16, 0, NBYTES)])
                finally:
                    os.close(fd)
        monkeypatch.undo()
        assert wait_for(lambda: len(engine_ids(published)) == 2)  # the reader's connection, and holds, are gone
        with published._mutex:
            holders = [len(s.holders) for s in published.registry.segments.values()]
        assert holders == [1, 1], holders  # each held by its publisher alone
        assert fd_kinds() - before == Counter(), fd_kinds() - before  # nothing of the reply left open
    finally:
        monkeypatch.undo()
        lease.close()
        owner.close()


def test_a_lease_out_of_descriptors_midway_through_an_acquire_keeps_what_it_held_as_it_was(published, monkeypatch):
    """The lease already maps segment A once; an acquire of A and a new segment B fails at B's
    ``dup`` (both have a uid, so the lease keeps a descriptor of each to re-register them).  The
    engine got nothing from that acquire, so the lease must still count one use of A: the
    engine's one release lets it go, also after the watcher re-registered what is held."""
    import errno

    from vllm_dedup.registry import lease as lease_module
    from vllm_dedup.registry.lease import Lease

    owner = RegistryClient(published.path)
    owner.hello("owner", "cpu", "default")
    keys = ["uint8[8192]/[1]:" + digit * 32 for digit in "ab"]
    for key, uid in zip(keys, ("a" * 32, "b" * 32)):
        fd = memfd(NBYTES)
        owner.publish(fd, NBYTES, [(key, 0, NBYTES)], uid=uid)
        os.close(fd)
    lease = Lease(RegistryClient(published.path), "reader", "cpu", "default", "sig")
    (mapped,) = lease.acquire(keys[:1])
    os.close(mapped.fd)
    lease.watch()
    before = lease.reregistrations

    def dup(fd):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(lease_module.os, "dup", dup)
    try:
        with pytest.raises(RegistryUnavailable, match="out of descriptors"):
            lease.acquire(keys)
        monkeypatch.undo()
        assert wait_for(lambda: lease.reregistrations == before + 1)  # the watcher gave the registry what is held
        lease.release([mapped.segment])  # the engine's one use
        assert wait_for(lambda: engine_holds(published, lease.engine_id) == 0), "the reader still holds A"
        with published._mutex:
            holders = sorted(len(s.holders) for s in published.registry.segments.values())
        assert holders == [1, 1, 1], holders  # each held by its publisher alone
    finally:
        monkeypatch.undo()
        lease.close()
        owner.close()


def engine_holds(server: RegistryServer, engine_id: int) -> int:
    """How many segments the registry records engine ``engine_id`` as holding."""
    with server._mutex:
        return sum(engine_id in s.holders for s in server.registry.segments.values())


def test_an_acquire_of_many_round_trips_that_fails_leaves_no_hold(published, monkeypatch):
    """An acquire of more keys than one reply can carry descriptors for goes in round trips,
    and the registry records each one's holds as it answers.  A key the registry would refuse
    (a recipe is a peer's input) is found before anything is sent; a later round trip the
    registry refuses all the same (here a registry whose `acquire` raises on the second one, a
    model of one stricter than this client) closes the connection, so that the registry drops
    the earlier holds nobody could release."""
    many = [KEY] * wire.MAX_FDS
    reader = RegistryClient(published.path)
    reader.hello("reader", "cpu", "default")
    before = fd_kinds()

    def holders() -> list[int]:
        with published._mutex:
            return [len(s.holders) for s in published.registry.segments.values()]

    with pytest.raises(ProtocolError, match="5000 characters"):
        reader.acquire([*many, "k" * 5000])
    assert holders() == [1] and reader.closed_by_us is None  # nothing sent: the connection goes on
    (found,) = reader.acquire([KEY])
    os.close(found.fd)
    reader.release([found.segment])

    real, calls = published.registry.acquire, []

    def refuses_the_second(engine_id, keys, uids=None):
        calls.append(len(keys))
        if len(calls) == 2:
            raise ValueError("refused by a stricter registry")
        return real(engine_id, keys, uids)

    monkeypatch.setattr(published.registry, "acquire", refuses_the_second)
    with pytest.raises(RegistryUnavailable, match="stricter registry"):
        reader.acquire([*many, KEY])
    assert calls == [wire.MAX_FDS, 1] and reader.closed_by_us is not None
    assert wait_for(lambda: len(engine_ids(published)) == 1)  # the reader's lease, and its holds, are gone
    assert holders() == [1]
    assert fd_kinds() - before == Counter(), fd_kinds() - before
    reader.close()
