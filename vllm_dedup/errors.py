"""The exception types of vllm-dedup: one per kind of failure, all under `DedupError`.

What each means for an engine (docs/architecture.md, "Failures"): a registry or segment failure
leaves the tensors concerned private and the engine running, unless the user asked for
``on_registry_error="fail"``; a refused operation on shared weights and an unreadable
checkpoint are reported to the caller as they are.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable

__all__ = [
    "CheckpointError",
    "DedupError",
    "LockTimeout",
    "PackedWeightError",
    "ProtocolError",
    "RegistryRefused",
    "RegistryTimeout",
    "RegistryUnavailable",
    "SegmentError",
    "SharedWeightsError",
    "kept_unless_passing",
    "out_of_descriptors_or_memory",
]


class DedupError(Exception):
    """Base class of every error vllm-dedup raises on purpose."""


class RegistryUnavailable(DedupError, ConnectionError):
    """The registry cannot be reached, refused us, went away, or answered with an error."""


class RegistryTimeout(RegistryUnavailable):
    """The registry accepted the connection but did not answer in time: it is hung, stopped
    (SIGSTOP) or starved.  The connection is closed then (a late reply must never be read as the
    answer to a later request), and the engine goes on without the registry."""


class RegistryRefused(RegistryUnavailable):
    """The registry answered a request with an error (what it was asked is not recorded); the
    connection serves on."""


class LockTimeout(DedupError, TimeoutError):
    """A registry lock (a GPU's start-up lock) was still held by another engine when its
    timeout ran out; the message names the holder."""


class ProtocolError(RegistryUnavailable):
    """A registry message broke the protocol (`registry.messages`): not JSON, an unknown op, a
    missing or mistyped field, a field out of its limits, the wrong number of descriptors, or
    too big to send."""


class SegmentError(DedupError):
    """Shareable memory could not be created, exported, imported or mapped (a segment backend
    failed, or a received descriptor is not a sealed segment of the expected size)."""


class PackedWeightError(DedupError):
    """A oneDNN handler's packed weight (vLLM's CPU backend) cannot be found, checked or
    replaced on this CPU and vLLM build (`engine.onednn`); the message says which check failed.
    Nothing was written when it is raised."""


class SharedWeightsError(DedupError, RuntimeError):
    """An operation that writes weights in place was asked of an engine with shared weights;
    or a weight moved into shared memory could not be put back after a failure, so the engine
    would read a wrong one (the load stops)."""


class CheckpointError(DedupError):
    """A checkpoint cannot be read: missing, unreadable, truncated, corrupt or unknown.

    Attributes:
        path: the file or folder at fault.
        reason: what is wrong, and what to do about it.
    """

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


_PASSING_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def out_of_descriptors_or_memory(error: BaseException | None) -> bool:
    """Whether ``error``, or an error it was raised from or while handling, is this process or
    the system out of descriptors or memory (``EMFILE``, ``ENFILE``, ``ENOMEM``): a failure that
    may pass, so an answer it caused must not be kept for the process's life."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:  # a chain may loop back
        if isinstance(error, OSError) and error.errno in _PASSING_ERRNOS:
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def kept_unless_passing(passing: Callable[[object], bool]):
    """Decorator: keep a function's answer for the process, per arguments (`functools.cache`),
    except an answer for which ``passing(answer)`` is true (one caused by a failure that may
    pass: `out_of_descriptors_or_memory`): that answer is returned and the next call asks
    again (every kept answer of the function is forgotten then; they are cheap to ask)."""
    def decorate(fn):
        kept = functools.cache(fn)

        @functools.wraps(fn)
        def ask(*args, **kwargs):
            answer = kept(*args, **kwargs)
            if passing(answer):
                kept.cache_clear()
            return answer

        ask.cache_clear = kept.cache_clear  # as functools.cache's own
        return ask

    return decorate
