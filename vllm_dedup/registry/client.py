"""A connection to the registry: `RegistryClient`, one method per request of `messages.py`.

For an engine, the connection is its lease (docs/architecture.md, "Registry"): keep the client
open as long as the engine maps shared tensors; when it closes, however the engine ended, the
registry drops the engine's references and locks.

Note [a reply that cannot be read]
    The registry acts on a request before it answers: by the time an acquire's reply is sent,
    the engine holds every segment in it.  A reply this side cannot read (truncated because
    its descriptors would pass this process's ``RLIMIT_NOFILE``, not JSON, a field out of its
    limits, descriptors that do not match its segments) leaves holds the engine cannot name,
    so it could never release them: those segments would stay resident as long as the engine
    lives.  So the connection is closed (`RegistryClient.abandon`), as after a timeout: the
    registry drops everything it recorded for it, and the lease's watcher re-registers what
    the engine does hold on a new connection.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ProtocolError, RegistryRefused, RegistryTimeout, RegistryUnavailable
from . import messages as m
from . import wire
from .state import Hit, RegistryStats

__all__ = ["RegistryClient", "SegmentHits", "registry_answers", "registry_stats", "shutdown_registry"]

# The replies that come with descriptors (one per segment hit, one per recipe: messages.py);
# any other reply that does is refused, its descriptors closed.
_REPLIES_WITH_DESCRIPTORS = (m.AcquireReply, m.RecipesReply)


@dataclass
class SegmentHits:
    """One segment an acquire found keys in: its id, uid and size in bytes, a descriptor of it
    (the caller's to close), and the hits in it."""

    segment: int
    uid: str
    nbytes: int
    fd: int
    hits: list[Hit] = field(default_factory=list)


class RegistryClient:
    """One connection to a registry's socket.

    Args:
        path: the socket (`wire.socket_path`).
        timeout_s: seconds to wait for any one reply.  A registry that does not answer in time
            (hung, SIGSTOPped) costs one such wait: the connection is closed then, and every
            later call fails at once.

    Attributes:
        closed_by_us: why this side closed the connection, else None: a `RegistryTimeout` (a
            reply did not come within ``timeout_s``) or a `ProtocolError` (a reply it could not
            read, Note [a reply that cannot be read]).  Every later call raises the same type.

    Raises (the constructor and every method):
        RegistryUnavailable: cannot connect, refused, the registry went away or answered an
            error (`ProtocolError`, a subclass, when a request cannot be sent as given: a field
            out of its limits, too big, or a reply that broke the protocol; `RegistryTimeout`,
            another, when no reply came within ``timeout_s``).
    """

    def __init__(self, path: Path, timeout_s: float = 30.0):
        self.path = Path(path)
        self.timeout_s = timeout_s
        self.closed_by_us: RegistryUnavailable | None = None
        self._address = wire.socket_address(self.path)
        wire.ensure_private_dir(self.path.parent, create=False)
        try:
            info = os.lstat(self.path)
            if stat.S_ISLNK(info.st_mode) or info.st_uid != os.getuid():
                raise RegistryUnavailable(f"{self.path} is a symlink or not ours; refusing to connect")
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._sock.settimeout(timeout_s)
            self._connect(timeout_s)
        except RegistryUnavailable:
            raise
        except FileNotFoundError:
            raise RegistryUnavailable(f"no registry serves {self.path}") from None
        except OSError as e:
            raise RegistryUnavailable(f"cannot connect to the registry at {self.path}: {e}") from None
        self._lock = threading.Lock()
        self.engine_id: int | None = None
        self.group: str | None = None  # the share group said in `hello`

    def _connect(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._sock.connect(self._address)
                return
            except BlockingIOError:  # the listen backlog is full: the registry is busy accepting others
                if time.monotonic() > deadline:
                    raise RegistryUnavailable(f"the registry at {self.path} accepted no connection within "
                                              f"{timeout_s:.0f} s (its backlog stayed full)") from None
                time.sleep(0.01)

    def _parting_words(self) -> str | None:
        """The error the registry left before it closed this connection, if any (it closes one it
        will not serve, e.g. over its connection limit)."""
        self._sock.setblocking(False)
        for _ in range(2):  # the first read may report the reset itself
            try:
                reply, fds = wire.recv(self._sock, wire.MAX_REPLY)
            except (ConnectionError, ProtocolError):
                continue
            except OSError:
                return None
            for fd in fds:
                os.close(fd)
            return reply.get("error") if reply else None
        return None

    def _call(self, request: m.Message, reply_type: type[m.Message] | None, fds: list[int] = ()):
        """Send ``request``, return ``(reply, descriptors)``; ``reply`` is a ``reply_type``
        (or the raw dict when None).  The caller owns the descriptors."""
        with self._lock:
            if self.closed_by_us is not None:
                raise type(self.closed_by_us)(f"{self.closed_by_us} (an earlier request)")
            try:
                wire.send(self._sock, request.to_wire(), fds)  # ProtocolError: nothing was sent
                try:
                    reply, got = wire.recv(self._sock, wire.MAX_REPLY)
                except ProtocolError as e:
                    self.abandon(str(e))
                    raise
            except ProtocolError:
                raise
            except TimeoutError:
                # A late reply must never be read as the answer to a later request: close.
                raise self._close_because(RegistryTimeout(
                    f"the registry at {self.path} did not answer within {self.timeout_s:g} s (hung or stopped?); "
                    "this connection is closed")) from None
            except OSError as e:
                if isinstance(e, ConnectionError) and (parting := self._parting_words()) is not None:
                    raise RegistryUnavailable(f"registry at {self.path}: {parting}") from None
                raise RegistryUnavailable(f"registry at {self.path} went away: {e}") from None
        if reply is None:
            raise RegistryUnavailable(f"registry at {self.path} closed the connection")
        try:
            if "error" in reply:
                raise RegistryRefused(f"registry at {self.path}: {reply['error']}")
            if got and reply_type not in _REPLIES_WITH_DESCRIPTORS:  # each would stay open here
                self.abandon(f"a reply that carries no descriptors came with {len(got)}")
                raise self.closed_by_us
            try:
                return (reply_type.from_wire(reply) if reply_type else reply), got
            except ProtocolError as e:
                self.abandon(str(e))
                raise
        except BaseException:
            for fd in got:
                os.close(fd)
            raise

    def abandon(self, why: str) -> None:
        """Close this connection because of a reply it could not read (``why``): Note [a reply
        that cannot be read].  Every later call fails at once."""
        self._close_because(ProtocolError(f"registry at {self.path}: {why}; this connection is closed"))

    def _close_because(self, error: RegistryUnavailable) -> RegistryUnavailable:
        self.closed_by_us = error
        self._sock.close()
        return error

    def hello(self, model: str, device: str, group: str, signature: str = "") -> int:
        """Make this connection an engine's lease.  ``device`` is a device key
        (`Segment.device_key`); ``signature`` names what decides the engine's tensors' bytes
        (default: ``model``), for `expected_shared_bytes`.  Returns the engine id."""
        reply, _ = self._call(m.Hello(os.getpid(), model, device, group, signature), m.HelloReply)
        self.engine_id, self.group = reply.engine, group
        return self.engine_id

    def expected_shared_bytes(self) -> int:
        """Bytes of this engine's tensors predicted to be resident already (bytes; 0 when no
        engine with its signature has reported; `Registry.expected_shared_bytes`)."""
        return self._call(m.Expect(), m.ExpectReply)[0].bytes

    def acquire(self, keys: list[str], uids: list[str] | None = None) -> list[SegmentHits]:
        """Look up ``keys`` (with ``uids``, one per key: each only in the segment of that uid;
        one round trip per `wire.MAX_FDS` keys); returns the hits grouped by segment, one
        descriptor each (the caller owns them).  The registry holds every segment returned until
        `release`.  Every round trip's request is checked as the registry will check it before
        the first is sent; when a later round trip fails all the same, the descriptors of the
        earlier ones are closed and, the registry having recorded their holds, so is this
        connection (Note [a reply that cannot be read]), unless the registry hung up: its holds
        went with it, and `hung_up` stays true for the caller's recovery (`lease.Lease._call`)."""
        requests = [m.Acquire(keys[s:s + wire.MAX_FDS], list(uids[s:s + wire.MAX_FDS]) if uids else [])
                    for s in range(0, len(keys), wire.MAX_FDS)]
        for request in requests:  # ProtocolError: a key or uid the registry would refuse; nothing sent
            m.Acquire.from_wire(request.to_wire())
        out: dict[int, SegmentHits] = {}
        done = 0
        try:
            for request in requests:
                reply, fds = self._call(request, m.AcquireReply)
                done += 1
                if len(fds) != len(reply.segments):
                    for fd in fds:
                        os.close(fd)
                    why = f"{len(fds)} descriptors for {len(reply.segments)} segments in an acquire reply"
                    self.abandon(why)
                    raise ProtocolError(f"registry at {self.path}: {why}")
                for seg, fd, uid, size in zip(reply.segments, fds, reply.uids, reply.sizes):
                    if seg in out:  # held already through an earlier chunk
                        os.close(fd)
                    else:
                        out[seg] = SegmentHits(seg, uid, size, fd)
                for key, seg, offset, nbytes in reply.hits:
                    found = out[seg]
                    found.hits.append(Hit(key, seg, offset, nbytes, found.uid, found.nbytes))
        except BaseException as e:
            for found in out.values():
                os.close(found.fd)
            if done and self.closed_by_us is None and self._sock.fileno() >= 0 and not self.hung_up():
                self.abandon(f"acquire round trip {done + 1} failed after {done} recorded holds ({e})")
            raise
        return list(out.values())

    def publish(self, fd: int, nbytes: int, keys: list[tuple[str, int, int]], uid: str = "") -> int:
        """Publish a segment (its descriptor ``fd``, ``nbytes`` usable bytes) holding
        ``(content key, offset, bytes)`` tensors; returns its id.  ``uid`` names the segment
        across registry restarts (`messages.Publish`).  The caller keeps ``fd``."""
        return self._call(m.Publish(nbytes, list(keys), uid), m.PublishReply, [fd])[0].segment

    def release(self, segments: list[int]) -> None:
        self._call(m.Release(list(segments)), m.Empty)

    def report(self, load: dict) -> None:
        self._call(m.Report(load), m.Empty)

    def put_recipe(self, data: bytes) -> None:
        """Give the registry a recipe (its JSON bytes; `engine.recipe.Recipe.to_bytes`).

        Raises:
            SegmentError: no memfd could be made for it.
            RegistryUnavailable: as every method (a malformed recipe is refused).
        """
        from ..segments.host import HostSegment

        seg = HostSegment.from_bytes(data)
        try:
            self._call(m.PutRecipe(len(data)), m.Empty, [seg.fileno()])
        finally:
            seg.close_fd()

    def get_recipes(self, signature: str) -> list[bytes]:
        """The recipes' JSON bytes kept for ``signature`` in this engine's share group, newest
        first (none: an empty list).

        Raises:
            SegmentError: a received descriptor is not a sealed memfd.
            RegistryUnavailable: as every method.
        """
        from ..segments.host import HostSegment

        reply, fds = self._call(m.GetRecipes(signature), m.RecipesReply)
        out = []
        try:
            for i, (fd, size) in enumerate(zip(fds, reply.sizes)):
                fds[i] = -1
                out.append(HostSegment.attach(fd, size).read())
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
        return out

    def stats(self) -> RegistryStats:
        """The registry's `state.RegistryStats`.

        Raises:
            ProtocolError: the reply is not stats this version reads (a registry of another
                vllm-dedup version: stop it, and the next engine starts one of its own).
            RegistryUnavailable: as every method.
        """
        reply = self._call(m.Stats(), None)[0]
        try:
            return RegistryStats.from_dict(reply)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProtocolError(f"registry at {self.path} answered stats this version cannot read "
                                f"({type(e).__name__}: {e}); is it of another vllm-dedup version? Stop it "
                                "(vllm-dedup status shows its pid) and the next engine starts a new one") from None

    def lock(self, names: str | list[str], owner: str | None = None, timeout_s: float = 600.0,
             poll_s: float = 0.05, reclaim: bool = False) -> None:
        """Take registry locks ``names``, all or none (`Registry.try_lock`; needs `hello` first).

        Waiting polls (``poll_s``) rather than blocking in the registry, so a waiter never
        stalls other requests and a timed-out waiter leaves no reply behind.  A lock whose
        holder dies is free at once: it goes with the holder's connection.

        Args:
            names: one lock name or several.
            owner: connections passing the same owner share the locks (TP ranks of one engine).
            timeout_s: give up after this many seconds (0: one try).
            reclaim: these locks were held in a registry that died (`registry.lease`).

        Raises:
            TimeoutError: still held by another engine after ``timeout_s`` (the message names its
                pid), or refused that long by a restarted registry waiting for reclaims.
            RegistryUnavailable: as every method.
        """
        names = [names] if isinstance(names, str) else list(names)
        deadline = time.monotonic() + timeout_s
        while True:
            reply, _ = self._call(m.Lock(names, owner, reclaim), m.LockReply)
            if reply.granted:
                return
            if time.monotonic() >= deadline:
                why = ("the registry, restarted, is waiting for engines to reclaim their locks" if reply.recovering
                       else f"still held by engine pid {reply.holder_pid}")
                raise TimeoutError(f"registry lock(s) {', '.join(names)}: {why} after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def unlock(self, names: str | list[str]) -> None:
        """Give locks back; a registry that is gone took them with it (no error then)."""
        try:
            self._call(m.Unlock([names] if isinstance(names, str) else list(names)), m.Empty)
        except RegistryUnavailable:
            pass

    @contextlib.contextmanager
    def locked(self, names: str | list[str], owner: str | None = None, timeout_s: float = 600.0,
               poll_s: float = 0.05):
        """Hold registry locks for the ``with`` block (see `lock`, whose errors it raises)."""
        self.lock(names, owner, timeout_s, poll_s)
        try:
            yield
        finally:
            self.unlock(names)

    def shutdown(self, force: bool = False) -> None:
        """Stop the registry (refused while engines are connected, unless ``force``)."""
        self._call(m.Shutdown(force), m.ShutdownReply)

    @property
    def registry_pid(self) -> int:
        """The pid of the process serving this registry (the one that listened on its socket:
        ``SO_PEERCRED``, `wire.peer_pid`; 0 where it is not visible from here).  Unlike
        `stats`, it costs no request, so it works whatever the size of the registry's state."""
        return wire.peer_pid(self._sock)

    def hung_up(self) -> bool:
        """Whether the registry closed this connection (it died, or dropped this client); False
        for a connection this client closed itself (`close`, or after a timeout)."""
        if self.closed_by_us is not None or self._sock.fileno() < 0:
            return False
        poller = select.poll()
        poller.register(self._sock, select.POLLRDHUP)
        return any(ev & (select.POLLHUP | select.POLLRDHUP | select.POLLERR) for _, ev in poller.poll(0))

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def registry_stats(path: Path | None = None) -> RegistryStats:
    """`Registry.stats` of the registry at ``path`` (default: this node's, default namespace).

    Raises:
        RegistryUnavailable: no registry answers there.
    """
    with RegistryClient(path or wire.socket_path(), timeout_s=10) as client:
        return client.stats()


def registry_answers(path: Path) -> bool:
    """Whether a registry answers on ``path`` now (a connection made and closed, 5 s at most)."""
    try:
        RegistryClient(path, timeout_s=5).close()
        return True
    except RegistryUnavailable:
        return False


def shutdown_registry(path: Path | None = None) -> bool:
    """Stop the registry at ``path`` even with engines connected; False if none answered."""
    try:
        with RegistryClient(path or wire.socket_path(), timeout_s=10) as client:
            client.shutdown(force=True)
        return True
    except RegistryUnavailable:
        return False
