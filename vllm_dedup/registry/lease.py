"""An engine's lease on the registry: its connection, everything it holds through it, and the
re-registration of all that when the registry comes back after dying.

The lease is the connection (docs/architecture.md, "Registry"): while it is open, the segments
the engine maps and the locks it holds stay registered in its name.  If the registry dies
(crash, SIGKILL, an actor killed), the engine's mappings stay valid (descriptors and mappings
keep the memory), but a new registry would know nothing, and later engines would load
privately what is still resident.  So `Lease` remembers, per segment, a descriptor of it (its
own duplicate), its size, its uid and the content keys the engine knows in it; the locks it
holds; and the recipes the engine gave or used.  When the connection closes it reconnects
(starting the standalone daemon again when that is what served the engine) and re-registers
everything: hello, every segment (by uid: two engines re-registering one segment store it
once, `state.Registry.publish`), every recipe, every lock it held (a *reclaim*: the new
registry grants reclaims only for a while, `state.Registry.begin_reclaim`, so that an engine in
the middle of publishing keeps its lock and a newcomer waits to map what it publishes), and the
load report.

Two things notice a registry that died:

- a call: a request on a connection the registry closed fails; the lease re-registers (trying
  for up to ``timeout_s``) and sends it again once.  So a load in progress goes on across a
  registry restart instead of keeping the rest of its tensors private;
- after loading, a background thread (`watch`) that sleeps in ``poll`` on the connection (a
  hang-up only; it never reads) and re-registers with backoff, for as long as it takes.  It
  never touches the forward pass.

A registry that does not answer (hung, SIGSTOPped) is another matter: the call waits
``timeout_s`` once (`client.RegistryClient`), the connection is closed, the load goes on without
the registry, and the watcher re-registers once a registry answers again.

A lock that cannot be reclaimed (another engine took it first: the reclaim period was over) is
lost: until the engine gives it back (``unlock``, the end of its ``locked`` block), `acquire`
and `publish` fail with `RegistryUnavailable`, so what the lock protected stays private rather
than published twice.

Note [a lease on a registry still starting]
    The first engine on a node finds no registry and starts the daemon (0.11-0.17 s until it
    answers, on the 2-core machine of the README's figures), and a load needs the registry
    only in its sharing pass, seconds later: a new daemon holds nothing and no recipe, so the
    fast paths have nothing to find in it.  So the lease may be given the daemon's launch
    (`daemon.DaemonLaunch`) instead of a connection: ``launching`` says so (the loader then
    skips asking for recipes), and the first call waits for the daemon (up to `LAUNCH_WAIT_S`),
    connects and says hello (`_connection`).  A daemon that does not start fails that call, as a registry that
    died would; the calls after it try the socket once each (a lease that never connected
    holds nothing, and `watch` starts no watcher for it).  Under ``on_registry_error="fail"``
    the engine waits at once instead (`engine.session.EngineSession.connect`), so that it fails
    before loading.

`Lease` offers the `client.RegistryClient` methods the engine side uses, and records what they
hold as they go.  Segment ids it returns (in hits, from `publish`) are its own and stay valid
across registry restarts; `release` takes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import select
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from ..errors import RegistryRefused, RegistryUnavailable, SegmentError
from ..log import init_logger
from .client import RegistryClient, SegmentHits
from .daemon import DaemonLaunch
from .messages import Report
from .state import RegistryStats

__all__ = ["LAUNCH_WAIT_S", "STOP_AFTER_PUBLISHES_ENV", "Lease"]

LAUNCH_WAIT_S = 60.0  # seconds a lease waits for a daemon its engine launched to answer (`_connection`)

logger = init_logger(__name__)

# Test hook: when set to N, the process stops itself (SIGSTOP) right after its N-th publish made
# while holding a lock, so that a test can kill the registry at that exact point
# (tests/e2e/test_registry_faults.py).  The stop is sent to the publishing thread itself
# (tgkill): a process-directed SIGSTOP goes to the main thread first, and until that thread
# runs and stops the others, the publish thread could send the next publish already queued.
STOP_AFTER_PUBLISHES_ENV = "VLLM_DEDUP_TEST_STOP_AFTER_PUBLISHES"


@dataclass
class _Held:
    """A segment this engine holds: its own descriptor of it (-1: the registry named no uid for
    it, so it cannot be re-registered), size, uid, id in the current registry (-1: none), the
    keys the engine knows in it, and how many acquires (or the publish) of it are not released:
    the registry holds a segment once per engine, so a second acquire of a segment (a replay's,
    then the sharing pass's) must not let a release of one drop the other's hold."""

    fd: int
    nbytes: int
    uid: str
    registry_id: int
    keys: dict[str, tuple[int, int]] = field(default_factory=dict)  # content key -> (offset, bytes)
    uses: int = 1


class Lease:
    """This engine's registry connection and what it holds (module docstring).

    Args:
        client: a connected `RegistryClient` (not yet said hello), or the launch of a daemon
            this engine started, which the lease connects to when the engine first calls it
            (Note [a lease on a registry still starting]).
        model, device, group, signature: what the engine says in ``hello``.
        start_daemon: a function that starts the standalone registry daemon on the client's
            socket (used when reconnecting finds nothing there and the engine's registry was
            that daemon), or None.
        timeout_s: seconds a call waits for a registry that died to be back (re-registering
            with it) before it fails; also each reply's timeout on the connections the lease
            opens (default: the client's).

    Attributes:
        reregistrations: how many times this lease re-registered with a new registry.

    Raises (the constructor): RegistryUnavailable, as `RegistryClient.hello`.
    """

    def __init__(self, client: RegistryClient | DaemonLaunch, model: str, device: str, group: str,
                 signature: str = "", start_daemon: Callable[..., None] | None = None, timeout_s: float | None = None):
        self._hello = (model, device, group, signature)
        self._start_daemon = start_daemon
        self._timeout_s = client.timeout_s if timeout_s is None else timeout_s
        self._lock = threading.RLock()  # the one lock: every field below, and the connection
        self._launch: DaemonLaunch | None = None  # a daemon started, not yet connected to
        self._client: RegistryClient | None = None  # None: not connected yet (`_connection`)
        self.engine_id: int | None = None
        if isinstance(client, DaemonLaunch):
            self._launch = client
        else:
            self._client = client
            self.engine_id = client.hello(*self._hello)
        self.group, self.path = group, client.path
        self._held: dict[int, _Held] = {}  # this lease's segment id -> what re-registering it needs
        self._by_uid: dict[str, int] = {}  # segment uid -> this lease's id
        self._by_registry: dict[int, int] = {}  # the current registry's segment id -> this lease's id
        self._ids = itertools.count(1)
        self._locks: dict[str, str | None] = {}  # locks held now: name -> owner
        self._lost_locks: set[str] = set()  # held, not reclaimed after a restart, not yet given back
        self._recipes: dict[bytes, None] = {}  # recipes given or used, oldest first
        self._load: dict | None = None
        self.reregistrations = 0
        self._publishes = 0
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # what the engine side calls --------------------------------------------------------------
    @property
    def launching(self) -> bool:
        """Whether the registry is a daemon this engine started and has not called yet: one
        that holds nothing (Note [a lease on a registry still starting])."""
        return self._launch is not None

    def acquire(self, keys: list[str], uids: list[str] | None = None) -> list[SegmentHits]:
        """`RegistryClient.acquire`; each segment's id (and its hits') is this lease's id of it
        (`release`, `uid_of`).

        Raises:
            RegistryUnavailable: as `RegistryClient.acquire`, or a lock this lease held was lost
                across a registry restart (module docstring).
        """
        with self._lock:
            self._check_locks()
            found = self._call(lambda c: c.acquire(keys, uids))
            known = [self._known(seg) for seg in found]
            kept: dict[int, int] = {}  # registry id -> this lease's own descriptor of a new segment
            try:  # every descriptor first: a failure then leaves what the lease holds as it was
                for seg, lease_id in zip(found, known):
                    if lease_id is None and seg.uid:
                        kept[seg.segment] = os.dup(seg.fd)
            except OSError as e:  # out of descriptors: these holds cannot be kept
                for fd in [*kept.values(), *(unkept.fd for unkept in found)]:
                    os.close(fd)
                raise self._lost_track(f"acquire: {e}") from None
            for seg, lease_id in zip(found, known):
                if lease_id is None:
                    lease_id = next(self._ids)
                    self._held[lease_id] = _Held(kept.get(seg.segment, -1), seg.nbytes, seg.uid, seg.segment)
                    if seg.uid:
                        self._by_uid[seg.uid] = lease_id
                else:
                    self._held[lease_id].uses += 1
                held = self._held[lease_id]
                held.registry_id = seg.segment
                held.keys.update({hit.key: (hit.offset, hit.nbytes) for hit in seg.hits})
                self._by_registry[seg.segment] = lease_id
                seg.segment = lease_id
                seg.hits = [dataclasses.replace(hit, segment=lease_id) for hit in seg.hits]
            return found

    def _known(self, seg: SegmentHits) -> int | None:
        """This lease's id of a segment an acquire returned, if it holds it already (by its id
        in this registry, or by its uid across restarts); else None."""
        lease_id = self._by_registry.get(seg.segment)
        if lease_id is None and seg.uid:
            lease_id = self._by_uid.get(seg.uid)
        return lease_id

    def _lost_track(self, why: str) -> RegistryUnavailable:
        """The registry recorded holds that this lease cannot keep (no descriptor left to keep
        one with): the connection is closed, so that the registry drops them, as for a reply
        that cannot be read (Note [a reply that cannot be read] in ``client.py``); the watcher
        re-registers what the lease does hold.  The caller holds ``self._lock``; returns the
        error to raise."""
        self._client.abandon(f"a descriptor could not be kept ({why})")
        return RegistryUnavailable(f"registry at {self.path}: out of descriptors to keep what it holds ({why}); "
                                   "the connection is closed and its holds dropped")

    def uid_of(self, segment: int) -> str:
        """The uid of a segment this engine holds (by this lease's id of it), or ""."""
        with self._lock:
            held = self._held.get(segment)
            return held.uid if held is not None else ""

    def publish(self, fd: int, nbytes: int, keys: list[tuple[str, int, int]]) -> int:
        """`RegistryClient.publish`, under a uid drawn here; returns this lease's id of the segment.

        Raises:
            RegistryUnavailable: as `acquire`.
        """
        uid = uuid.uuid4().hex
        with self._lock:
            self._check_locks()
            seg_id = self._call(lambda c: c.publish(fd, nbytes, keys, uid))
            try:
                kept = os.dup(fd)
            except OSError as e:  # out of descriptors: a hold this lease could not re-register
                raise self._lost_track(f"publish: {e}") from None
            lease_id = next(self._ids)
            self._held[lease_id] = _Held(kept, nbytes, uid, seg_id, {k: (o, n) for k, o, n in keys})
            self._by_uid[uid] = lease_id
            self._by_registry[seg_id] = lease_id
            self._publishes += 1
            stop_here = self._locks and os.environ.get(STOP_AFTER_PUBLISHES_ENV) == str(self._publishes)
        if stop_here:
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return lease_id

    def release(self, segments: list[int]) -> None:
        """Give back one acquire of each of these segments (this lease's ids); the registry is
        told once none is left (`_Held`): the engine no longer maps it."""
        with self._lock:
            ids = []
            for lease_id in segments:
                held = self._held.get(lease_id)
                if held is None:
                    continue
                held.uses -= 1
                if held.uses > 0:
                    continue
                del self._held[lease_id]
                self._by_uid.pop(held.uid, None)
                if held.registry_id >= 0:
                    self._by_registry.pop(held.registry_id, None)
                    ids.append(held.registry_id)
                if held.fd >= 0:
                    os.close(held.fd)
            if ids:
                # After a re-registration the new registry never heard of them: nothing to send.
                self._call(lambda c: c.release(ids), again=False)

    def put_recipe(self, data: bytes) -> None:
        with self._lock:
            self._call(lambda c: c.put_recipe(data))
            self.keep_recipe(data)

    def keep_recipe(self, data: bytes) -> None:
        """Remember a recipe this engine used, to give it to a registry that comes back."""
        with self._lock:
            self._recipes.pop(data, None)
            self._recipes[data] = None

    def report(self, load: dict) -> None:
        """`RegistryClient.report` of ``load`` as the message accepts it (`messages.Report.fitted`:
        what is kept is sent again on each re-registration, which a refused value would fail
        every time); with ``reregistered`` (how many times this lease re-registered) once it has."""
        with self._lock:
            self._load = load = Report.fitted(load)
            self._call(lambda c: c.report({**load, "reregistered": self.reregistrations} if self.reregistrations
                                          else load))

    def get_recipes(self, signature: str) -> list[bytes]:
        with self._lock:
            return self._call(lambda c: c.get_recipes(signature))

    def expected_shared_bytes(self) -> int:
        with self._lock:
            return self._call(lambda c: c.expected_shared_bytes())

    def stats(self) -> RegistryStats:
        with self._lock:
            return self._call(lambda c: c.stats())

    def lock(self, names, owner: str | None = None, timeout_s: float = 600.0, poll_s: float = 0.05) -> None:
        """`RegistryClient.lock`, across registry restarts: a registry that dies while this waits
        is re-registered with (`timeout_s` of the lease), and the wait goes on there.  Held
        locks are reclaimed by a re-registration.

        Raises:
            TimeoutError: as `RegistryClient.lock`.
            RegistryUnavailable: as `RegistryClient.lock`, or no registry came back in time.
        """
        names = [names] if isinstance(names, str) else list(names)
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                client = self._connection()
            try:  # polls: never hold the lease's lock meanwhile
                client.lock(names, owner, max(0.0, deadline - time.monotonic()), poll_s)
            except RegistryUnavailable:
                if not client.hung_up():
                    raise
                with self._lock:
                    self._recover(client)
                continue
            with self._lock:
                if self._client is client:  # else granted by a registry that has died since: again
                    self._locks.update(dict.fromkeys(names, owner))
                    return

    def unlock(self, names) -> None:
        """Give locks back (a registry that is gone took them with it: no error then)."""
        names = [names] if isinstance(names, str) else list(names)
        with self._lock:
            for name in names:
                self._locks.pop(name, None)
                self._lost_locks.discard(name)
            client = self._client
        if client is not None:  # else never connected: nothing held
            client.unlock(names)

    @contextlib.contextmanager
    def locked(self, names, owner: str | None = None, timeout_s: float = 600.0, poll_s: float = 0.05):
        """Hold registry locks for the ``with`` block (see `lock`, whose errors it raises)."""
        self.lock(names, owner, timeout_s, poll_s)
        try:
            yield
        finally:
            self.unlock(names)

    def _check_locks(self) -> None:
        if self._lost_locks:
            raise RegistryUnavailable(f"registry lock(s) {', '.join(sorted(self._lost_locks))} were lost when the "
                                      "registry restarted (another engine took them first)")

    def _call(self, fn, again: bool = True):
        """``fn(connection)``; when it fails because the registry closed the connection (it
        died), re-register with the next one (`_recover`) and, with ``again``, call ``fn`` once
        more there.  The caller holds ``self._lock``.

        Raises:
            RegistryUnavailable: as ``fn``, as `_recover`, or as `_connection`.
        """
        client = self._connection()
        try:
            return fn(client)
        except RegistryUnavailable:
            if not client.hung_up():  # an error answer, or a registry that does not answer
                raise
        self._recover(client)
        if not again:
            return None
        self._check_locks()
        return fn(self._client)

    # the registry coming back ------------------------------------------------------------------
    def watch(self) -> None:
        """Start the background thread that re-registers with a registry that comes back.  A
        lease that never connected (its daemon did not start) holds nothing to re-register:
        no thread, and no daemon started again and again on a machine where it cannot start."""
        with self._lock:
            if self._client is None:
                return
        if self._watcher is None:
            watcher = threading.Thread(target=self._watch, name="vllm-dedup-lease", daemon=True)
            try:
                watcher.start()
            except RuntimeError as e:  # a pids limit: the engine goes on, its weights are mapped
                logger.warning("this engine will not re-register with a registry that restarts: no thread to "
                               "watch it with (%s)", e)
                return
            self._watcher = watcher

    def close(self) -> None:
        """Stop watching, close the connection and every descriptor kept."""
        self._stop.set()
        with self._lock:
            if self._launch is not None:  # never connected: the launcher is reaped, its log closed
                self._launch.close()
                self._launch = None
            self._close_descriptors()

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies of the connection and of the kept
        descriptors, sending nothing (the connection is the parent's, which keeps its own
        copy open), and give this object a lock and a stop event of its own: a thread of the
        parent may have held the inherited ones at the fork, and no thread survives it.  Every
        later call fails as after `close`."""
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._stop.set()
        self._watcher = None
        self._launch = None  # the parent's launcher: its process is not this child's to reap
        self._close_descriptors()

    def _close_descriptors(self) -> None:
        """Close the connection and every descriptor kept (the caller holds ``self._lock``, or
        is the only thread)."""
        if self._client is not None:
            with contextlib.suppress(OSError):
                self._client.close()
        for held in self._held.values():
            if held.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(held.fd)
        self._held.clear()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                old = self._closed(timeout_s=1.0)
            except (OSError, ValueError):  # closed by a call that timed out meanwhile: look again
                continue
            if old is None or self._stop.is_set():  # `close` closed it meanwhile: nothing went away
                continue
            logger.warning("the registry at %s went away or stopped answering; this engine keeps its "
                           "weights and will re-register them with the next one", self.path)
            delay = 0.2
            while not self._stop.is_set():
                try:
                    with self._lock:
                        if self._client is old and not self._stop.is_set():  # not after `close`
                            self._reregister(self._timeout_s)
                    break
                except (RegistryUnavailable, SegmentError, OSError) as e:
                    logger.debug("no registry yet (%s); retrying in %.1f s", e, delay)
                    self._stop.wait(delay)
                    delay = min(delay * 2, 5.0)

    def _closed(self, timeout_s: float) -> RegistryClient | None:
        """The connection if it is closed: by the registry (waits up to ``timeout_s`` for a
        hang-up; a reply arriving for a request in flight is left to its reader), or by this
        side after the registry did not answer in time; else None.  The connection is the one
        polled: a call that re-registered meanwhile has replaced it, and it is not done again."""
        poller = select.poll()
        with self._lock:
            client = self._client
            if client is not None:
                sock = client._sock
                if sock.fileno() < 0:
                    return client
                poller.register(sock, select.POLLRDHUP)
        if client is None:  # never connected (`watch` starts no watcher then)
            self._stop.wait(timeout_s)
            return None
        return client if poller.poll(timeout_s * 1000) else None

    def _recover(self, old: RegistryClient) -> None:
        """Re-register with the registry that replaces the one behind ``old``, trying for up
        to ``self._timeout_s`` (nothing to do if that happened already; a try begun late in that
        window may wait one reply's timeout more, on a registry that answers no more).  The caller holds
        ``self._lock``.

        Raises:
            RegistryUnavailable: no registry answered in time.
        """
        if self._client is not old:
            return
        deadline = time.monotonic() + self._timeout_s
        delay = 0.1
        while True:
            try:
                self._reregister(max(0.5, deadline - time.monotonic()))
                return
            except (RegistryUnavailable, SegmentError, OSError) as e:
                if time.monotonic() + delay >= deadline:
                    raise RegistryUnavailable(f"the registry at {self.path} went away and none answered within "
                                              f"{self._timeout_s:g} s ({e})") from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _reregister(self, timeout_s: float) -> None:
        """Say hello to the registry at ``self.path`` (starting the daemon if that is what served
        this engine) and give it everything held (module docstring).  The caller holds
        ``self._lock``.  ``timeout_s``: for a daemon to start (the new connection's replies get
        the lease's own timeout, `_reopen`)."""
        client = self._reopen(timeout_s)
        try:
            client.hello(*self._hello)
            registry_ids: dict[int, int] = {}  # lease id -> id in the new registry
            for lease_id, held in self._held.items():
                if held.fd >= 0:
                    keys = [(k, o, n) for k, (o, n) in held.keys.items()]
                    registry_ids[lease_id] = client.publish(held.fd, held.nbytes, keys, held.uid)
            for data in list(self._recipes):
                try:
                    client.put_recipe(data)
                except RegistryRefused as e:  # this registry will never take it (another version's limits)
                    logger.warning("the registry refused a recipe this engine kept (%s); it is dropped", e)
                    del self._recipes[data]
            lost = self._reclaim(client)
            if self._load is not None:
                client.report({**self._load, "reregistered": self.reregistrations + 1})
        except BaseException:
            client.close()
            raise
        for lease_id, held in self._held.items():
            held.registry_id = registry_ids.get(lease_id, -1)
        self._by_registry = {seg: lease_id for lease_id, seg in registry_ids.items()}
        old, self._client = self._client, client
        self.engine_id = client.engine_id
        if old is not None:  # else this lease's first registration
            self.reregistrations += 1
            old.close()
        for name in lost:
            self._locks.pop(name, None)
            self._lost_locks.add(name)
        logger.info("re-registered with the registry at %s: %d segment(s) (%.1f MB), %d recipe(s), "
                    "%d lock(s) reclaimed", self.path, len(registry_ids),
                    sum(h.nbytes for h in self._held.values() if h.fd >= 0) / 1e6, len(self._recipes),
                    len(self._locks))

    def _reclaim(self, client: RegistryClient) -> set[str]:
        """Take again, as reclaims, the locks held; returns those another engine holds already."""
        by_owner: dict[str | None, list[str]] = {}
        for name, owner in self._locks.items():
            by_owner.setdefault(owner, []).append(name)
        lost: set[str] = set()
        for owner, names in by_owner.items():
            try:
                client.lock(names, owner, timeout_s=0, reclaim=True)
            except TimeoutError as e:
                logger.warning("could not reclaim %s from the restarted registry (%s); what they "
                               "protect stays private", ", ".join(names), e)
                lost.update(names)
        return lost

    def _connection(self) -> RegistryClient:
        """The connection, made and said hello on first use where the lease was given a
        daemon's launch (Note [a lease on a registry still starting]).  The caller holds
        ``self._lock``.

        Raises:
            RegistryUnavailable: the daemon did not start, or no registry answers.
        """
        if self._client is None:
            launch = self._launch
            try:
                # A launch gets `LAUNCH_WAIT_S` to answer, not one reply's timeout: on a loaded
                # 2-core CI machine a daemon once answered after more than 10 s, and the engine
                # loaded privately.  A launcher that fails says so at once.
                self._client = self._said_hello(self._reopen(max(self._timeout_s, LAUNCH_WAIT_S), start=False))
            except RegistryUnavailable:
                if launch is None or not launch.answered:
                    raise
                # The daemon answered, then went: one exiting idle as this engine's gave way to
                # it (Note [one daemon per socket] in `daemon.py`).  Once more, starting one.
                self._client = self._said_hello(self._reopen(self._timeout_s))
        return self._client

    def _said_hello(self, client: RegistryClient) -> RegistryClient:
        """``client``, once it has said hello as this lease (closed if that fails)."""
        try:
            self.engine_id = client.hello(*self._hello)
        except BaseException:
            client.close()
            raise
        return client

    def _reopen(self, timeout_s: float, start: bool = True) -> RegistryClient:
        """A new connection to ``self.path``: to the daemon this lease was given the launch of
        (waited for once), else to whatever answers there, else, with ``start``, to a daemon
        started now where that is what served this engine.  ``timeout_s`` bounds the waits for a
        daemon; the connection's replies get the lease's own timeout, for the engine's life (a
        window's remainder there would make a later slow reply close it)."""
        launch, self._launch = self._launch, None
        if launch is not None:
            return launch.connect(timeout_s)
        try:
            return RegistryClient(self.path, timeout_s=self._timeout_s)
        except RegistryUnavailable:
            if self._start_daemon is None or not start:
                raise
        self._start_daemon(self.path, timeout_s=timeout_s)
        return RegistryClient(self.path, timeout_s=self._timeout_s)
