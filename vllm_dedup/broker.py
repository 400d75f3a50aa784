"""The segment broker: the registry behind a Unix socket that can carry file descriptors.

Ray cannot carry file descriptors, so the registry's process also serves this socket (DESIGN.md,
"Registry").  Each message is one ``SOCK_SEQPACKET`` datagram of JSON; descriptors ride along
with ``SCM_RIGHTS`` (``socket.send_fds``/``recv_fds``).  SEQPACKET keeps message boundaries, so
a descriptor always arrives with the message it belongs to.

Security: the socket lives in a private directory (mode 0700, owned by the user, not a symlink)
and the server checks each peer's uid with ``SO_PEERCRED``; another user's process is refused
even if the directory's permissions were loosened.

Lease: an engine keeps one connection open for its lifetime.  When it closes, for whatever
reason (exit, crash, SIGKILL), the kernel closes the socket and the server drops that engine's
references (`Registry.drop_engine`).

Requests (``op`` and arguments) and replies:

====================  ===================================================================
``hello``             pid, model, device, group, signature -> engine id (the connection becomes
                      a lease)
``acquire``           keys -> hits ``[key, segment, offset, bytes]``; one fd per hit segment
``publish``           bytes, keys ``[[key, offset, bytes]]`` + 1 fd -> segment id
``release``           segments -> {}
``report``            load (the engine's `share.ShareResult` numbers) -> {}
``lock``              names, owner -> granted (bool; all or none), holder_pid (when not granted)
``unlock``            names -> {}
``expect``            -> bytes (`Registry.expected_shared_bytes` for this engine)
``stats``             -> `Registry.stats`
``shutdown``          stop the server if no engine is connected (``force`` stops it anyway)
====================  ===================================================================

The same server runs inside the Ray actor (`ray_actor.py`) and, on machines without Ray, as a
standalone daemon (``python -m vllm_dedup.broker``), which the first engine starts.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import logging
import os
import selectors
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .registry import Hit, Registry

__all__ = [
    "BrokerClient",
    "BrokerServer",
    "RegistryUnavailable",
    "registry_stats",
    "shutdown_registry",
    "socket_path",
    "start_daemon",
]

logger = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 20
MAX_FDS = 250  # below the kernel's SCM_MAX_FD (253)
DEFAULT_NAMESPACE = "vllm-dedup"


class RegistryUnavailable(ConnectionError):
    """The registry cannot be reached, or refused us, or broke the protocol."""


# paths -------------------------------------------------------------------------------------
def runtime_dir() -> Path:
    """``$VLLM_DEDUP_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/vllm-dedup``, else ``/tmp/vllm-dedup-<uid>``."""
    if env := os.environ.get("VLLM_DEDUP_RUNTIME_DIR"):
        return Path(env)
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / "vllm-dedup"
    return Path(f"/tmp/vllm-dedup-{os.getuid()}")


def socket_path(namespace: str = DEFAULT_NAMESPACE) -> Path:
    """The broker socket of ``namespace`` on this node."""
    if not namespace.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"registry namespace {namespace!r} may hold only letters, digits, '-', '_' and '.'")
    return runtime_dir() / f"{namespace}.sock"


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` mode 0700, or check that the existing one is ours, private, no symlink.

    Raises:
        RegistryUnavailable: the directory is a symlink, not ours, or open to others.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(path)
    except OSError as e:
        raise RegistryUnavailable(f"cannot create the registry's socket directory {path}: {e}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise RegistryUnavailable(f"{path} is not a real directory; remove it")
    if info.st_uid != os.getuid():
        raise RegistryUnavailable(f"{path} belongs to uid {info.st_uid}, not to us ({os.getuid()}); remove it")
    if info.st_mode & 0o077:
        raise RegistryUnavailable(f"{path} is open to other users (mode {info.st_mode & 0o777:o}); chmod 700 it")


# framing -----------------------------------------------------------------------------------
def _send(sock: socket.socket, obj: dict, fds: list[int] = ()) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"broker message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _recv(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and its descriptors; ``(None, [])`` when the peer closed."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS + 3)
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        for fd in fds:
            os.close(fd)
        raise RegistryUnavailable("broker message truncated")
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


# server ------------------------------------------------------------------------------------
class BrokerServer:
    """Serves a `Registry` on a Unix socket from one background thread.

    One thread serves the socket and handles requests one at a time; `stats` may be called
    from other threads (the Ray actor's, the metrics exporter), so every access to the registry
    holds ``self._mutex``.  Unheld segments are expired about once a second.

    Args:
        registry: the state to serve.
        path: the socket path; its directory must be private (see `ensure_private_dir`).
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

    def start(self) -> BrokerServer:
        """Bind the socket and start serving.

        Raises:
            RegistryUnavailable: the directory is unsafe, or another broker serves this path.
        """
        ensure_private_dir(self.path.parent)
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

    def stats(self) -> dict:
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
        uid = _peer_uid(conn)
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
            msg, fds = _recv(conn)
        except ValueError as e:  # not JSON: answer, keep the connection
            self._reply(conn, {"error": f"bad request: {e}"}, [])
            return
        except (OSError, RegistryUnavailable):
            msg, fds = None, []
        if msg is None:
            self._disconnect(conn)
            return
        try:
            if conn in self._refused:
                raise PermissionError(f"refused: peer uid {_peer_uid(conn)} is not the registry's uid {os.getuid()}")
            reply, out_fds = self._handle(conn, msg, fds)
        except PermissionError as e:
            for fd in fds:
                os.close(fd)
            reply, out_fds = {"error": str(e)}, []
        except Exception as e:  # a bad request must not take the broker down
            for fd in fds:
                os.close(fd)
            logger.exception("broker request %r failed", msg.get("op"))
            reply, out_fds = {"error": f"{type(e).__name__}: {e}"}, []
        self._reply(conn, reply, out_fds)

    def _reply(self, conn: socket.socket, reply: dict, fds: list[int]) -> None:
        try:
            _send(conn, reply, fds)
        except OSError:
            self._disconnect(conn)

    def _handle(self, conn, msg: dict, fds: list[int]) -> tuple[dict, list[int]]:
        reg, op = self.registry, msg.get("op")
        engine = self._connections.get(conn)
        if op == "stats":
            return reg.stats(), []
        if op == "shutdown":
            if self.engines and not msg.get("force"):
                return {"error": f"{self.engines} engine(s) still connected; use force"}, []
            self._stop.set()
            return {"stopping": True}, []
        if op == "hello":
            if engine is not None:
                raise ValueError("hello sent twice")
            self._connections[conn] = reg.add_engine(
                int(msg["pid"]), _peer_uid(conn), str(msg["model"]), str(msg["device"]), str(msg["group"]),
                str(msg.get("signature") or ""),
            )
            return {"engine": self._connections[conn]}, []
        if engine is None:
            raise ValueError(f"op {op!r} needs a hello first")
        if op == "acquire":
            hits = reg.acquire(engine, list(msg["keys"])[:MAX_FDS])
            segs = list(dict.fromkeys(h.segment for h in hits))
            return {"hits": [[h.key, h.segment, h.offset, h.nbytes] for h in hits], "segments": segs}, [
                reg.fd_of(s) for s in segs
            ]
        if op == "publish":
            if len(fds) != 1:
                raise ValueError(f"publish carries exactly one descriptor, got {len(fds)}")
            keys = [(str(k), int(o), int(n)) for k, o, n in msg["keys"]]
            return {"segment": reg.publish(engine, fds[0], int(msg["nbytes"]), keys)}, []
        if op == "release":
            reg.release(engine, [int(s) for s in msg["segments"]])
            return {}, []
        if op == "report":
            reg.report(engine, dict(msg["load"]))
            return {}, []
        if op == "lock":
            holder = reg.try_lock(engine, [str(n) for n in msg["names"]], msg.get("owner"))
            return {"granted": holder is None, "holder_pid": holder}, []
        if op == "unlock":
            reg.unlock(engine, [str(n) for n in msg["names"]])
            return {}, []
        if op == "expect":
            e = reg.engines[engine]
            return {"bytes": reg.expected_shared_bytes(e.device, e.group, e.signature)}, []
        raise ValueError(f"unknown op {op!r}")


# client ------------------------------------------------------------------------------------
class BrokerClient:
    """One connection to a broker.  For an engine, the connection is its lease: keep the client
    alive as long as the engine holds shared tensors.

    Raises (every method):
        RegistryUnavailable: cannot connect, refused, the broker went away or answered an error.
    """

    def __init__(self, path: Path, timeout_s: float = 30.0):
        self.path = Path(path)
        try:
            ensure_private_dir(self.path.parent)
            info = os.lstat(self.path)
            if stat.S_ISLNK(info.st_mode) or info.st_uid != os.getuid():
                raise RegistryUnavailable(f"{self.path} is a symlink or not ours; refusing to connect")
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._sock.settimeout(timeout_s)
            self._sock.connect(str(self.path))
        except FileNotFoundError:
            raise RegistryUnavailable(f"no registry serves {self.path}") from None
        except OSError as e:
            raise RegistryUnavailable(f"cannot connect to the registry at {self.path}: {e}") from None
        self._lock = threading.Lock()
        self.engine_id: int | None = None
        self.group: str | None = None  # the share group said in `hello`

    def _call(self, obj: dict, fds: list[int] = ()) -> tuple[dict, list[int]]:
        with self._lock:
            try:
                _send(self._sock, obj, fds)
                reply, got = _recv(self._sock)
            except OSError as e:
                raise RegistryUnavailable(f"registry at {self.path} went away: {e}") from None
        if reply is None:
            raise RegistryUnavailable(f"registry at {self.path} closed the connection")
        if "error" in reply:
            for fd in got:
                os.close(fd)
            raise RegistryUnavailable(f"registry at {self.path}: {reply['error']}")
        return reply, got

    def hello(self, model: str, device: str, group: str, signature: str = "") -> int:
        """Make this connection an engine's lease.  ``device`` is a device key
        (`Segment.device_key`); ``signature`` names what decides the engine's tensors' bytes
        (default: ``model``), for `expected_shared_bytes`."""
        reply, _ = self._call({"op": "hello", "pid": os.getpid(), "model": model, "device": device, "group": group,
                               "signature": signature})
        self.engine_id, self.group = reply["engine"], group
        return self.engine_id

    def expected_shared_bytes(self) -> int:
        """Bytes of this engine's tensors predicted to be resident already (bytes; 0 when no
        engine with its signature has reported; `Registry.expected_shared_bytes`)."""
        return int(self._call({"op": "expect"})[0]["bytes"])

    def acquire(self, keys: list[str]) -> list[tuple[Hit, int]]:
        """Look up ``keys``; returns each hit with a descriptor of its segment (the caller owns
        every descriptor; hits in one segment get duplicates)."""
        out = []
        for start in range(0, len(keys), MAX_FDS):
            reply, fds = self._call({"op": "acquire", "keys": keys[start : start + MAX_FDS]})
            by_segment = dict(zip(reply["segments"], fds))
            used = set()
            for key, seg, offset, nbytes in reply["hits"]:
                fd = by_segment[seg] if seg not in used else os.dup(by_segment[seg])
                used.add(seg)
                out.append((Hit(key, seg, offset, nbytes), fd))
        return out

    def publish(self, fd: int, nbytes: int, keys: list[tuple[str, int, int]]) -> int:
        reply, _ = self._call({"op": "publish", "nbytes": nbytes, "keys": [list(k) for k in keys]}, [fd])
        return reply["segment"]

    def release(self, segments: list[int]) -> None:
        self._call({"op": "release", "segments": segments})

    def report(self, load: dict) -> None:
        self._call({"op": "report", "load": load})

    def stats(self) -> dict:
        return self._call({"op": "stats"})[0]

    def lock(self, names: str | list[str], owner: str | None = None, timeout_s: float = 600.0,
             poll_s: float = 0.05) -> None:
        """Take registry locks ``names``, all or none (`Registry.try_lock`; needs `hello` first).

        Waiting polls (``poll_s``) rather than blocking in the broker, so a waiter never stalls
        other requests and a timed-out waiter leaves no reply behind.  A lock whose holder dies
        is free at once: it goes with the holder's connection.

        Args:
            names: one lock name or several.
            owner: connections passing the same owner share the locks (TP ranks of one engine).
            timeout_s: give up after this many seconds.

        Raises:
            TimeoutError: still held by another engine after ``timeout_s`` (the message names its pid).
            RegistryUnavailable: as every method.
        """
        names = [names] if isinstance(names, str) else list(names)
        deadline = time.monotonic() + timeout_s
        while True:
            reply, _ = self._call({"op": "lock", "names": names, "owner": owner})
            if reply["granted"]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"registry lock(s) {', '.join(names)} still held by engine pid "
                                   f"{reply['holder_pid']} after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def unlock(self, names: str | list[str]) -> None:
        """Give locks back; a broker that is gone took them with it (no error then)."""
        try:
            self._call({"op": "unlock", "names": [names] if isinstance(names, str) else list(names)})
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
        self._call({"op": "shutdown", "force": force})

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def registry_stats(path: Path | None = None) -> dict:
    """`Registry.stats` of the registry at ``path`` (default: this node's, default namespace).

    Raises:
        RegistryUnavailable: no registry answers there.
    """
    with BrokerClient(path or socket_path(), timeout_s=10) as client:
        return client.stats()


def shutdown_registry(path: Path | None = None) -> bool:
    """Stop the registry at ``path`` even with engines connected; False if none answered."""
    try:
        with BrokerClient(path or socket_path(), timeout_s=10) as client:
            client.shutdown(force=True)
        return True
    except RegistryUnavailable:
        return False


# the standalone daemon ---------------------------------------------------------------------
def start_daemon(path: Path, keep_warm_s: float = 0.0, idle_exit_s: float = 30.0, timeout_s: float = 30.0) -> None:
    """Start a standalone broker daemon for ``path`` (if none runs) and wait until it answers.

    The daemon detaches (forks once more and starts its own session), so it is no longer a
    descendant of the engine that started it: vLLM's shutdown kills its process tree, and the
    registry must outlive any one engine.  It exits after ``idle_exit_s`` seconds with no
    engine connected and no segment held.  Two engines starting at once race harmlessly: the
    daemon takes a lock, the loser exits.

    Raises:
        RegistryUnavailable: it did not answer within ``timeout_s``.
    """
    ensure_private_dir(path.parent)
    # The daemon's stderr goes to an unlinked temporary file: nothing is left behind, and if
    # it dies before answering, its last words are still readable through our descriptor.
    with tempfile.TemporaryFile(dir=path.parent) as err:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "vllm_dedup.broker", "--detach", "--socket", str(path),
             "--keep-warm-s", str(keep_warm_s), "--idle-exit-s", str(idle_exit_s)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            start_new_session=True, close_fds=True,
        )
        launcher.wait(timeout=timeout_s)  # returns as soon as the daemon has forked off
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                BrokerClient(path, timeout_s=5).close()
                return
            except RegistryUnavailable:
                if time.monotonic() > deadline:
                    err.seek(0)
                    tail = err.read()[-2000:].decode(errors="replace").strip()
                    raise RegistryUnavailable(
                        f"the registry daemon for {path} did not start: {tail or 'no answer'}"
                    ) from None
                time.sleep(0.05)


def _daemon_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_dedup.broker", description="standalone vllm-dedup registry")
    parser.add_argument("--socket", type=Path, default=None)
    parser.add_argument("--keep-warm-s", type=float, default=0.0)
    parser.add_argument("--idle-exit-s", type=float, default=None, help="exit when idle this long (default: never)")
    parser.add_argument("--detach", action="store_true", help="fork into the background and return at once")
    args = parser.parse_args(argv)
    if args.detach:
        if os.fork() > 0:
            os._exit(0)  # the launcher returns; the daemon is re-parented away from its engine
        os.setsid()
    path = args.socket or socket_path()
    ensure_private_dir(path.parent)
    lock = open(f"{path}.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return 0  # another daemon owns this socket
        raise
    server = BrokerServer(Registry(keep_warm_s=args.keep_warm_s), path).start()
    try:
        server.wait(args.idle_exit_s)
    finally:
        server.stop()
        Path(f"{path}.lock").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(_daemon_main())
