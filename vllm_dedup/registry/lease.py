"""An engine's lease on the registry: its connection, everything it holds through it, and the
re-registration of all that when the registry comes back after dying.

The lease is the connection (docs/architecture.md, "Registry"): while it is open, the segments
the engine maps and the locks it holds stay registered in its name.  If the registry dies
(crash, SIGKILL, an actor killed), the engine's mappings stay valid (descriptors and mappings
keep the memory), but a new registry would know nothing, and later engines would load
privately what is still resident.  So `Lease` remembers, per segment, a descriptor of it (its
own duplicate), its size, its uid and the content keys the engine knows in it, and the recipes
the engine gave or used; and a background thread (`watch`) waits for the connection to close.
When it does, the thread reconnects with backoff (starting the standalone daemon again when
that is what served the engine) and re-registers everything: hello, every segment (by uid: two
engines re-registering one segment store it once, `state.Registry.publish`), every recipe, the
load report.  The thread sleeps in ``poll`` on the socket and never touches the forward pass.

`Lease` offers the `client.BrokerClient` methods the engine side uses, and records what they
hold as they go.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import RegistryUnavailable, SegmentError
from .client import BrokerClient, SegmentHits
from .state import RegistryStats

__all__ = ["Lease"]

logger = logging.getLogger("vllm.dedup.lease")  # under "vllm": vLLM's handlers and format apply


@dataclass
class _Held:
    """A segment this engine holds: its own descriptor of it, size, and the keys it knows in it."""

    fd: int
    nbytes: int
    keys: dict[str, tuple[int, int]] = field(default_factory=dict)  # content key -> (offset, bytes)


class Lease:
    """This engine's registry connection and what it holds (module docstring).

    Args:
        client: a connected `BrokerClient` (not yet said hello).
        model, device, group, signature: what the engine says in ``hello``.
        start_daemon: a function that starts the standalone registry daemon on the client's
            socket (used when reconnecting finds nothing there and the engine's registry was
            that daemon), or None.

    Attributes:
        reregistrations: how many times this lease re-registered with a new registry.

    Raises (the constructor): RegistryUnavailable, as `BrokerClient.hello`.
    """

    def __init__(self, client: BrokerClient, model: str, device: str, group: str, signature: str = "",
                 start_daemon: Callable[[Path], None] | None = None):
        self._hello = (model, device, group, signature)
        self._start_daemon = start_daemon
        self._lock = threading.RLock()
        self._client = client
        self.engine_id = client.hello(*self._hello)
        self.group, self.path = group, client.path
        self._held: dict[str, _Held] = {}  # segment uid -> what re-registering it needs
        self._uid_of: dict[int, str] = {}  # segment id in the current registry -> uid
        self._recipes: dict[bytes, None] = {}  # recipes given or used, oldest first
        self._load: dict | None = None
        self.reregistrations = 0
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # what the engine side calls --------------------------------------------------------------
    def acquire(self, keys: list[str], uids: list[str] | None = None) -> list[SegmentHits]:
        with self._lock:
            found = self._client.acquire(keys, uids)
            for seg in found:
                if not seg.uid:
                    continue  # a registry that names no segments: nothing to re-register
                held = self._held.get(seg.uid)
                if held is None:
                    held = self._held[seg.uid] = _Held(os.dup(seg.fd), seg.nbytes)
                held.keys.update({hit.key: (hit.offset, hit.nbytes) for hit in seg.hits})
                self._uid_of[seg.segment] = seg.uid
            return found

    def publish(self, fd: int, nbytes: int, keys: list[tuple[str, int, int]]) -> int:
        """`BrokerClient.publish`, under a uid drawn here."""
        uid = uuid.uuid4().hex
        with self._lock:
            seg_id = self._client.publish(fd, nbytes, keys, uid)
            self._held[uid] = _Held(os.dup(fd), nbytes, {k: (o, n) for k, o, n in keys})
            self._uid_of[seg_id] = uid
            return seg_id

    def uid_of(self, segment: int) -> str:
        """The uid of a segment this engine holds (by its id in the current registry), or ""."""
        with self._lock:
            return self._uid_of.get(segment, "")

    def release(self, segments: list[int]) -> None:
        with self._lock:
            for seg_id in segments:
                held = self._held.pop(self._uid_of.pop(seg_id, ""), None)
                if held is not None:
                    os.close(held.fd)
            self._client.release(segments)

    def put_recipe(self, data: bytes) -> None:
        with self._lock:
            self._client.put_recipe(data)
            self.keep_recipe(data)

    def keep_recipe(self, data: bytes) -> None:
        """Remember a recipe this engine used, to give it to a registry that comes back."""
        with self._lock:
            self._recipes.pop(data, None)
            self._recipes[data] = None

    def report(self, load: dict) -> None:
        with self._lock:
            self._load = dict(load)
            self._client.report(load)

    def get_recipes(self, signature: str) -> list[bytes]:
        with self._lock:
            return self._client.get_recipes(signature)

    def expected_shared_bytes(self) -> int:
        with self._lock:
            return self._client.expected_shared_bytes()

    def stats(self) -> RegistryStats:
        with self._lock:
            return self._client.stats()

    def lock(self, names, owner: str | None = None, timeout_s: float = 600.0, poll_s: float = 0.05) -> None:
        with self._lock:
            client = self._client
        client.lock(names, owner, timeout_s, poll_s)  # polls: never hold the lease's lock meanwhile

    def unlock(self, names) -> None:
        with self._lock:
            client = self._client
        client.unlock(names)

    def locked(self, names, owner: str | None = None, timeout_s: float = 600.0, poll_s: float = 0.05):
        with self._lock:
            client = self._client
        return client.locked(names, owner, timeout_s, poll_s)

    @property
    def held_segments(self) -> int:
        return len(self._held)

    # the registry coming back ------------------------------------------------------------------
    def watch(self) -> None:
        """Start the background thread that re-registers with a registry that comes back."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="vllm-dedup-lease", daemon=True)
            self._watcher.start()

    def close(self) -> None:
        """Stop watching, close the connection and every descriptor kept."""
        self._stop.set()
        with self._lock:
            self._client.close()
            for held in self._held.values():
                os.close(held.fd)
            self._held.clear()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if not self._closed(timeout_s=1.0):
                continue
            logger.warning("vllm-dedup: the registry at %s went away; this engine keeps its weights and will "
                           "re-register them with the next one", self.path)
            delay = 0.2
            while not self._stop.is_set():
                try:
                    self._reregister()
                    break
                except (RegistryUnavailable, SegmentError, OSError) as e:
                    logger.debug("vllm-dedup: no registry yet (%s); retrying in %.1f s", e, delay)
                    self._stop.wait(delay)
                    delay = min(delay * 2, 5.0)

    def _closed(self, timeout_s: float) -> bool:
        """Whether the registry closed the connection (waits up to ``timeout_s``).  Only a
        hang-up counts: a reply arriving for a request in flight is left to its reader."""
        poller = select.poll()
        with self._lock:
            sock = self._client._sock
            if sock.fileno() < 0:
                return True
            poller.register(sock, select.POLLRDHUP)
        return bool(poller.poll(timeout_s * 1000))

    def _reregister(self) -> None:
        client = self._reopen()
        try:
            with self._lock:
                client.hello(*self._hello)
                uid_of = {}
                for uid, held in self._held.items():
                    keys = [(k, o, n) for k, (o, n) in held.keys.items()]
                    uid_of[client.publish(held.fd, held.nbytes, keys, uid)] = uid
                for data in self._recipes:
                    client.put_recipe(data)
                self.reregistrations += 1
                if self._load is not None:
                    client.report({**self._load, "reregistered": self.reregistrations})
                old, self._client, self._uid_of = self._client, client, uid_of
                self.engine_id = client.engine_id
                old.close()
        except BaseException:
            client.close()
            raise
        logger.info("vllm-dedup: re-registered with the registry at %s: %d segment(s) (%.1f MB), %d recipe(s)",
                    self.path, len(self._held), sum(h.nbytes for h in self._held.values()) / 1e6, len(self._recipes))

    def _reopen(self) -> BrokerClient:
        try:
            return BrokerClient(self.path)
        except RegistryUnavailable:
            if self._start_daemon is None:
                raise
        self._start_daemon(self.path)
        return BrokerClient(self.path)
