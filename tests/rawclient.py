"""Tools for the hostile-client tests of the registry (tests/integration/test_hostile_clients.py,
test_protocol_fuzz.py): a client that obeys nothing, descriptors of every kind to attach, and
views of the registry's process (the test process) to prove that nothing leaked or changed.
"""

from __future__ import annotations

import copy
import fcntl
import os
import socket
import tempfile
import time
from collections import Counter
from pathlib import Path


from helpers import wait_for
from harness.procs import fd_targets
from vllm_dedup.registry import wire
from vllm_dedup.registry.client import RegistryClient
from vllm_dedup.registry.server import RegistryServer

ALL_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
KEY = "uint8[8192]/[1]:" + "a5" * 16  # the content key of the segment `publisher` publishes
NBYTES = 8192


class RawClient:
    """One connection to a registry that sends whatever bytes and descriptors it is given: none of
    `RegistryClient`'s checks stand between a test and the server.  Replies are read with the real
    framing (`wire.recv`)."""

    def __init__(self, path: Path, timeout_s: float = 5.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(timeout_s)
        self.sock.connect(str(path))

    def send(self, payload: bytes | dict, fds=()) -> None:
        """``payload`` as one datagram of these bytes, or a dict framed as a real client would
        (`wire.frame`: large JSON travels in a memfd), but with any number of ``fds``."""
        data, carrier = (payload, None) if isinstance(payload, bytes) else wire.frame(payload, wire.MAX_REPLY)
        try:
            socket.send_fds(self.sock, [data], [*fds, carrier] if carrier is not None else list(fds))
        finally:
            if carrier is not None:
                os.close(carrier)

    def recv(self) -> tuple[dict | None, list[int]]:
        return wire.recv(self.sock)

    def ask(self, payload: bytes | dict, fds=()) -> dict | None:
        """Send one message and return the reply (None: the registry hung up); descriptors that
        came with the reply are checked to be memfds and closed."""
        self.send(payload, fds)
        reply, got = self.recv()
        kinds = [fd_kind(fd) for fd in got]
        for fd in got:
            os.close(fd)
        assert all(k == "memfd" for k in kinds), f"a reply carried descriptors of kinds {kinds}"
        return reply

    def hello(self, group: str = "default", device: str = "cpu") -> int:
        reply = self.ask({"op": "hello", "pid": os.getpid(), "model": "raw", "device": device, "group": group})
        return reply["engine"]

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def target_kind(target: str) -> str:
    """What a descriptor is, from its ``/proc/PID/fd`` link: socket, pipe, memfd, anon_inode, or file."""
    if target.startswith("/memfd:"):
        return "memfd"
    if target.startswith("/"):
        return "file"
    return target.split(":", 1)[0]


def fd_kind(fd: int | str) -> str:
    """What a descriptor of this process is (`target_kind`)."""
    return target_kind(os.readlink(f"/proc/self/fd/{fd}"))


def fd_kinds() -> Counter:
    """This process's open descriptors, counted by kind (`target_kind`).  The registry runs in the
    test process, so its sockets and segment descriptors are among them."""
    return Counter(target_kind(t) for t in fd_targets())


def publisher(server: RegistryServer) -> RegistryClient:
    """An engine connected to ``server`` holding a published segment of ``KEY`` (``NBYTES``
    bytes) until it is closed."""
    client = RegistryClient(server.path)
    client.hello("publisher", "cpu", "default")
    fd = memfd(NBYTES)
    client.publish(fd, NBYTES, [(KEY, 0, NBYTES)])
    os.close(fd)
    return client


def well_behaved(server: RegistryServer, timeout_s: float = 5.0) -> float:
    """A normal client's stats, hello and acquire of ``KEY``, each answered; returns the seconds
    they took, once the registry has let the client's lease go."""
    start = time.monotonic()
    with RegistryClient(server.path, timeout_s=timeout_s) as client:
        client.stats()
        engine = client.hello("good", "cpu", "default")
        (found,) = client.acquire([KEY])
        (hit,), fd = found.hits, found.fd
        kind = fd_kind(fd)
        os.close(fd)
        assert hit.nbytes == NBYTES and kind == "memfd"
    took = time.monotonic() - start
    assert wait_for(lambda: engine not in engine_ids(server), timeout_s=10, poll_s=0.001)
    return took


def engine_ids(server: RegistryServer) -> set[int]:
    """The ids of the engines the registry knows now."""
    with server._mutex:
        return set(server.registry.engines)


def registry_state(server: RegistryServer):
    """A deep copy of everything the registry holds, taken under the server's lock."""
    reg = server.registry
    with server._mutex:
        return copy.deepcopy((reg.segments, reg.index, reg.engines, reg.locks, reg.recipes, reg.collisions))


def memfd(nbytes: int, seals: int = ALL_SEALS, allow_sealing: bool = True, data: bytes | None = None) -> int:
    """A memfd of ``nbytes`` bytes holding ``data`` (default: a pattern) with ``seals`` added."""
    fd = os.memfd_create("hostile-test", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if allow_sealing else 0))
    os.ftruncate(fd, nbytes)
    os.pwrite(fd, bytes(range(256)) * (min(nbytes, 4096) // 256) if data is None else data, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def descriptor(kind: str, nbytes: int = 8192) -> int:
    """A descriptor of one kind (`DESCRIPTOR_KINDS`); only ``sealed memfd`` is a valid segment."""
    if kind == "sealed memfd":
        return memfd(nbytes)
    if kind == "unsealed memfd":
        return memfd(nbytes, seals=0)
    if kind == "memfd without sealing":
        return memfd(nbytes, seals=0, allow_sealing=False)
    if kind == "memfd sealed but writable":
        return memfd(nbytes, seals=ALL_SEALS & ~fcntl.F_SEAL_WRITE)
    if kind == "memfd too small":
        return memfd(nbytes // 2)
    if kind == "pipe":
        r, w = os.pipe()
        os.close(w)
        return r
    if kind == "socket":
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        b.close()
        return a.detach()
    if kind == "regular file":
        fd, name = tempfile.mkstemp()
        os.unlink(name)
        os.pwrite(fd, bytes(nbytes), 0)
        return fd
    if kind == "directory":
        return os.open(tempfile.gettempdir(), os.O_RDONLY | os.O_DIRECTORY)
    raise ValueError(kind)


DESCRIPTOR_KINDS = ("sealed memfd", "unsealed memfd", "memfd without sealing", "memfd sealed but writable",
                    "memfd too small", "pipe", "socket", "regular file", "directory")
