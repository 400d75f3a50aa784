"""Something at the registry's socket that answers wrong (a registry of another vllm-dedup
version, a bug, a hostile process of the same user): the engine's client raises
`ProtocolError` (a `RegistryUnavailable`: the engine loads privately, or stops under
``on_registry_error="fail"``), never another exception, and closes every descriptor it got.

The "registry" here is a real socket served by a thread of the test process that answers each
request with a reply the test crafted.  (Hostile clients against the real registry:
test_hostile_clients.py.)
"""

from __future__ import annotations

import os
import re
import socket
import threading

import pytest

from rawclient import fd_kinds, memfd
from vllm_dedup.errors import ProtocolError
from vllm_dedup.registry import wire
from vllm_dedup.registry.client import RegistryClient
from vllm_dedup.registry.messages import MAX_RECIPE_BYTES
from vllm_dedup.registry.state import Registry


class Answering:
    """A socket at ``path`` that answers every request with ``replies``' next (reply, fds)."""

    def __init__(self, path, replies: list[tuple[dict, list[int]]]):
        wire.ensure_private_dir(path.parent)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.replies = replies
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            for reply, fds in self.replies:
                _, got = wire.recv(conn)
                for fd in got:
                    os.close(fd)
                wire.send(conn, reply, fds)
                for fd in fds:
                    os.close(fd)
            wire.recv(conn)  # until the client closes

    def close(self) -> None:
        """Once the client has closed: the thread is done, every descriptor it sent closed."""
        self.thread.join(5)
        self.listener.close()


@pytest.fixture
def answering(tmp_path):
    """``answering(*replies)``: a client connected to an `Answering` socket; ``answering.done()``
    closes them both."""
    made = []

    def start(*replies):
        made.append(Answering(tmp_path / "run" / "registry.sock", list(replies)))
        made.append(RegistryClient(made[-1].listener.getsockname(), timeout_s=5))
        return made[-1]

    def done():
        for thing in reversed(made):
            thing.close()
        made.clear()

    start.done = done
    yield start
    done()


KEY = "0" * 32 + ":bfloat16:8:1"
BAD_ACQUIRES = [
    ({"hits": [[KEY, 7, 0, 8]], "segments": [3], "uids": ["u"], "sizes": [8]}, 1, "is not inside a segment"),
    ({"hits": [[KEY, 3, 4, 8]], "segments": [3], "uids": ["u"], "sizes": [8]}, 1, "is not inside a segment"),
    ({"hits": [[KEY, 3, 0, 8]], "segments": [3, 4], "uids": ["u", "v"], "sizes": [8, 8]}, 2, "segment 4 has no hit"),
    ({"hits": [[KEY, 3, 0, 8]], "segments": [3], "uids": ["u", "v"], "sizes": [8]}, 1, "1 segments (distinct?), 2 uids"),
    ({"hits": [[KEY, 3, 0, 8]], "segments": [3], "uids": ["u"], "sizes": [8]}, 2, "2 descriptors for 1 segments"),
    ({"hits": [[KEY, 3, 0, 8]], "segments": [3], "uids": ["u"], "sizes": [-8]}, 1, "must be between 0 and"),
]


@pytest.mark.parametrize("reply, nfds, error", BAD_ACQUIRES, ids=[e.split()[-1] for _, _, e in BAD_ACQUIRES])
def test_an_acquire_reply_that_does_not_add_up_is_refused_and_its_descriptors_closed(answering, reply, nfds, error):
    before = fd_kinds()["memfd"]
    client = answering((reply, [memfd(4096) for _ in range(nfds)]))
    with pytest.raises(ProtocolError, match=re.escape(error)):
        client.acquire([KEY])
    answering.done()
    assert fd_kinds()["memfd"] == before  # every memfd received is closed


@pytest.mark.parametrize("call, reply", [("hello", {"engine": 1}), ("lock", {"granted": True}), ("release", {})])
def test_descriptors_on_a_reply_that_carries_none_are_closed_and_the_connection_too(answering, call, reply):
    """A registry that attaches descriptors where none belong (a lock wait asks 20 times a
    second) would fill the engine's descriptor table, and the engine could open no checkpoint."""
    before = fd_kinds()["memfd"]
    client = answering((reply, [memfd(4096) for _ in range(5)]))
    with pytest.raises(ProtocolError, match="a reply that carries no descriptors came with 5"):
        {"hello": lambda: client.hello("m", "cpu", "g"), "lock": lambda: client.lock("publish:cpu:g"),
         "release": lambda: client.release([1])}[call]()
    with pytest.raises(ProtocolError, match="an earlier request"):  # the connection is closed
        client.expected_shared_bytes()
    answering.done()
    assert fd_kinds()["memfd"] == before


def test_stats_of_another_version_are_a_protocol_error_and_new_fields_are_left_out(answering):
    stats = Registry().stats().to_dict()
    newer = {**stats, "groups": [{"device": "cpu", "share_group": "g", "new_figure": 1}], "added": True}
    older = {k: v for k, v in stats.items() if k != "keep_warm_s"}
    client = answering((newer, []), (older, []), ({**stats, "groups": [["cpu"]]}, []))
    assert [g.device for g in client.stats().groups] == ["cpu"]
    with pytest.raises(ProtocolError, match="(?s)answered stats this version cannot read.*KeyError"):
        client.stats()
    with pytest.raises(ProtocolError, match="answered stats this version cannot read"):
        client.stats()


@pytest.mark.parametrize("size", [MAX_RECIPE_BYTES + 1, -5])
def test_a_recipe_size_no_recipe_can_have_is_refused(answering, size):
    """A recipe is read whole into the engine's memory: a size past `MAX_RECIPE_BYTES` (a sparse
    memfd of a TiB) would raise MemoryError out of the fast path's decision."""
    client = answering(({"sizes": [size]}, [memfd(4096)]))
    with pytest.raises(ProtocolError, match="must be between 0 and"):
        client.get_recipes("sig")


def test_a_negative_expected_share_is_refused(answering):
    client = answering(({"bytes": -(1 << 30)}, []))
    with pytest.raises(ProtocolError, match="'bytes' must be between 0 and"):
        client.expected_shared_bytes()


def test_an_empty_memfd_is_refused_and_its_descriptor_closed_once():
    """A peer's empty sealed memfd published for a 0-byte hit: ``mmap`` refuses it with a
    ValueError, which must be a `SegmentError` with the descriptor closed by `attach` alone
    (its caller, `resident.map_resident`, closes nothing of its own: a second close could hit
    a descriptor another thread has opened meanwhile)."""
    from vllm_dedup.errors import SegmentError
    from vllm_dedup.segments.host import HostSegment

    fd = memfd(0, data=b"")
    with pytest.raises(SegmentError, match="cannot map a 0-byte memfd segment"):
        HostSegment.attach(fd, 0)
    with pytest.raises(OSError):
        os.fstat(fd)
