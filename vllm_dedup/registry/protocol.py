"""The registry's wire protocol: where its socket lives, how messages are framed, and every
message's shape, defined once for the server and the client.

Ray cannot carry file descriptors, so the registry's process serves a Unix socket
(docs/architecture.md, "Registry").  Each message is one ``SOCK_SEQPACKET`` datagram of JSON;
descriptors ride along with ``SCM_RIGHTS`` (``socket.send_fds``/``recv_fds``).  SEQPACKET keeps
message boundaries, so a descriptor always arrives with the message it belongs to.

Framing (`frame`, `send`, `recv`): JSON of up to `INLINE_MAX` bytes travels in the datagram.
Larger JSON (up to `MAX_MESSAGE` for a request, `MAX_REPLY` for a reply; the kernel refuses
datagrams over about 200 kB) is written to a sealed memfd attached last, and the datagram says
only ``{"$memfd": <bytes>}``.  A zero-length datagram is a bad message, not a hang-up: only a
peer that really closed (``POLLHUP``) ends a connection.  NaN and infinities are refused.

Limits every field obeys (`Message.from_wire`): a string holds at most `MAX_STRING` characters,
a list at most `MAX_ITEMS` items, an int fits in 64 bits or in its field's `Range`.  Requests
check what spans fields (a publish's tensors lie inside its segment) in ``__post_init__``.

Security: the socket lives in a private directory (mode 0700, owned by the user, not a symlink;
`ensure_private_dir`) and the server checks each peer's uid with ``SO_PEERCRED`` (`peer_uid`).

Requests (one dataclass each, below; ``op`` names it on the wire) and their replies:

====================  ===================================================================
``hello``             pid, model, device, group, signature -> engine id (the connection becomes
                      a lease)
``acquire``           keys -> hits ``[key, segment, offset, bytes]``; one fd per hit segment
``publish``           bytes, keys ``[[key, offset, bytes]]`` + 1 fd -> segment id
``release``           segments -> {}
``report``            load (the engine's `engine.context.LoadReport` numbers) -> {}
``lock``              names, owner, reclaim -> granted (bool; all or none), holder_pid (when not
                      granted), recovering (refused: a restarted registry waits for engines to
                      reclaim their locks)
``unlock``            names -> {}
``expect``            -> bytes (`Registry.expected_shared_bytes` for this engine)
``put_recipe``        bytes + 1 fd (a sealed memfd holding the recipe's JSON) -> {}
``get_recipes``       signature -> sizes; one fd per recipe, newest first
``stats``             -> `state.RegistryStats` as a dict
``shutdown``          force -> stopping (refused while engines are connected, unless forced)
====================  ===================================================================

Any request may instead be answered ``{"error": message}``.  Every field is type-checked on
arrival (`Message.from_wire`): a bad message gets a `ProtocolError` that names the field.
The server checks a published descriptor before it keeps it (`server.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import socket
import stat
import struct
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..errors import ProtocolError, RegistryUnavailable, SegmentError
from ..segments.host import MESSAGE_MEMFD_NAME, check_sealed_memfd, sealed_memfd

__all__ = [
    "DEFAULT_NAMESPACE", "INLINE_MAX", "MAX_FDS", "MAX_ITEMS", "MAX_MESSAGE", "MAX_REPLY", "MAX_STRING", "REQUESTS",
    "Acquire", "AcquireReply", "Empty", "Expect", "ExpectReply", "GetRecipes", "Hello", "HelloReply", "Lock",
    "LockReply", "Message", "Publish", "PublishReply", "PutRecipe", "Range", "RecipesReply", "Release", "Report",
    "Shutdown", "ShutdownReply", "Stats", "Unlock",
    "ensure_private_dir", "frame", "parse_request", "peer_uid", "recv", "runtime_dir", "send", "socket_path",
]

MAX_MESSAGE = 1 << 20  # bytes of one message's JSON
MAX_REPLY = 16 << 20  # bytes of one reply's JSON: stats grow with the engines connected
INLINE_MAX = 64 << 10  # bytes of JSON sent in the datagram itself; larger JSON goes in a memfd
MAX_FDS = 250  # descriptors per message: below the kernel's SCM_MAX_FD (253)
MAX_STRING = 4096  # characters of any string field (PATH_MAX: a model may be named by its path)
MAX_ITEMS = 1 << 16  # items of any list field
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


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


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
                                "(protocol.send carries larger messages in a memfd)")
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
                raise ProtocolError(f"a registry message of {_brief(obj[_CARRIER])} bytes announced, but no memfd attached")
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
        obj = json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise ProtocolError("registry message is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"registry message is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"registry message must be a JSON object, got {type(obj).__name__}")
    return obj


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number the registry accepts")


def _read_carrier(fd: int, nbytes, limit: int) -> bytes:
    """The JSON of a message that travels in a memfd (closed here, whatever happens)."""
    try:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 < nbytes <= limit:
            raise ProtocolError(f"a registry message announces {_brief(nbytes)} bytes in a memfd; the limit is {limit}")
        try:
            check_sealed_memfd(fd, nbytes)  # sealed: nobody changes it while we read, reads never block
        except SegmentError as e:
            raise ProtocolError(f"a registry message's memfd is refused: {e}") from None
        chunks, done = [], 0
        while done < nbytes:
            chunks.append(os.pread(fd, nbytes - done, done))
            done += len(chunks[-1])
        return b"".join(chunks)
    finally:
        os.close(fd)


def _brief(value, width: int = 60) -> str:
    """``repr(value)``, cut to ``width`` characters: error messages quote what a peer sent."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _close_all(fds: typing.Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)


# messages ----------------------------------------------------------------------------------
class Message:
    """A message's fields, typed.  A subclass is a frozen dataclass of its fields; a request
    names its ``op`` (its name on the wire) and ``fds`` (how many descriptors it carries) in its
    class statement: ``class Publish(Message, op="publish", fds=1)``."""

    op: ClassVar[str] = ""
    fds: ClassVar[int] = 0

    def __init_subclass__(cls, op: str = "", fds: int = 0, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.op, cls.fds = op, fds
        dataclass(frozen=True)(cls)

    def to_wire(self) -> dict:
        """The JSON object to send (``op`` included for requests)."""
        body = {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return {"op": self.op, **body} if self.op else body

    @classmethod
    def from_wire(cls, msg: dict):
        """Check and convert a received JSON object.

        Raises:
            ProtocolError: a required field is missing, a field has the wrong type or is out
                of its limits (`MAX_STRING`, `MAX_ITEMS`, 64 bits, its `Range`), or the fields
                disagree (``__post_init__``); the message names the field.
        """
        hints = typing.get_type_hints(cls, include_extras=True)
        values = {}
        for f in dataclasses.fields(cls):
            if f.name not in msg:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ProtocolError(f"{cls._what()}: missing field {f.name!r}")
                continue
            values[f.name] = _convert(msg[f.name], hints[f.name], f"{cls._what()} field {f.name!r}")
        return cls(**values)

    @classmethod
    def _what(cls) -> str:
        return f"request {cls.op!r}" if cls.op else f"reply {cls.__name__}"


def _to_json(value):
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    return value


@dataclass(frozen=True)
class Range:
    """Bounds (inclusive) of an int field: ``nbytes: Annotated[int, Range(0, MAX_BYTES)]``."""

    low: int
    high: int


MAX_BYTES = (1 << 63) - 1  # sizes and offsets: what fits in an off_t
Bytes = typing.Annotated[int, Range(0, MAX_BYTES)]
_INT64 = Range(-(1 << 63), (1 << 63) - 1)  # any int: what other languages' JSON readers hold


def _convert(value, hint, where: str, bounds: Range = _INT64):
    """``value`` checked against the type ``hint`` (str, int, float, bool, dict, None, and
    list/tuple/Optional/Annotated-with-`Range` of those) and the limits of the module
    docstring, converted where JSON lost the type (tuples)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return _convert(value, args[0], where, next(a for a in args[1:] if isinstance(a, Range)))
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], where)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where} must be a list, got {type(value).__name__}")
        if len(value) > MAX_ITEMS:
            raise ProtocolError(f"{where} holds {len(value)} items; the limit is {MAX_ITEMS}")
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list) or len(value) != len(args):
            raise ProtocolError(f"{where} must be a list of {len(args)} items")
        return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise ProtocolError(f"{where} must be {getattr(hint, '__name__', hint)}, got {type(value).__name__}")
    if hint is int and not bounds.low <= value <= bounds.high:
        raise ProtocolError(f"{where} must be between {bounds.low} and {bounds.high}, not {_brief(value)}")
    if hint is str and len(value) > MAX_STRING:
        raise ProtocolError(f"{where} holds {len(value)} characters; the limit is {MAX_STRING}")
    return value


class Hello(Message, op="hello"):
    """Make this connection an engine's lease."""

    pid: typing.Annotated[int, Range(1, (1 << 31) - 1)]
    model: str
    device: str  # a device key (`segments.Segment.device_key`)
    group: str  # the share group
    signature: str = ""  # what decides its tensors' bytes (`engine.session.load_signature`)


class Acquire(Message, op="acquire"):
    """Look up content keys; hold the segments of the hits.  With ``uids`` (one per key), a key
    is a hit only in the segment of that uid (a recipe names the segments its maker used:
    docs/architecture.md, "Trust"), never in another segment claiming the same key."""

    keys: list[str]
    uids: list[str] = field(default_factory=list)

    def __post_init__(self):
        if len(self.keys) > MAX_FDS:  # one descriptor per segment hit
            raise ProtocolError(f"{self._what()}: at most {MAX_FDS} keys per request, not {len(self.keys)}")
        if self.uids and len(self.uids) != len(self.keys):
            raise ProtocolError(f"{self._what()}: {len(self.uids)} uids for {len(self.keys)} keys (one per key, "
                                "or none)")


class Publish(Message, op="publish", fds=1):
    """A segment (its descriptor attached) holding tensors at offsets.  ``uid`` names the
    segment for good (its publisher draws it): an engine re-registering a segment it holds
    after a registry restart sends it again, and a segment already known by its uid is held,
    not stored twice (`Registry.publish`)."""

    nbytes: Bytes
    keys: list[tuple[str, Bytes, Bytes]]  # (content key, offset, bytes)
    uid: str = ""

    def __post_init__(self):
        if not self.keys:
            raise ProtocolError(f"{self._what()}: no keys; a segment holds at least one tensor")
        for i, (_, offset, size) in enumerate(self.keys):
            if offset + size > self.nbytes:
                raise ProtocolError(f"{self._what()}: key {i} ({offset} + {size} bytes) ends past nbytes {self.nbytes}")


class Release(Message, op="release"):
    """The engine no longer maps these segments."""

    segments: list[int]


class Report(Message, op="report"):
    """The engine's load outcome (numbers and strings are kept)."""

    load: dict

    MAX_ENTRIES: ClassVar[int] = 64  # a `engine.context.LoadReport` has about ten

    def __post_init__(self):
        if len(self.load) > self.MAX_ENTRIES:
            raise ProtocolError(f"{self._what()}: load holds {len(self.load)} entries; the limit is {self.MAX_ENTRIES}")
        if long := [k for k in self.load if len(k) > 64]:
            raise ProtocolError(f"{self._what()}: load key {_brief(long[0])} is over 64 characters")
        collisions = self.load.get("collisions", 0)
        if not isinstance(collisions, int) or isinstance(collisions, bool) or not 0 <= collisions <= MAX_BYTES:
            raise ProtocolError(f"{self._what()}: load 'collisions' must be an int >= 0, not {_brief(collisions)}")


class Lock(Message, op="lock"):
    """Take registry locks, all or none; ``owner`` shares them between connections.
    ``reclaim``: the engine held them in a registry that died and re-registers them
    (`Registry.try_lock`)."""

    names: list[str]
    owner: str | None = None
    reclaim: bool = False


class Unlock(Message, op="unlock"):
    names: list[str]


class Expect(Message, op="expect"):
    """Bytes this engine is predicted to map (`Registry.expected_shared_bytes`)."""


class PutRecipe(Message, op="put_recipe", fds=1):
    """A recipe for the engine's share group: its JSON (`engine.recipe.Recipe.to_bytes`) in a
    sealed memfd of ``nbytes`` bytes, attached."""

    nbytes: Bytes


class GetRecipes(Message, op="get_recipes"):
    """The recipes kept for a load signature in the engine's share group, newest first."""

    signature: str


class Stats(Message, op="stats"):
    """The registry's `state.RegistryStats`."""


class Shutdown(Message, op="shutdown"):
    """Stop the registry; refused while engines are connected unless ``force``."""

    force: bool = False


REQUESTS: dict[str, type[Message]] = {
    cls.op: cls for cls in (Hello, Acquire, Publish, Release, Report, Lock, Unlock, Expect, PutRecipe, GetRecipes,
                            Stats, Shutdown)
}


def parse_request(msg: dict, fds: list[int]) -> Message:
    """The typed request of a received message.

    Raises:
        ProtocolError: unknown op, bad fields, or not the number of descriptors the op carries.
    """
    op = msg.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"unknown op {_brief(op)}; known: {', '.join(REQUESTS)}")
    if len(fds) != cls.fds:
        raise ProtocolError(f"request {op!r} carries exactly {cls.fds} descriptor(s), got {len(fds)}")
    return cls.from_wire(msg)


class Empty(Message):
    """The reply of requests that return nothing."""


class HelloReply(Message):
    engine: int


class AcquireReply(Message):
    """Hits, and the segments whose descriptors are attached, in that order, with each
    segment's uid and size in bytes (what re-registering it needs)."""

    hits: list[tuple[str, int, int, int]] = field(default_factory=list)  # key, segment, offset, bytes
    segments: list[int] = field(default_factory=list)
    uids: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


class PublishReply(Message):
    segment: int


class LockReply(Message):
    """``granted``, else who holds a lock (``holder_pid``), or ``recovering``: a registry that
    replaced one that died refuses new locks for a while, so that the engines re-registering
    reclaim theirs first."""

    granted: bool
    holder_pid: int | None = None
    recovering: bool = False


class ExpectReply(Message):
    bytes: int


class RecipesReply(Message):
    """The recipes' sizes in bytes, in the order of the attached memfds."""

    sizes: list[int] = field(default_factory=list)


class ShutdownReply(Message):
    stopping: bool
