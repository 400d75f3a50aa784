"""The registry's messages: every request and reply, one frozen dataclass each, defined once for
the server and the client, and checked field by field on arrival (`Message.from_wire`).  How a
message travels is `wire.py`.

Limits every field obeys (`Message.from_wire`): a string holds at most `MAX_STRING` characters,
a list at most `MAX_ITEMS` items, an int fits in 64 bits or in its field's `Range`.  Requests
check what spans fields (a publish's tensors lie inside its segment) in ``__post_init__``.

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
import types
import typing
from dataclasses import dataclass, field
from typing import ClassVar

from ..errors import ProtocolError
from .wire import MAX_FDS, brief

__all__ = [
    "MAX_ITEMS", "MAX_STRING", "REQUESTS", "Acquire", "AcquireReply", "Bytes", "Empty", "Expect", "ExpectReply",
    "GetRecipes", "Hello", "HelloReply", "Lock", "LockReply", "Message", "Publish", "PublishReply", "PutRecipe",
    "Range", "RecipesReply", "Release", "Report", "Shutdown", "ShutdownReply", "Stats", "Unlock", "parse_request",
]

MAX_STRING = 4096  # characters of any string field (PATH_MAX: a model may be named by its path)
MAX_ITEMS = 1 << 16  # items of any list field


class Message:
    """A message's fields, typed.  Each subclass is a frozen dataclass of its fields
    (``@dataclass(frozen=True)``); a request names its ``op`` (its name on the wire) and ``fds``
    (how many descriptors it carries) in its class statement:
    ``class Publish(Message, op="publish", fds=1)``."""

    op: ClassVar[str] = ""
    fds: ClassVar[int] = 0

    def __init_subclass__(cls, op: str = "", fds: int = 0, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.op, cls.fds = op, fds

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
# A recipe's JSON: the registry maps and parses it on the thread that serves every engine, so
# a peer may not make it read much: 64 MiB parses in about 2 s here (256 MiB took 8 s, long
# enough for other engines' calls to time out).  A recipe holds one entry per tensor of the
# model (about 250 bytes with its key), plus tensors under 64 KiB inline (``min_tensor_bytes``
# up to 1 MiB): a 405B Llama's 253 norms are 11 MB of it, and 64 MiB is about 280,000 entries.
MAX_RECIPE_BYTES = 64 << 20


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
        raise ProtocolError(f"{where} must be between {bounds.low} and {bounds.high}, not {brief(value)}")
    if hint is str and len(value) > MAX_STRING:
        raise ProtocolError(f"{where} holds {len(value)} characters; the limit is {MAX_STRING}")
    return value


@dataclass(frozen=True)
class Hello(Message, op="hello"):
    """Make this connection an engine's lease."""

    pid: typing.Annotated[int, Range(1, (1 << 31) - 1)]
    model: str
    device: str  # a device key (`segments.Segment.device_key`)
    group: str  # the share group
    signature: str = ""  # what decides its tensors' bytes (`engine.session.load_signature`)


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Release(Message, op="release"):
    """The engine no longer maps these segments."""

    segments: list[int]


@dataclass(frozen=True)
class Report(Message, op="report"):
    """The engine's load outcome: numbers and strings (others are dropped); ``collisions`` and
    ``shared_bytes``, which `state.Registry.stats` totals, are ints >= 0.  Every string value
    holds at most `MAX_STRING` characters and every int fits in 64 bits: each engine's report
    goes into every `stats` reply, which has a size limit of its own."""

    load: dict

    MAX_ENTRIES: ClassVar[int] = 64  # a `engine.context.LoadReport` has about ten
    MAX_KEY: ClassVar[int] = 64  # characters of an entry's name

    @classmethod
    def fitted(cls, load: dict) -> dict:
        """``load`` cut to what this message accepts: strings to `MAX_STRING` characters; an int
        past 64 bits, a key over `MAX_KEY` characters, and any other value left out; at most
        `MAX_ENTRIES` entries.  An engine's own report may hold an exception's text."""
        out = {}
        for name, value in load.items():
            if len(out) == cls.MAX_ENTRIES:
                break
            if not isinstance(name, str) or len(name) > cls.MAX_KEY:
                continue
            if isinstance(value, str):
                out[name] = value[:MAX_STRING]
            elif isinstance(value, float) or (isinstance(value, int) and _INT64.low <= value <= _INT64.high):
                out[name] = value
        return out

    def __post_init__(self):
        if len(self.load) > self.MAX_ENTRIES:
            raise ProtocolError(f"{self._what()}: load holds {len(self.load)} entries; the limit is {self.MAX_ENTRIES}")
        if long := [k for k in self.load if len(k) > self.MAX_KEY]:
            raise ProtocolError(f"{self._what()}: load key {brief(long[0])} is over {self.MAX_KEY} characters")
        for name, value in self.load.items():
            if isinstance(value, str) and len(value) > MAX_STRING:
                raise ProtocolError(f"{self._what()}: load {name!r} is over {MAX_STRING} characters")
            if isinstance(value, int) and not _INT64.low <= value <= _INT64.high:
                raise ProtocolError(f"{self._what()}: load {name!r} does not fit in 64 bits")
        for name in ("collisions", "shared_bytes"):
            value = self.load.get(name, 0)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_BYTES:
                raise ProtocolError(f"{self._what()}: load {name!r} must be an int >= 0, not {brief(value)}")


@dataclass(frozen=True)
class Lock(Message, op="lock"):
    """Take registry locks, all or none; ``owner`` shares them between connections.
    ``reclaim``: the engine held them in a registry that died and re-registers them
    (`Registry.try_lock`)."""

    names: list[str]
    owner: str | None = None
    reclaim: bool = False


@dataclass(frozen=True)
class Unlock(Message, op="unlock"):
    names: list[str]


@dataclass(frozen=True)
class Expect(Message, op="expect"):
    """Bytes this engine is predicted to map (`Registry.expected_shared_bytes`)."""


@dataclass(frozen=True)
class PutRecipe(Message, op="put_recipe", fds=1):
    """A recipe for the engine's share group: its JSON (`engine.recipe.Recipe.to_bytes`) in a
    sealed memfd of ``nbytes`` bytes (at most `MAX_RECIPE_BYTES`), attached."""

    nbytes: typing.Annotated[int, Range(0, MAX_RECIPE_BYTES)]


@dataclass(frozen=True)
class GetRecipes(Message, op="get_recipes"):
    """The recipes kept for a load signature in the engine's share group, newest first."""

    signature: str


@dataclass(frozen=True)
class Stats(Message, op="stats"):
    """The registry's `state.RegistryStats`."""


@dataclass(frozen=True)
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
        raise ProtocolError(f"unknown op {brief(op)}; known: {', '.join(REQUESTS)}")
    if len(fds) != cls.fds:
        raise ProtocolError(f"request {op!r} carries exactly {cls.fds} descriptor(s), got {len(fds)}")
    return cls.from_wire(msg)


@dataclass(frozen=True)
class Empty(Message):
    """The reply of requests that return nothing."""


@dataclass(frozen=True)
class HelloReply(Message):
    engine: int


@dataclass(frozen=True)
class AcquireReply(Message):
    """Hits, and the segments whose descriptors are attached, in that order, with each
    segment's uid and size in bytes (what re-registering it needs)."""

    hits: list[tuple[str, int, int, int]] = field(default_factory=list)  # key, segment, offset, bytes
    segments: list[int] = field(default_factory=list)
    uids: list[str] = field(default_factory=list)
    sizes: list[Bytes] = field(default_factory=list)

    def __post_init__(self):
        if not len(self.segments) == len(self.uids) == len(self.sizes) == len(set(self.segments)):
            raise ProtocolError(f"{self._what()}: {len(self.segments)} segments (distinct?), {len(self.uids)} uids "
                                f"and {len(self.sizes)} sizes")
        size = dict(zip(self.segments, self.sizes))
        for key, seg, offset, nbytes in self.hits:
            if seg not in size or not 0 <= offset <= offset + nbytes <= size[seg]:
                raise ProtocolError(f"{self._what()}: hit {brief(key)} ({nbytes} bytes at {offset}) is not inside a "
                                    f"segment of the reply")
        if unhit := set(self.segments) - {seg for _, seg, _, _ in self.hits}:
            raise ProtocolError(f"{self._what()}: segment {min(unhit)} has no hit")


@dataclass(frozen=True)
class PublishReply(Message):
    segment: int


@dataclass(frozen=True)
class LockReply(Message):
    """``granted``, else who holds a lock (``holder_pid``), or ``recovering``: a registry that
    replaced one that died refuses new locks for a while, so that the engines re-registering
    reclaim theirs first."""

    granted: bool
    holder_pid: int | None = None
    recovering: bool = False


@dataclass(frozen=True)
class ExpectReply(Message):
    bytes: Bytes


@dataclass(frozen=True)
class RecipesReply(Message):
    """The recipes' sizes in bytes, in the order of the attached memfds: each at most what a
    recipe may be (a registry's larger one would be read whole into the engine's memory)."""

    sizes: list[typing.Annotated[int, Range(0, MAX_RECIPE_BYTES)]] = field(default_factory=list)


@dataclass(frozen=True)
class ShutdownReply(Message):
    stopping: bool
