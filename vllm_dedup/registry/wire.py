"""The registry's wire: where its socket lives, who may talk to it, and how one message is
framed (docs/architecture.md, "Registry").  The messages themselves are `messages.py`.

Ray cannot carry file descriptors, so the registry's process serves a Unix socket.  Each message
is one ``SOCK_SEQPACKET`` datagram of JSON; descriptors ride along with ``SCM_RIGHTS``
(``socket.send_fds``/``recv_fds``).  SEQPACKET keeps message boundaries, so a descriptor always
arrives with the message it belongs to.

Framing (`frame`, `send`, `recv`): JSON of up to `INLINE_MAX` bytes travels in the datagram.
Larger JSON (up to `MAX_MESSAGE` for a request, `MAX_REPLY` for a reply; the kernel refuses
datagrams over about 200 kB) is written to a sealed memfd attached last, and the datagram says
only ``{"$memfd": <bytes>}``.  A zero-length datagram is a bad message, not a hang-up: only a
peer that really closed (``POLLHUP``) ends a connection.  NaN and infinities are refused.

Security: the socket lives in a private directory (mode 0700, owned by the user, not a symlink;
`ensure_private_dir`) and the server checks each peer's uid with ``SO_PEERCRED`` (`peer_uid`).
"""

from __future__ import annotations

import json
import math
import os
import select
import socket
import stat
import struct
import typing
from pathlib import Path

from ..config import is_registry_namespace
from ..errors import ProtocolError, RegistryUnavailable, SegmentError
from ..segments.host import MESSAGE_MEMFD_NAME, check_sealed_memfd, sealed_memfd

__all__ = ["DEFAULT_NAMESPACE", "INLINE_MAX", "MAX_FDS", "MAX_MESSAGE", "MAX_REPLY", "brief", "ensure_private_dir",
           "frame", "peer_uid", "recv", "runtime_dir", "send", "socket_address", "socket_path"]

MAX_MESSAGE = 1 << 20  # bytes of one message's JSON
MAX_REPLY = 16 << 20  # bytes of one reply's JSON: stats grow with the engines connected
INLINE_MAX = 64 << 10  # bytes of JSON sent in the datagram itself; larger JSON goes in a memfd
MAX_FDS = 250  # descriptors per message: below the kernel's SCM_MAX_FD (253)
_CARRIER = "$memfd"  # the datagram's only key when the JSON travels in a memfd
DEFAULT_NAMESPACE = "vllm-dedup"


# paths and peers ---------------------------------------------------------------------------
def runtime_dir() -> Path:
    """``$VLLM_DEDUP_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/vllm-dedup``, else ``/tmp/vllm-dedup-<uid>``."""
    if env := os.environ.get("VLLM_DEDUP_RUNTIME_DIR"):
        return Path(env)
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / "vllm-dedup"
    return Path(f"/tmp/vllm-dedup-{os.getuid()}")


def socket_path(namespace: str = DEFAULT_NAMESPACE) -> Path:
    """The registry socket of ``namespace`` on this node.

    Raises:
        ValueError: the namespace holds characters other than letters, digits, '-', '_', '.'.
    """
    if not is_registry_namespace(namespace):
        raise ValueError(f"registry namespace {namespace!r} may hold only letters, digits, '-', '_' and '.'")
    return runtime_dir() / f"{namespace}.sock"


def socket_address(path: Path) -> str:
    """``path`` as a Unix socket address.

    Raises:
        RegistryUnavailable: the path is longer than Linux allows a socket's (107 bytes:
            ``sun_path`` is 108 with its terminating NUL, unix(7)).
    """
    n = len(os.fsencode(path))
    if n > 107:
        raise RegistryUnavailable(f"the registry socket path {path} is {n} bytes, and Linux allows a Unix socket at "
                                  "most 107: set VLLM_DEDUP_RUNTIME_DIR (or XDG_RUNTIME_DIR) to a shorter directory, "
                                  "or choose a shorter registry_namespace (the socket's name)")
    return str(path)


def ensure_private_dir(path: Path, create: bool = True) -> None:
    """Create ``path`` mode 0700 (with ``create``; a client only checks: a query must not make
    a directory that the user's engines would then find owned by whoever queried), or check
    that the existing one is ours, private, no symlink.

    Raises:
        RegistryUnavailable: the directory is a symlink, not ours, or open to others; or it
            does not exist and ``create`` is false.
    """
    try:
        if create:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(path)
    except FileNotFoundError:
        raise RegistryUnavailable(f"no registry serves {path}: the directory does not exist") from None
    except OSError as e:
        raise RegistryUnavailable(f"cannot create the registry's socket directory {path}: {e}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise RegistryUnavailable(f"{path} is not a real directory; remove it")
    if info.st_uid != os.getuid():
        raise RegistryUnavailable(f"{path} belongs to uid {info.st_uid}, not to us ({os.getuid()}); remove it")
    if info.st_mode & 0o077:
        raise RegistryUnavailable(f"{path} is open to other users (mode {info.st_mode & 0o777:o}); chmod 700 it")


def _peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket when it connected
    (``SO_PEERCRED``: ``struct ucred``)."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    return _peer_credentials(sock)[1]


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a Unix socket when it connected
    (``SO_PEERCRED``), in this process's pid namespace (the kernel translates it; 0 where that
    process is not visible from here)."""
    return _peer_credentials(sock)[0]


# framing -----------------------------------------------------------------------------------
def frame(obj: dict, limit: int = MAX_MESSAGE) -> tuple[bytes, int | None]:
    """The datagram of one message, and the sealed memfd carrying its JSON when that is over
    `INLINE_MAX` bytes (else None).  The caller owns the memfd: attach it after the message's
    own descriptors, and close it once sent.

    Raises:
        ProtocolError: the JSON is over ``limit`` bytes, or holds NaN or an infinity.
        OSError: the memfd could not be made (out of memory or descriptors).
    """
    try:
        data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except ValueError as e:
        raise ProtocolError(f"a registry message cannot carry {e}") from None
    if len(data) > limit:
        raise ProtocolError(f"a registry message of {len(data)} bytes exceeds the limit of {limit}")
    if len(data) <= INLINE_MAX:
        return data, None
    return json.dumps({_CARRIER: len(data)}).encode(), sealed_memfd([(data, 0)], len(data), MESSAGE_MEMFD_NAME)


def send(sock: socket.socket, obj: dict, fds: typing.Sequence[int] = (), limit: int = MAX_MESSAGE) -> None:
    """Send one message (a JSON object of at most ``limit`` bytes) with ``fds`` attached; waits
    while the socket's buffer is full (the server uses `frame` and never waits).

    Raises:
        ProtocolError: the message is over ``limit`` bytes or carries over `MAX_FDS` descriptors.
        OSError: the socket failed.
    """
    if len(fds) > MAX_FDS:
        raise ProtocolError(f"a registry message may carry at most {MAX_FDS} descriptors, not {len(fds)}")
    data, carrier = frame(obj, limit)
    try:
        socket.send_fds(sock, [data], [*fds, carrier] if carrier is not None else list(fds))
    finally:
        if carrier is not None:
            os.close(carrier)


def recv(sock: socket.socket, limit: int = MAX_MESSAGE) -> tuple[dict | None, list[int]]:
    """One message (its JSON at most ``limit`` bytes) and the descriptors that came with it;
    ``(None, [])`` when the peer closed.

    The caller owns the descriptors returned.  On a `ProtocolError` every received descriptor is
    closed first.

    Raises:
        ProtocolError: the message was empty, truncated (a datagram over `INLINE_MAX` bytes, or
            descriptors that could not all be received), over ``limit``, not a JSON object, or
            its memfd was not a sealed one.
        OSError: the socket failed (BlockingIOError: nothing to read on a non-blocking socket).
    """
    data, fds, flags, _ = socket.recv_fds(sock, INLINE_MAX, MAX_FDS + 3)
    try:
        if flags & socket.MSG_TRUNC:
            raise ProtocolError(f"registry message truncated: a datagram holds at most {INLINE_MAX} bytes "
                                "(wire.send carries larger messages in a memfd)")
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError(f"registry message truncated: its descriptors could not all be received (over "
                                f"{MAX_FDS}, or the receiver is out of descriptors)")
        if not data:
            if not fds and _hung_up(sock):
                return None, []
            raise ProtocolError("empty registry message")
        obj = _decode(data)
        if list(obj) == [_CARRIER]:
            if not fds:
                raise ProtocolError(f"a registry message of {brief(obj[_CARRIER])} bytes announced, but no memfd attached")
            obj = _decode(_read_carrier(fds.pop(), obj[_CARRIER], limit))
    except ProtocolError:
        _close_all(fds)
        raise
    return obj, fds


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer closed (a read of 0 bytes is also what an empty datagram gives)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)
    return any(events & (select.POLLHUP | select.POLLRDHUP) for _, events in poller.poll(0))


def _decode(data: bytes) -> dict:
    try:
        obj = json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ProtocolError("registry message is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"registry message is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"registry message must be a JSON object, got {type(obj).__name__}")
    return obj


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number the registry accepts")


def _finite(text: str) -> float:
    """A JSON number with a fraction or exponent; ``1e400`` reads as infinity, which no reply
    could carry back (``allow_nan=False``)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:32]} is not a finite number")
    return value


def _read_carrier(fd: int, nbytes, limit: int) -> bytes:
    """The JSON of a message that travels in a memfd (closed here, whatever happens)."""
    try:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 < nbytes <= limit:
            raise ProtocolError(f"a registry message announces {brief(nbytes)} bytes in a memfd; the limit is {limit}")
        try:
            check_sealed_memfd(fd, nbytes)  # sealed: nobody changes it while we read, reads never block
        except SegmentError as e:
            raise ProtocolError(f"a registry message's memfd is refused: {e}") from None
        chunks, done = [], 0
        while done < nbytes:
            chunks.append(os.pread(fd, nbytes - done, done))
            if not chunks[-1]:  # cannot be, sealed against shrinking: never loop on it
                raise ProtocolError(f"a registry message's memfd ends at {done} of its {nbytes} bytes")
            done += len(chunks[-1])
        return b"".join(chunks)
    finally:
        os.close(fd)


def brief(value, width: int = 60) -> str:
    """``repr(value)``, cut to ``width`` characters: error messages quote what a peer sent."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _close_all(fds: typing.Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)
