"""The registry's wire protocol: where its socket lives, how messages are framed, and every
message's shape, defined once for the server and the client.

Ray cannot carry file descriptors, so the registry's process serves a Unix socket
(docs/architecture.md, "Registry").  Each message is one ``SOCK_SEQPACKET`` datagram of JSON;
descriptors ride along with ``SCM_RIGHTS`` (``socket.send_fds``/``recv_fds``).  SEQPACKET keeps
message boundaries, so a descriptor always arrives with the message it belongs to.

Security: the socket lives in a private directory (mode 0700, owned by the user, not a symlink;
`ensure_private_dir`) and the server checks each peer's uid with ``SO_PEERCRED`` (`peer_uid`).

Requests (one dataclass each, below; ``op`` names it on the wire) and their replies:

====================  ===================================================================
``hello``             pid, model, device, group, signature -> engine id (the connection becomes
                      a lease)
``acquire``           keys -> hits ``[key, segment, offset, bytes]``; one fd per hit segment
``publish``           bytes, keys ``[[key, offset, bytes]]`` + 1 fd -> segment id
``release``           segments -> {}
``report``            load (the engine's `engine.share.ShareResult` numbers) -> {}
``lock``              names, owner -> granted (bool; all or none), holder_pid (when not granted)
``unlock``            names -> {}
``expect``            -> bytes (`Registry.expected_shared_bytes` for this engine)
``put_recipe``        bytes + 1 fd (a sealed memfd holding the recipe's JSON) -> {}
``get_recipes``       signature -> sizes; one fd per recipe, newest first
``stats``             -> `state.RegistryStats` as a dict
``shutdown``          force -> stopping (refused while engines are connected, unless forced)
====================  ===================================================================

Any request may instead be answered ``{"error": message}``.  Every field is type-checked on
arrival (`Message.from_wire`): a bad message gets a `ProtocolError` that names the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat
import struct
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..errors import ProtocolError, RegistryUnavailable

__all__ = [
    "DEFAULT_NAMESPACE", "MAX_FDS", "MAX_MESSAGE", "REQUESTS",
    "Acquire", "AcquireReply", "Empty", "Expect", "ExpectReply", "GetRecipes", "Hello", "HelloReply", "Lock",
    "LockReply", "Message", "Publish", "PublishReply", "PutRecipe", "RecipesReply", "Release", "Report", "Shutdown",
    "ShutdownReply", "Stats", "Unlock",
    "ensure_private_dir", "parse_request", "peer_uid", "recv", "runtime_dir", "send", "socket_path",
]

MAX_MESSAGE = 1 << 20  # bytes of one message's JSON
MAX_FDS = 250  # descriptors per message: below the kernel's SCM_MAX_FD (253)
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
def send(sock: socket.socket, obj: dict, fds: typing.Sequence[int] = ()) -> None:
    """Send one message (a JSON object) with ``fds`` attached.

    Raises:
        ProtocolError: the message is over `MAX_MESSAGE` bytes or carries over `MAX_FDS` descriptors.
        OSError: the socket failed.
    """
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"a registry message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE}")
    if len(fds) > MAX_FDS:
        raise ProtocolError(f"a registry message may carry at most {MAX_FDS} descriptors, not {len(fds)}")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the descriptors that came with it; ``(None, [])`` when the peer closed.

    The caller owns the descriptors returned.  On a `ProtocolError` every received descriptor is
    closed first.

    Raises:
        ProtocolError: the message was truncated (too big, or too many descriptors) or is not a
            JSON object.
        OSError: the socket failed.
    """
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS + 3)
    try:
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            raise ProtocolError(f"registry message truncated (over {MAX_MESSAGE} bytes or {MAX_FDS} descriptors)")
        if not data:
            _close_all(fds)
            return None, []
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, ValueError) as e:
            raise ProtocolError(f"registry message is not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ProtocolError(f"registry message must be a JSON object, got {type(obj).__name__}")
    except ProtocolError:
        _close_all(fds)
        raise
    return obj, fds


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
            ProtocolError: a required field is missing or a field has the wrong type (the
                message names it).
        """
        hints = typing.get_type_hints(cls)
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


def _convert(value, hint, where: str):
    """``value`` checked against the type ``hint`` (str, int, float, bool, dict, None, and
    list/tuple/Optional of those), converted where JSON lost the type (tuples)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], where)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where} must be a list, got {type(value).__name__}")
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
    return value


class Hello(Message, op="hello"):
    """Make this connection an engine's lease."""

    pid: int
    model: str
    device: str  # a device key (`segments.Segment.device_key`)
    group: str  # the share group
    signature: str = ""  # what decides its tensors' bytes (`engine.session.load_signature`)


class Acquire(Message, op="acquire"):
    """Look up content keys; hold the segments of the hits."""

    keys: list[str]


class Publish(Message, op="publish", fds=1):
    """A new segment (its descriptor attached) holding tensors at offsets."""

    nbytes: int
    keys: list[tuple[str, int, int]]  # (content key, offset, bytes)


class Release(Message, op="release"):
    """The engine no longer maps these segments."""

    segments: list[int]


class Report(Message, op="report"):
    """The engine's load outcome (numbers only are kept)."""

    load: dict


class Lock(Message, op="lock"):
    """Take registry locks, all or none; ``owner`` shares them between connections."""

    names: list[str]
    owner: str | None = None


class Unlock(Message, op="unlock"):
    names: list[str]


class Expect(Message, op="expect"):
    """Bytes this engine is predicted to map (`Registry.expected_shared_bytes`)."""


class PutRecipe(Message, op="put_recipe", fds=1):
    """A recipe for the engine's share group: its JSON (`engine.recipe.Recipe.to_bytes`) in a
    sealed memfd of ``nbytes`` bytes, attached."""

    nbytes: int


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
        raise ProtocolError(f"unknown op {op!r}; known: {', '.join(REQUESTS)}")
    if len(fds) != cls.fds:
        raise ProtocolError(f"request {op!r} carries exactly {cls.fds} descriptor(s), got {len(fds)}")
    return cls.from_wire(msg)


class Empty(Message):
    """The reply of requests that return nothing."""


class HelloReply(Message):
    engine: int


class AcquireReply(Message):
    """Hits, and the segments whose descriptors are attached, in that order."""

    hits: list[tuple[str, int, int, int]] = field(default_factory=list)  # key, segment, offset, bytes
    segments: list[int] = field(default_factory=list)


class PublishReply(Message):
    segment: int


class LockReply(Message):
    granted: bool
    holder_pid: int | None = None


class ExpectReply(Message):
    bytes: int


class RecipesReply(Message):
    """The recipes' sizes in bytes, in the order of the attached memfds."""

    sizes: list[int] = field(default_factory=list)


class ShutdownReply(Message):
    stopping: bool
