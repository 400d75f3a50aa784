"""A chaos soak: ``vllm serve`` engines of a model family serve a steady, bounded stream of
requests (one client thread per engine, one request at a time, ``pause_s`` between two) while every few seconds a driver
SIGKILLs the registry, SIGKILLs an engine and starts it again, or hangs an engine (SIGSTOP of its
process group, SIGCONT a few seconds later).  Used by tests/e2e/test_chaos.py (a few cycles) and
benchmarks/chaos.py (as many cycles, or minutes, as asked).  Not shipped.

References (`harness.references`), made first: per model, a reference ``vllm serve`` asked one
prompt per request, as the soak asks, gives the greedy texts and the final tensors every engine
of that model must have.

After every cycle (`CycleReport`, handed to ``on_cycle`` as it happens): requests sent, failed
and wrong so far (a failure is allowed only for a request in flight to, or sent to, an engine
being killed; any answer must equal the reference's), the tensor oracle's verdict for every
engine up (`harness.oracle.differences` against its model's reference: 0 tensors differing),
and whether the registry's state agrees with ``/proc`` (its engines are live, exactly one memfd
per segment, at most `MAX_RECIPES` recipes).

At the end (`SoakReport`): what is left after everything stopped (memfds, registry descriptors
beyond a fresh registry's, processes, socket files) and PSS at the end next to the start's.

Whatever ends the run (its end, an error, SIGINT, SIGTERM, SIGHUP in the main thread), `Soak.run`
stops every process group it started (reference servers, engines, stopped ones first woken up),
then the registry, and waits for them; signals that arrive meanwhile wait until that is done.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from vllm_dedup.errors import RegistryUnavailable
from vllm_dedup.registry.client import registry_stats, shutdown_registry
from vllm_dedup.registry.daemon import start_daemon
from vllm_dedup.registry.state import MAX_RECIPES
from vllm_dedup.segments.host import RECIPE_MEMFD_NAME

from .engines import PROMPTS, ServeProcess, openai_complete
from .oracle import differences
from .procs import descendants, fd_targets, memfd_holders, processes_matching, tree_pss_bytes
from .references import serve_reference

__all__ = ["CycleReport", "Interrupted", "Soak", "SoakReport"]

DAEMON = b"vllm_dedup.registry.daemon"


@dataclass
class CycleReport:
    """One cycle: what was done and the figures after it (counts are totals so far).

    ``tensors``: per engine, tensors differing from its reference (0: exact), or ``"down"``.
    """

    cycle: int
    seconds: float  # since the soak began
    action: str
    registry_kills: int
    engine_kills: int
    hangs: int
    sent: int
    failed: int
    failed_unexpected: int
    wrong: int
    tensors: dict[str, int | str]
    consistent: bool
    inconsistencies: list[str] = field(default_factory=list)

    def line(self) -> str:
        """The cycle as one line of text."""
        verdict = ", ".join(f"{name} {'ok' if n == 0 else n if n == 'down' else f'{n} DIFFER'}"
                            for name, n in self.tensors.items())
        return (f"cycle {self.cycle:>3} {self.seconds:6.0f} s  {self.action:<28} | kills: registry "
                f"{self.registry_kills}, engine {self.engine_kills}, hangs {self.hangs} | requests {self.sent} sent, "
                f"{self.failed} failed ({self.failed_unexpected} unexpected), {self.wrong} wrong | tensors: {verdict} "
                f"| registry {'consistent' if self.consistent else 'INCONSISTENT: ' + '; '.join(self.inconsistencies)}")


@dataclass
class SoakReport:
    """The outcome of a soak (module docstring).  Bytes are PSS."""

    cycles: int = 0
    engine_kills: int = 0
    registry_kills: int = 0
    hangs: int = 0
    sent: int = 0
    failed: int = 0  # all failures
    failed_unexpected: int = 0  # failures of requests to an engine nobody was killing
    wrong: int = 0  # answers that differ from the reference's
    tensor_checks: int = 0  # engines compared with their reference, over all cycles
    tensors_differing: int = 0  # tensors that differed, over all checks
    leaked: dict = field(default_factory=dict)  # what -> count, after everything stopped
    consistent: bool = True  # the registry agreed with /proc after every cycle
    inconsistencies: list[str] = field(default_factory=list)
    pss_start_bytes: int = 0
    pss_end_bytes: int = 0
    seconds: float = 0.0
    cycle_seconds: list[float] = field(default_factory=list)  # wall time of each cycle, check included
    interrupted: str = ""  # what stopped the run early, if anything

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def ok(self) -> bool:
        """Nothing failed unexpectedly, nothing was wrong, no tensor differed, nothing leaked,
        the registry agreed with /proc throughout, and the run was not cut short."""
        return (not self.failed_unexpected and not self.wrong and not self.tensors_differing and self.consistent
                and not any(self.leaked.values()) and not self.interrupted)


class _Slot:
    """One engine position: its model and the server now running it."""

    def __init__(self, name: str, model: Path):
        self.name, self.model = name, model
        self.server: ServeProcess | None = None
        self.generation = 0  # bumped at every kill: a request begun under another one may fail
        self.up = False


class Soak:
    """The soak (module docstring).

    Args:
        models: engine name -> model folder (one engine each).
        logs: folder for the servers' logs.
        socket: the registry's socket (in a private runtime dir: the soak kills that registry).
        interval_s: seconds between two cycles.
        seed: for the victims' draw.
        max_tokens: per request.
        pause_s: seconds a client waits between two requests: three engines on two cores with
            no pause keep both cores busy; half a second leaves room for an engine's restart,
            under a load that never stops.
        hang_s: how long a hung engine stays stopped.
        on_cycle: called with each `CycleReport` as it is made (e.g. to print it).
    """

    def __init__(self, models: dict[str, Path], logs: Path, socket: Path, interval_s: float = 3.0, seed: int = 0,
                 max_tokens: int = 16, hang_s: float = 5.0, pause_s: float = 0.5,
                 on_cycle: Callable[[CycleReport], None] | None = None):
        self.slots = [_Slot(name, Path(m)) for name, m in models.items()]
        self.logs, self.socket = Path(logs), Path(socket)
        self.interval_s, self.random, self.max_tokens, self.hang_s = interval_s, random.Random(seed), max_tokens, hang_s
        self.pause_s = pause_s
        self.on_cycle = on_cycle or (lambda report: None)
        self.references: dict[str, dict] = {}
        self.report = SoakReport()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # slots' state and the request counts
        self._starts = 0
        self._begin = 0.0
        self._reference_servers: list[ServeProcess] = []
        self._fresh_registry_fds = 0  # descriptors of a registry nobody has connected to yet
        self._registry_fds_left = 0
        self._registry_left = 0  # registry processes alive 15 s after their shutdown (`_stop_all`)

    def run(self, cycles: int | None = None, minutes: float | None = None,
            victims: list[str] | None = None) -> SoakReport:
        """Make the references, start the registry and the engines (all at once), then run cycles
        until ``cycles`` are done or ``minutes`` have passed since the start (whichever comes
        first; at least one must be given), stop everything, check what is left.

        ``victims``, taken in turn, or else drawn: ``"registry"``, an engine's name or
        ``"kill:<name>"`` (SIGKILL, then started again), ``"hang:<name>"`` (SIGSTOP, SIGCONT
        after ``hang_s``)."""
        if cycles is None and minutes is None:
            raise ValueError("give cycles or minutes")
        self._begin = time.monotonic()
        deadline = self._begin + minutes * 60 if minutes is not None else float("inf")
        with _signals_raise():
            return self._run(cycles, deadline, victims)

    def _run(self, cycles: int | None, deadline: float, victims: list[str] | None) -> SoakReport:
        try:
            try:
                self._make_references()
                start_daemon(self.socket)
                self._fresh_registry_fds = _settled_fd_count(registry_stats(self.socket).registry_pid)
                self._start_all()
                self.report.pss_start_bytes = self._pss()
                self.on_cycle(self._cycle_report(0, "all engines up"))
                clients = [threading.Thread(target=self._client, args=(slot,), name=f"soak-client-{slot.name}",
                                            daemon=True) for slot in self.slots]
                for client in clients:
                    client.start()
                cycle = 0
                while (cycles is None or cycle < cycles) and time.monotonic() < deadline:
                    begin = time.monotonic()
                    time.sleep(self.interval_s)
                    victim = victims[cycle % len(victims)] if victims else self._draw()
                    action = self._act(victim)
                    cycle += 1
                    self.report.cycles = cycle
                    self.on_cycle(self._cycle_report(cycle, action))
                    self.report.cycle_seconds.append(round(time.monotonic() - begin, 1))
                time.sleep(self.interval_s)  # requests to the last one restarted
                self._stop.set()
                for client in clients:
                    client.join(timeout=320)
                self.report.pss_end_bytes = self._pss()
            except BaseException as e:
                self.report.interrupted = f"{type(e).__name__}: {e}"[:300]
                raise
            finally:
                with _signals_deferred():
                    self._stop.set()
                    self._stop_all()
                    self.report.leaked = self._leftovers()
        finally:
            self.report.seconds = time.monotonic() - self._begin
        return self.report

    # references and engines ---------------------------------------------------------------------
    def _make_references(self) -> None:
        """Every model's reference, made at once (one reference server per model)."""
        errors: list[BaseException] = []

        def make(slot: _Slot, core: int) -> None:
            try:
                self.references[slot.name] = serve_reference(slot.model, self.logs / f"reference-{slot.name}.log",
                                                             core=core, started=self._reference_servers)
            except BaseException as e:  # noqa: BLE001 (re-raised in the main thread)
                errors.append(e)

        threads = [threading.Thread(target=make, args=(slot, i % (os.cpu_count() or 1)), daemon=True)
                   for i, slot in enumerate(self.slots)]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)  # in short steps: a signal handler must get to run
        if errors:
            raise errors[0]

    def _start_all(self) -> None:
        for i, slot in enumerate(self.slots):
            self._launch(slot, i)
        for slot in self.slots:
            slot.server.wait_ready(600)
            slot.up = True

    def _launch(self, slot: _Slot, index: int) -> None:
        self._starts += 1
        slot.server = ServeProcess(slot.model, "dedup", self.logs / f"{slot.name}-{self._starts}.log",
                                   core=index % (os.cpu_count() or 1))

    def _draw(self) -> str:
        kind = self.random.choice(["registry", "kill", "hang"])
        return kind if kind == "registry" else f"{kind}:{self.random.choice(self.slots).name}"

    def _act(self, victim: str) -> str:
        if victim == "registry":
            self._kill_registry()
            return "SIGKILL registry"
        kind, _, name = victim.rpartition(":")
        slot = next(s for s in self.slots if s.name == name)
        if kind == "hang":
            self._hang(slot)
            return f"SIGSTOP {name} {self.hang_s:g} s"
        self._kill_engine(slot)
        return f"SIGKILL {name}"

    def _kill_engine(self, slot: _Slot) -> None:
        with self._lock:
            slot.up = False
            slot.generation += 1
        victims = descendants(slot.server.proc.pid)
        os.killpg(slot.server.proc.pid, signal.SIGKILL)  # the server, its engine core and worker
        slot.server.proc.wait()
        _wait(lambda: not any(os.path.exists(f"/proc/{p}") for p in victims), 60)
        slot.server.stop()
        self.report.engine_kills += 1
        self._launch(slot, self.slots.index(slot))
        slot.server.wait_ready(600)
        with self._lock:
            slot.up = True

    def _hang(self, slot: _Slot) -> None:
        """A hung peer: the engine's whole process group stopped for ``hang_s``, requests to it
        waiting meanwhile (none may fail)."""
        os.killpg(slot.server.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(self.hang_s)
        finally:
            os.killpg(slot.server.proc.pid, signal.SIGCONT)
        self.report.hangs += 1

    def _kill_registry(self) -> None:
        old = registry_stats(self.socket).registry_pid
        os.kill(old, signal.SIGKILL)
        self.report.registry_kills += 1
        start_daemon(self.socket)  # the engines' leases may have started one already: harmless
        # Every engine re-registers with it (its segments and recipe, then its load report).
        if not _wait(lambda: self._registered_engines(old) == len(self.slots), 60):
            self._inconsistent(f"{len(self.slots) - max(self._registered_engines(old), 0)} engine(s) did not "
                               "re-register with the new registry within 60 s")

    def _registered_engines(self, old_registry: int) -> int:
        try:
            stats = registry_stats(self.socket)
        except RegistryUnavailable:
            return -1
        if stats.registry_pid == old_registry:
            return -1
        # An engine is listed from its hello on, but has re-registered everything it holds only
        # once its load report (sent last) is back.
        return sum(1 for e in stats.engines if e.load.get("reregistered"))

    def _stop_all(self) -> None:
        """Stop every process group started (woken first: a stopped group ignores SIGTERM), then
        the registry, and any daemon a lease started on the soak's socket meanwhile."""
        with self._lock:  # requests in flight now fail as expected: their engine is being stopped
            for slot in self.slots:
                slot.up = False
                slot.generation += 1
        servers = [s.server for s in self.slots if s.server is not None] + list(self._reference_servers)
        for server in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.proc.pid, signal.SIGCONT)
        for server in servers:
            server.stop()
        self._registry_fds_left = self._registry_extra_fds()
        shutdown_registry(self.socket)
        if not _wait(lambda: not processes_matching(DAEMON, str(self.socket).encode()), 15):
            # a registry that outlives its shutdown is a leak, however it is stopped now
            self._registry_left = len(processes_matching(DAEMON, str(self.socket).encode()))
            for pid in processes_matching(DAEMON, str(self.socket).encode()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    # the clients --------------------------------------------------------------------------------
    def _client(self, slot: _Slot) -> None:
        """One engine's client: one request at a time, the prompts in turn."""
        i = 0
        while not self._stop.is_set():
            with self._lock:
                if not slot.up:
                    generation = None
                else:
                    generation, port = slot.generation, slot.server.port
                    self.report.sent += 1
            if generation is None:
                time.sleep(0.1)
                continue
            prompt = i % len(PROMPTS)
            i += 1
            try:
                reply = openai_complete(port, str(slot.model), PROMPTS[prompt], self.max_tokens)
                text = reply["choices"][0]["text"]
            except Exception:  # noqa: BLE001 (any failure of the request is counted)
                with self._lock:
                    self.report.failed += 1
                    if slot.generation == generation and slot.up:
                        self.report.failed_unexpected += 1
                continue
            if text != self.references[slot.name]["texts"][prompt]:
                with self._lock:
                    self.report.wrong += 1
            self._stop.wait(self.pause_s)

    # checks -------------------------------------------------------------------------------------
    def _cycle_report(self, cycle: int, action: str) -> CycleReport:
        before = len(self.report.inconsistencies)
        tensors = self._check()
        r = self.report
        with self._lock:
            return CycleReport(cycle, time.monotonic() - self._begin, action, r.registry_kills, r.engine_kills, r.hangs,
                               r.sent, r.failed, r.failed_unexpected, r.wrong, tensors,
                               len(r.inconsistencies) == before, r.inconsistencies[before:])

    def _check(self) -> dict[str, int | str]:
        """The registry agrees with /proc (module docstring); returns, per engine, the tensors
        that differ from its reference (``"down"`` for an engine not up)."""
        tensors: dict[str, int | str] = {}
        for slot in self.slots:
            if not slot.up:
                tensors[slot.name] = "down"
                continue
            reference = self.references[slot.name]["tensors"]
            got = slot.server.final_tensors()
            differ = sum(len(differences(g, ref)) for g, ref in zip(got, reference)) + abs(len(got) - len(reference))
            tensors[slot.name] = differ
            self.report.tensor_checks += 1
            self.report.tensors_differing += differ
        try:
            stats = registry_stats(self.socket)
        except RegistryUnavailable as e:
            self._inconsistent(f"no registry ({e})")
            return tensors
        live = {p for s in self.slots if s.up for p in descendants(s.server.proc.pid)}
        engines = {e.pid for e in stats.engines}
        if not engines <= live:
            self._inconsistent(f"registry lists engines {sorted(engines - live)} that are not live")
        if len(engines) != sum(s.up for s in self.slots):
            self._inconsistent(f"{len(engines)} engines registered, {sum(s.up for s in self.slots)} up")
        segment_holders = memfd_holders()  # one pid per descriptor: one /proc scan for both checks
        holders = set(segment_holders)
        if not holders <= engines | {stats.registry_pid}:
            self._inconsistent(f"processes {sorted(holders - engines - {stats.registry_pid})} hold segments")
        # The registry holds one memfd per segment, and its recipes (at most MAX_RECIPES for this
        # family's one load signature).
        segments = sum(g.segments for g in stats.groups)
        held = segment_holders.count(stats.registry_pid)
        if held != segments:
            self._inconsistent(f"the registry holds {held} segment memfds for {segments} segments")
        recipes = memfd_holders(RECIPE_MEMFD_NAME).count(stats.registry_pid)
        if recipes > MAX_RECIPES:
            self._inconsistent(f"the registry holds {recipes} recipe memfds (at most {MAX_RECIPES} kept)")
        return tensors

    def _inconsistent(self, what: str) -> None:
        self.report.consistent = False
        self.report.inconsistencies.append(f"cycle {self.report.cycles}: {what}")

    def _pss(self) -> int:
        total = sum(tree_pss_bytes(s.server.proc.pid) for s in self.slots if s.up)
        try:
            total += tree_pss_bytes(registry_stats(self.socket).registry_pid)
        except RegistryUnavailable:
            pass
        return total

    def _leftovers(self) -> dict:
        """What is left once everything stopped (all 0 when nothing leaked); before the
        registry is shut down, its descriptors beyond a fresh registry's and the recipes it
        keeps (`_stop_all` has stopped the engines only, at that point)."""
        def memfds() -> int:
            return len(memfd_holders()) + len(memfd_holders(RECIPE_MEMFD_NAME))

        _wait(lambda: not memfds() and not processes_matching(str(self.socket).encode()), 30)
        return {
            "memfd_holders": memfds(),
            "registry_descriptors": self._registry_fds_left,
            "registry_processes": self._registry_left + len(processes_matching(DAEMON, str(self.socket).encode())),
            "serve_processes": sum(len(processes_matching(b"serve", str(s.model).encode(), b"--port"))
                                   for s in self.slots),
            "socket_files": len(list(self.socket.parent.glob("*.sock"))) if self.socket.parent.exists() else 0,
        }

    def _registry_extra_fds(self) -> int:
        """With every engine gone: the registry's descriptors beyond a fresh registry's and the
        recipe memfds it keeps (0 when it leaks none; -1: no registry to count)."""
        try:
            pid = registry_stats(self.socket).registry_pid
        except RegistryUnavailable as e:
            self._inconsistent(f"at the end, no registry to count descriptors in ({e})")
            return -1
        def extra() -> int:
            return _fd_count(pid) - memfd_holders(RECIPE_MEMFD_NAME).count(pid) - self._fresh_registry_fds

        # The segments go with their last engine, and a dead engine's connection once the
        # registry has read its end: on a loaded machine that can lag the engine's exit.  A
        # leak stays; 10 s is far above the lag.
        _wait(lambda: not memfd_holders().count(pid) and extra() <= 0, 10)
        return extra()


def _fd_count(pid: int) -> int:
    return len(fd_targets(pid))


def _settled_fd_count(pid: int, seconds: float = 1.0) -> int:
    """The fewest descriptors ``pid`` held over ``seconds``: the connection that just asked
    for its pid may still be open on the registry's side."""
    counts = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        counts.append(_fd_count(pid))
        time.sleep(0.05)
    return min(counts)


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


class Interrupted(Exception):
    """The soak received SIGTERM or SIGHUP."""


@contextlib.contextmanager
def _signals_raise():
    """In the main thread, SIGINT, SIGTERM and SIGHUP raise `Interrupted` instead of ending the
    process without clean-up.  SIGINT too: a run started in the background by a shell without
    job control inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_deferred():
    """SIGINT, SIGTERM and SIGHUP wait until the block is done, so that clean-up is never cut
    short: their handlers note them meanwhile, and the first is raised again after the block.
    Blocking them in this thread would not do: the kernel gives a process's signal to any
    thread that does not block it (the client threads), and Python runs the handler in the
    main thread all the same.  A no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    old = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
           for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if received:
            signal.raise_signal(received[0])
