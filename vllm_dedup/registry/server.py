"""The registry behind its Unix socket: `BrokerServer` serves a `state.Registry` to engines.

Messages and framing are `protocol.py`'s.  Each request type has one handler in a dispatch
table (`BrokerServer._handlers`); a bad request is answered with an error and the connection
stays usable, so one broken client never takes the registry down for the others.

Lease: an engine keeps one connection open for its lifetime.  When it closes, for whatever
reason (exit, crash, SIGKILL), the kernel closes the socket and the server drops that engine's
references (`Registry.drop_engine`).

The same server runs inside the Ray actor (`ray_actor.py`) and in the standalone daemon
(`daemon.py`).
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import threading
import time
from pathlib import Path

from ..errors import ProtocolError, RegistryUnavailable
from . import protocol as p
from .state import Registry, RegistryStats

__all__ = ["BrokerServer"]

logger = logging.getLogger(__name__)


class BrokerServer:
    """Serves a `Registry` on a Unix socket from one background thread.

    One thread serves the socket and handles requests one at a time; `stats` may be called
    from other threads (the Ray actor's, the metrics exporter), so every access to the registry
    holds ``self._mutex``.  Unheld segments are expired about once a second.

    Args:
        registry: the state to serve.
        path: the socket path; its directory must be private (see `protocol.ensure_private_dir`).
    """

    def __init__(self, registry: Registry, path: Path):
        self.registry = registry
        self.path = Path(path)
        self._sel = selectors.DefaultSelector()
        self._connections: dict[socket.socket, int | None] = {}  # -> engine id, None before hello
        self._refused: set[socket.socket] = set()
        self._stop = threading.Event()
        self._mutex = threading.Lock()
        self._thread: threading.Thread | None = None
        self.idle_since = time.monotonic()
        self.refused_uids: list[int] = []
        # request type -> handler(conn, engine id or None, request, descriptors) -> (reply, descriptors)
        self._handlers = {
            p.Hello: self._hello, p.Acquire: self._acquire, p.Publish: self._publish, p.Release: self._release,
            p.Report: self._report, p.Lock: self._lock, p.Unlock: self._unlock, p.Expect: self._expect,
            p.PutRecipe: self._put_recipe, p.GetRecipes: self._get_recipes, p.Stats: self._stats,
            p.Shutdown: self._shutdown,
        }
        assert set(self._handlers) == set(p.REQUESTS.values()), "every request type needs a handler"

    def start(self) -> BrokerServer:
        """Bind the socket and start serving.

        Raises:
            RegistryUnavailable: the directory is unsafe, or another broker serves this path.
        """
        p.ensure_private_dir(self.path.parent)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(str(self.path))
            raise RegistryUnavailable(f"a broker already serves {self.path}")
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        finally:
            probe.close()
        self.path.unlink(missing_ok=True)  # stale socket of a dead broker
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="vllm-dedup-broker", daemon=True)
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
        """Block until stopped, or until nothing was connected or held for ``idle_exit_s``."""
        while not self._stop.wait(0.5):
            busy = self._connections or self.registry.segments
            if busy:
                self.idle_since = time.monotonic()
            elif idle_exit_s is not None and time.monotonic() - self.idle_since >= idle_exit_s:
                self.stop()

    # the socket --------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                for sel_key, _ in self._sel.select(timeout=0.5):
                    with self._mutex:
                        if sel_key.fileobj is self._listener:
                            self._accept()
                        else:
                            self._serve_one(sel_key.fileobj)
                with self._mutex:
                    self.registry.expire()
        finally:
            with self._mutex:
                for conn in [*self._connections, *self._refused]:
                    self._disconnect(conn)
            self._sel.close()
            self._listener.close()
            try:
                if os.stat(self.path).st_ino == os.fstat(self._listener.fileno()).st_ino:
                    self.path.unlink()
            except (OSError, ValueError):
                self.path.unlink(missing_ok=True)
            with self._mutex:
                self.registry.close()

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        uid = p.peer_uid(conn)
        conn.setblocking(True)
        if uid != os.getuid():
            # Kept open and answered with the refusal until the peer hangs up: closing at once
            # would discard its request unread and it would see only a reset.
            self.refused_uids.append(uid)
            self._refused.add(conn)
        else:
            self._connections[conn] = None
        self._sel.register(conn, selectors.EVENT_READ)

    def _disconnect(self, conn: socket.socket) -> None:
        self._refused.discard(conn)
        engine = self._connections.pop(conn, None)
        self._sel.unregister(conn)
        conn.close()
        if engine is not None:
            self.registry.drop_engine(engine)

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            msg, fds = p.recv(conn)
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
                raise PermissionError(f"refused: peer uid {p.peer_uid(conn)} is not the registry's uid {os.getuid()}")
            request = p.parse_request(msg, fds)
            reply, out_fds = self._handle(conn, request, fds)
        except (PermissionError, ProtocolError, ValueError) as e:
            _close(fds)
            reply, out_fds = {"error": str(e)}, []
        except Exception as e:  # a bad request must not take the broker down
            _close(fds)
            logger.exception("broker request %r failed", msg.get("op"))
            reply, out_fds = {"error": f"{type(e).__name__}: {e}"}, []
        self._reply(conn, reply, out_fds)

    def _reply(self, conn: socket.socket, reply: dict, fds: list[int]) -> None:
        try:
            p.send(conn, reply, fds)
        except OSError:
            self._disconnect(conn)

    def _handle(self, conn, request: p.Message, fds: list[int]) -> tuple[dict, list[int]]:
        engine = self._connections.get(conn)
        if engine is None and not isinstance(request, (p.Hello, p.Stats, p.Shutdown)):
            raise ValueError(f"op {request.op!r} needs a hello first")
        reply, out_fds = self._handlers[type(request)](conn, engine, request, fds)
        return reply.to_wire() if isinstance(reply, p.Message) else reply, out_fds

    # handlers: one per request type --------------------------------------------------------
    def _hello(self, conn, engine, req: p.Hello, fds):
        if engine is not None:
            raise ValueError("hello sent twice")
        self._connections[conn] = self.registry.add_engine(req.pid, p.peer_uid(conn), req.model, req.device,
                                                           req.group, req.signature)
        return p.HelloReply(self._connections[conn]), []

    def _acquire(self, conn, engine, req: p.Acquire, fds):
        hits = self.registry.acquire(engine, req.keys[: p.MAX_FDS])
        segments = list(dict.fromkeys(h.segment for h in hits))
        reply = p.AcquireReply([(h.key, h.segment, h.offset, h.nbytes) for h in hits], segments)
        return reply, [self.registry.fd_of(s) for s in segments]

    def _publish(self, conn, engine, req: p.Publish, fds):
        return p.PublishReply(self.registry.publish(engine, fds[0], req.nbytes, req.keys)), []

    def _release(self, conn, engine, req: p.Release, fds):
        self.registry.release(engine, req.segments)
        return p.Empty(), []

    def _report(self, conn, engine, req: p.Report, fds):
        self.registry.report(engine, req.load)
        return p.Empty(), []

    def _lock(self, conn, engine, req: p.Lock, fds):
        holder = self.registry.try_lock(engine, req.names, req.owner)
        return p.LockReply(holder is None, holder), []

    def _unlock(self, conn, engine, req: p.Unlock, fds):
        self.registry.unlock(engine, req.names)
        return p.Empty(), []

    def _expect(self, conn, engine, req: p.Expect, fds):
        e = self.registry.engines[engine]
        return p.ExpectReply(self.registry.expected_shared_bytes(e.device, e.group, e.signature)), []

    def _put_recipe(self, conn, engine, req: p.PutRecipe, fds):
        signature, recipe_id, final = _recipe_summary(fds[0], req.nbytes)
        self.registry.put_recipe(engine, fds[0], req.nbytes, signature, recipe_id, final)
        return p.Empty(), []

    def _get_recipes(self, conn, engine, req: p.GetRecipes, fds):
        kept = self.registry.recipes_for(engine, req.signature)[: p.MAX_FDS]
        return p.RecipesReply([r.nbytes for r in kept]), [r.fd for r in kept]

    def _stats(self, conn, engine, req: p.Stats, fds):
        return self.registry.stats().to_dict(), []

    def _shutdown(self, conn, engine, req: p.Shutdown, fds):
        if self.engines and not req.force:
            raise ValueError(f"{self.engines} engine(s) still connected; use force")
        self._stop.set()
        return p.ShutdownReply(True), []


def _recipe_summary(fd: int, nbytes: int) -> tuple[str, str, dict[str, int]]:
    """(signature, recipe id, final content key -> bytes) of the recipe JSON in the sealed
    memfd ``fd`` (docs/architecture.md, "Recipes"); the descriptor stays open.

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
        final = {str(k): int(v) for k, v in recipe["final"].items()}
        return str(recipe["signature"]), str(recipe["id"]), final
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not a recipe ({type(e).__name__}: {e})") from None


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
