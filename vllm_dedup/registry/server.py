"""The registry behind its Unix socket: `RegistryServer` serves a `state.Registry` to engines.

Messages are `messages.py`'s, framing `wire.py`'s.  Each request type has one handler in a dispatch
table (`RegistryServer._handlers`); a bad request is answered with an error and the connection
stays usable, so one broken client never takes the registry down for the others.

Hostile and broken clients (tests/integration/test_hostile_clients.py, test_protocol_fuzz.py):

- replies never block the serving thread: sockets are non-blocking, and a reply the kernel
  cannot take yet waits in the connection's queue.  An honest client reads each reply before
  its next request, so a queue over `MAX_PENDING_REPLIES` means a client that does not read: it
  is dropped (its lease with it);
- a published descriptor is checked before it is kept: a host segment must be a memfd sealed
  read-only of at least ``nbytes`` (`segments.host.check_sealed_memfd`).  A segment of a
  ``cuda:*`` device is a CUDA export descriptor the registry cannot inspect; there the share
  group is the isolation (an engine only ever maps what engines of its own group published)
  and the importer maps it read-only.  A socket is refused there: kept as a segment, the
  sender's own connection (or a socket keeping it open) would never hang up, and the lease,
  its locks and holds would outlive the engine;
- descriptors of a rejected message are all closed; an error never echoes more than a few dozen
  characters of what the peer sent;
- connections are limited (``max_connections``): a newcomer over the limit is told so and
  closed.  Out of descriptors, the listener pauses instead of failing; connections wait in the
  listen backlog meanwhile.

Lease: an engine keeps one connection open for its lifetime (an engine of the user's own process:
while its model lives, `engine.session.EngineSession.hold`).  When it closes, for whatever
reason (exit, crash, SIGKILL), the kernel closes the socket and the server drops that engine's
references (`Registry.drop_engine`).  A server that finds a dead registry's socket where it
starts (a clean stop removes it) replaces that registry: for ``reclaim_grace_s`` it grants locks
only to engines reclaiming those they held (`Registry.begin_reclaim`).

The same server runs inside the Ray actor (`ray_actor.py`) and in the standalone daemon
(`daemon.py`).
"""

from __future__ import annotations

import json
import os
import resource
import select
import selectors
import socket
import stat
import threading
import time
from collections import deque
from pathlib import Path

from ..errors import ProtocolError, RegistryUnavailable, SegmentError
from ..log import init_logger
from ..segments.host import check_sealed_memfd
from . import messages as m
from . import wire
from .state import RECLAIM_GRACE_S, Registry, RegistryStats

__all__ = ["RegistryServer"]

logger = init_logger(__name__)

MAX_PENDING_REPLIES = 4  # replies waiting for a client beyond what the kernel buffers for it
ACCEPT_PAUSE_S = 0.2  # out of descriptors: how long the listener rests before trying again
EXPIRE_EVERY_S = 0.5
SELECT_TIMEOUT_S = 0.1  # how soon the loop sees `stop` and a paused listener's time is up


def raise_descriptor_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (at most 2**20) and return
    the soft limit now.  For a process that serves a registry and nothing else (the daemon, the
    Ray actor): every segment published keeps one of its descriptors (a CPU engine publishes one
    per tensor, so a few models pass the 1024 an engine started from a script often has, and the
    registry would stop accepting connections).  A limit that cannot be raised stays as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target


def default_max_connections() -> int:
    """Half of this process's descriptors (``RLIMIT_NOFILE``), at most 4096: the other half
    holds segments and the descriptors of replies in flight."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(16, min(4096, (soft if soft != resource.RLIM_INFINITY else 1 << 20) // 2))


class RegistryServer:
    """Serves a `Registry` on a Unix socket from one background thread.

    One thread serves the socket and handles requests one at a time; `stats` may be called
    from other threads (the Ray actor's, the metrics exporter), so every access to the registry
    holds ``self._mutex``.  Unheld segments are expired about twice a second.

    Args:
        registry: the state to serve.
        path: the socket path; its directory must be private (see `wire.ensure_private_dir`).
        max_connections: connections served at once (default: `default_max_connections`).
        reclaim_grace_s: when the socket found at start is a dead registry's, seconds during
            which only reclaimed locks are granted (`Registry.begin_reclaim`).
    """

    def __init__(self, registry: Registry, path: Path, max_connections: int | None = None,
                 reclaim_grace_s: float = RECLAIM_GRACE_S, awaited_pid: int | None = None):
        self.registry = registry
        self.path = Path(path)
        self.reclaim_grace_s = reclaim_grace_s
        self.max_connections = max_connections or default_max_connections()
        self._sel = selectors.DefaultSelector()
        self._connections: dict[socket.socket, int | None] = {}  # -> engine id, None before hello
        self._refused: set[socket.socket] = set()
        # replies the kernel could not take yet: (datagram, descriptors owned by the queue)
        self._outbox: dict[socket.socket, deque[tuple[bytes, list[int]]]] = {}
        self._accept_paused_until: float | None = None
        self._next_expire = 0.0
        self._stop = threading.Event()
        self._mutex = threading.Lock()
        self._thread: threading.Thread | None = None
        self.idle_since = time.monotonic()
        # The engine that launched this registry: not idle before its hello (cleared then) or
        # its exit (`wait`; Note [the engine a daemon waits for] in `daemon.py`).  Set before
        # serving starts, so that no hello can come before it.
        self.awaited_pid = awaited_pid
        self.refused_uids: deque[int] = deque(maxlen=64)  # the latest, for diagnosis: a peer may retry for ever
        # request type -> handler(conn, engine id or None, request, descriptors) -> (reply, descriptors)
        self._handlers = {
            m.Hello: self._hello, m.Acquire: self._acquire, m.Publish: self._publish, m.Release: self._release,
            m.Report: self._report, m.Lock: self._lock, m.Unlock: self._unlock, m.Expect: self._expect,
            m.PutRecipe: self._put_recipe, m.GetRecipes: self._get_recipes, m.Stats: self._stats,
            m.Shutdown: self._shutdown,
        }
        assert set(self._handlers) == set(m.REQUESTS.values()), "every request type needs a handler"

    def start(self) -> RegistryServer:
        """Bind the socket and start serving.

        Raises:
            RegistryUnavailable: the directory is unsafe, the path too long for a socket, or another
                registry serves this path.
        """
        address = wire.socket_address(self.path)
        wire.ensure_private_dir(self.path.parent)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.settimeout(1.0)  # a full backlog fails the connect at once (EAGAIN), never blocks it
        replaces_dead = False
        try:
            probe.connect(address)
            raise RegistryUnavailable(f"a registry already serves {self.path}")
        except BlockingIOError:  # one listens there but accepts nobody now (hung, or busy)
            raise RegistryUnavailable(f"a registry already serves {self.path}, but its backlog is full (hung or "
                                      "busy); stop it, or give this one another path") from None
        except FileNotFoundError:
            pass
        except ConnectionRefusedError:  # the socket of a registry that died (a clean stop removes it)
            replaces_dead = True
        finally:
            probe.close()
        self.path.unlink(missing_ok=True)  # stale socket of a dead registry
        if replaces_dead and self.reclaim_grace_s > 0:
            # Its engines are re-registering now: let those holding locks reclaim them first.
            self.registry.begin_reclaim(self.reclaim_grace_s)
            logger.info("registry: replacing a registry that died at %s; new locks wait %.0f s for engines to "
                        "reclaim theirs", self.path, self.reclaim_grace_s)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(address)
        self._socket_inode = os.stat(self.path).st_ino  # what `_unlink_socket` may remove
        os.chmod(self.path, 0o600)
        self._listener.listen(socket.SOMAXCONN)  # engines starting together must not find it full
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="vllm-dedup-registry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close every connection and free every segment."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    @property
    def engines(self) -> int:
        return len(self.registry.engines)

    def stats(self) -> RegistryStats:
        """`Registry.stats`, safe to call from any thread."""
        with self._mutex:
            return self.registry.stats()

    def wait(self, idle_exit_s: float | None = None) -> None:
        """Block until stopped, or until nothing was connected or held for ``idle_exit_s``,
        nor is ``awaited_pid`` still to say hello (Note [the engine a daemon waits for] in
        `daemon.py`)."""
        awaited = self.awaited_pid
        watch = _ExitWatch(awaited) if awaited is not None else None
        try:
            while not self._stop.wait(0.5):
                with self._mutex:  # no connection is accepted between the check and the unlink
                    awaiting = self.awaited_pid is not None and not watch.exited()
                    if self._connections or self.registry.segments or awaiting:
                        self.idle_since = time.monotonic()
                        continue
                    if idle_exit_s is None or time.monotonic() - self.idle_since < idle_exit_s:
                        continue
                    # An engine connecting from here on finds no registry (and starts one),
                    # instead of a connection this one would drop as it stops.
                    self._unlink_socket()
                self.stop()
        finally:
            if watch is not None:
                watch.close()

    # the socket --------------------------------------------------------------------------
    def _unlink_socket(self) -> None:
        """Remove the socket path if it is still this registry's (a registry started since, on
        the same path, keeps its own)."""
        try:
            if os.stat(self.path).st_ino == self._socket_inode:
                self.path.unlink()
        except OSError:
            pass

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                for sel_key, events in self._sel.select(timeout=SELECT_TIMEOUT_S):
                    with self._mutex:
                        self._on_event(sel_key.fileobj, events)
                with self._mutex:
                    now = time.monotonic()
                    if self._accept_paused_until is not None and now >= self._accept_paused_until:
                        self._resume_accept()
                    if now >= self._next_expire:  # not once per message: a flood must not cost a scan each
                        self.registry.expire()
                        self._next_expire = now + EXPIRE_EVERY_S
        finally:
            try:
                with self._mutex:
                    for conn in [*self._connections, *self._refused]:
                        self._disconnect(conn)
                self._sel.close()
                self._listener.close()
                self._unlink_socket()
                with self._mutex:
                    self.registry.close()
            finally:
                # A loop that died (an error outside one connection's handling) stops the
                # registry as a stop would, once it has closed everything: `wait` returns, and
                # the daemon or Ray actor waiting in it exits (an actor that lived on would keep
                # the node's name, and every engine would be sent to a socket nobody serves).
                self._stop.set()

    def _on_event(self, sock, events: int) -> None:
        try:
            if sock is self._listener:
                self._accept()
                return
            if events & selectors.EVENT_WRITE:
                self._flush(sock)
            if events & selectors.EVENT_READ and self._is_open(sock):
                self._serve_one(sock)
        except Exception:  # whatever one connection did, the registry goes on serving the others
            logger.exception("registry: unexpected error; closing that connection")
            if sock is not self._listener and self._is_open(sock):
                self._disconnect(sock)

    def _is_open(self, conn: socket.socket) -> bool:
        return conn in self._connections or conn in self._refused

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as e:  # out of descriptors or memory: the connection waits in the backlog
            logger.warning("registry cannot accept a connection (%s); retrying in %.1f s", e, ACCEPT_PAUSE_S)
            self._sel.unregister(self._listener)
            self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S
            return
        conn.setblocking(False)  # replies never wait for a client (see the module docstring)
        try:
            uid = wire.peer_uid(conn)
        except OSError:  # already gone
            conn.close()
            return
        if len(self._connections) + len(self._refused) >= self.max_connections:
            self._turn_away(conn, f"refused: the registry is serving its limit of {self.max_connections} connections")
            return
        if uid != os.getuid():
            # Kept open and answered with the refusal until the peer hangs up: closing at once
            # would discard its request unread and it would see only a reset.
            self.refused_uids.append(uid)
            self._refused.add(conn)
        else:
            self._connections[conn] = None
        self._sel.register(conn, selectors.EVENT_READ)

    def _resume_accept(self) -> None:
        if self._accept_paused_until is not None:
            self._accept_paused_until = None
            self._sel.register(self._listener, selectors.EVENT_READ)

    def _turn_away(self, conn: socket.socket, why: str) -> None:
        """Say ``why`` and close: the client reads it when its request finds the socket closed."""
        logger.warning("registry: %s", why)
        try:
            conn.send(wire.frame({"error": why})[0])
        except OSError:
            pass
        conn.close()

    def _disconnect(self, conn: socket.socket) -> None:
        self._refused.discard(conn)
        engine = self._connections.pop(conn, None)
        for _, fds in self._outbox.pop(conn, ()):
            _close(fds)
        self._sel.unregister(conn)
        conn.close()
        if engine is not None:
            self.registry.drop_engine(engine)
        self._resume_accept()  # a descriptor is free again

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            msg, fds = wire.recv(conn)
        except BlockingIOError:  # woken for nothing
            return
        except ProtocolError as e:  # answer, keep the connection
            self._reply(conn, {"error": f"bad request: {e}"}, [])
            return
        except OSError:
            msg, fds = None, []
        if msg is None:
            self._disconnect(conn)
            return
        try:
            if conn in self._refused:
                raise PermissionError(f"refused: peer uid {wire.peer_uid(conn)} is not the registry's uid {os.getuid()}")
            request = m.parse_request(msg, fds)
            reply, out_fds = self._handle(conn, request, fds)
        except (PermissionError, ProtocolError, ValueError) as e:
            _close(fds)
            reply, out_fds = {"error": str(e)[:1000]}, []
        except Exception as e:  # a bad request must not take the registry down
            _close(fds)
            logger.exception("registry request %r failed", msg.get("op"))
            reply, out_fds = {"error": f"{type(e).__name__}: {e}"[:1000]}, []
        self._reply(conn, reply, out_fds)

    def _reply(self, conn: socket.socket, reply: dict, fds: list[int]) -> None:
        """Send now, or queue (see the module docstring); never waits.  ``fds`` stay the caller's."""
        try:
            data, carrier = wire.frame(reply, wire.MAX_REPLY)
        except (ProtocolError, OSError) as e:  # too big even for a memfd, or no memfd to be had
            if fds:  # an acquire's: the holds it recorded must go with a hang-up, not an error
                logger.warning("registry: dropping a client whose reply cannot be sent (%s)", e)
                self._disconnect(conn)
                return
            data, carrier, fds = wire.frame({"error": f"the reply cannot be sent: {e}"})[0], None, []
        out = [*fds, carrier] if carrier is not None else list(fds)
        try:
            queue = self._outbox.get(conn)
            if not queue:
                try:
                    socket.send_fds(conn, [data], out)
                    return
                except BlockingIOError:  # the client has not read its earlier replies yet
                    pass
            if queue is not None and len(queue) >= MAX_PENDING_REPLIES:
                logger.warning("registry: dropping a client that reads none of its replies")
                self._disconnect(conn)
                return
            # The queue holds its own duplicates: the registry may free a segment, and close its
            # descriptor, before the client reads the reply that names it.
            self._outbox.setdefault(conn, deque()).append((data, _dup_all(out)))
            self._sel.modify(conn, selectors.EVENT_READ | selectors.EVENT_WRITE)
        except OSError:  # the client went away, or no descriptor left to queue with
            self._disconnect(conn)
        finally:
            if carrier is not None:
                os.close(carrier)

    def _flush(self, conn: socket.socket) -> None:
        """Send what waits in the connection's queue, as far as the kernel takes it."""
        queue = self._outbox[conn]
        while queue:
            data, fds = queue[0]
            try:
                socket.send_fds(conn, [data], fds)
            except BlockingIOError:
                return
            except OSError:
                self._disconnect(conn)
                return
            queue.popleft()
            _close(fds)
        del self._outbox[conn]
        self._sel.modify(conn, selectors.EVENT_READ)

    def _handle(self, conn, request: m.Message, fds: list[int]) -> tuple[dict, list[int]]:
        engine = self._connections.get(conn)
        if engine is None and not isinstance(request, (m.Hello, m.Stats, m.Shutdown)):
            raise ValueError(f"op {request.op!r} needs a hello first")
        reply, out_fds = self._handlers[type(request)](conn, engine, request, fds)
        return reply.to_wire() if isinstance(reply, m.Message) else reply, out_fds

    # handlers: one per request type --------------------------------------------------------
    def _hello(self, conn, engine, req: m.Hello, fds):
        if engine is not None:
            raise ValueError("hello sent twice")
        self._connections[conn] = self.registry.add_engine(req.pid, wire.peer_uid(conn), req.model, req.device,
                                                           req.group, req.signature)
        if self.awaited_pid is not None and wire.peer_pid(conn) == self.awaited_pid:  # the kernel's pid, not the claim
            self.awaited_pid = None
        return m.HelloReply(self._connections[conn]), []

    def _acquire(self, conn, engine, req: m.Acquire, fds):
        hits = self.registry.acquire(engine, req.keys[: wire.MAX_FDS], req.uids[: wire.MAX_FDS] or None)
        segments = list(dict.fromkeys(h.segment for h in hits))
        entries = [self.registry.segments[s] for s in segments]
        reply = m.AcquireReply([(h.key, h.segment, h.offset, h.nbytes) for h in hits], segments,
                               [e.uid for e in entries], [e.nbytes for e in entries])
        return reply, [e.fd for e in entries]

    def _publish(self, conn, engine, req: m.Publish, fds):
        if not self.registry.engines[engine].device.startswith("cuda:"):  # cuda: see the module docstring
            try:
                check_sealed_memfd(fds[0], req.nbytes)
            except SegmentError as e:
                raise ProtocolError(f"request 'publish': {e}") from None
        elif stat.S_ISSOCK(os.fstat(fds[0]).st_mode):
            raise ProtocolError("request 'publish': a socket is no CUDA export descriptor")
        return m.PublishReply(self.registry.publish(engine, fds[0], req.nbytes, req.keys, req.uid)), []

    def _release(self, conn, engine, req: m.Release, fds):
        self.registry.release(engine, req.segments)
        return m.Empty(), []

    def _report(self, conn, engine, req: m.Report, fds):
        self.registry.report(engine, req.load)
        return m.Empty(), []

    def _lock(self, conn, engine, req: m.Lock, fds):
        holder = self.registry.try_lock(engine, req.names, req.owner, req.reclaim)
        return m.LockReply(holder is None, holder or None, holder == 0), []

    def _unlock(self, conn, engine, req: m.Unlock, fds):
        self.registry.unlock(engine, req.names)
        return m.Empty(), []

    def _expect(self, conn, engine, req: m.Expect, fds):
        e = self.registry.engines[engine]
        expected = self.registry.expected_shared_bytes(e.device, e.group, e.signature)
        return m.ExpectReply(min(expected, m.MAX_BYTES)), []  # each size is in range; their sum may not be

    def _put_recipe(self, conn, engine, req: m.PutRecipe, fds):
        # The registry keeps the memfd: its size, not the one claimed, is what recipes cost it.
        if os.fstat(fds[0]).st_size > max(req.nbytes, 1):  # an empty one is 1 byte (`sealed_memfd`)
            raise ValueError(f"a recipe's memfd holds more than the {req.nbytes} bytes it says")
        signature, recipe_id, final = _recipe_summary(fds[0], req.nbytes)
        self.registry.put_recipe(engine, fds[0], req.nbytes, signature, recipe_id, final)
        return m.Empty(), []

    def _get_recipes(self, conn, engine, req: m.GetRecipes, fds):
        kept = self.registry.recipes_for(engine, req.signature)[: wire.MAX_FDS]
        return m.RecipesReply([r.nbytes for r in kept]), [r.fd for r in kept]

    def _stats(self, conn, engine, req: m.Stats, fds):
        return self.registry.stats().to_dict(), []

    def _shutdown(self, conn, engine, req: m.Shutdown, fds):
        if self.engines and not req.force:
            raise ValueError(f"{self.engines} engine(s) still connected; use force")
        self._stop.set()
        return m.ShutdownReply(True), []


def _recipe_summary(fd: int, nbytes: int) -> tuple[str, str, dict[str, int]]:
    """(signature, recipe id, final content key -> bytes) of the recipe JSON in the sealed
    memfd ``fd`` (docs/architecture.md, "Loading only what is not resident"); the descriptor stays open.

    Raises:
        ValueError: not a sealed memfd of ``nbytes`` bytes, or not a recipe.
    """
    from ..errors import SegmentError
    from ..segments.host import HostSegment

    try:
        data = HostSegment.attach(os.dup(fd), nbytes).read()
    except SegmentError as e:
        raise ValueError(f"a recipe must come as a sealed memfd: {e}") from None
    try:
        recipe = json.loads(data)
        final = {str(k): v for k, v in recipe["final"].items()}
        if not all(type(v) is int and 0 <= v <= m.MAX_BYTES for v in final.values()):  # summed for `expect`
            raise ValueError("a recipe's final sizes must be whole numbers of bytes, 0 to 2**63 - 1")
        signature, recipe_id = str(recipe["signature"]), str(recipe["id"])
        if max(len(signature), len(recipe_id)) > m.MAX_STRING:  # no get_recipes could name it
            raise ValueError(f"a recipe's signature and id are at most {m.MAX_STRING} characters")
        return signature, recipe_id, final
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not a recipe ({type(e).__name__}: {e})") from None


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _dup_all(fds: list[int]) -> list[int]:
    """Duplicates of ``fds``, all or none (OSError: out of descriptors)."""
    out: list[int] = []
    try:
        for fd in fds:
            out.append(os.dup(fd))
    except OSError:
        _close(out)
        raise
    return out


class _ExitWatch:
    """Whether process ``pid`` has exited (a zombie, not yet reaped, has).

    A pidfd (Linux 5.3) reads as ready once the process has terminated, and unlike a pid it
    never names a newer process that reused the number.  Where there is none (an older kernel,
    a seccomp profile refusing ``pidfd_open``), the process's state in ``/proc/PID/stat``: gone
    or ``Z``; a pid reused meanwhile then reads as alive.
    """

    def __init__(self, pid: int):
        self.pid, self._fd, self._gone = pid, -1, False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
        except (OSError, AttributeError):  # no pidfd here: /proc
            pass

    def exited(self) -> bool:
        if self._gone:
            return True
        if self._fd >= 0:
            ready, _, _ = select.select([self._fd], [], [], 0)
            self._gone = bool(ready)
        else:
            try:
                stat = Path(f"/proc/{self.pid}/stat").read_text()
                self._gone = stat.rsplit(")", 1)[1].split()[0] == "Z"
            except (OSError, IndexError):
                self._gone = True
        return self._gone

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
