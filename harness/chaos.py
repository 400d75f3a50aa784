"""A chaos soak: ``vllm serve`` engines of a model family serve a steady stream of requests while
a driver SIGKILLs an engine or the registry every few seconds and starts it again.  Used by
tests/e2e/test_chaos.py (a few cycles) and benchmarks/chaos.py (as long as asked).  Not shipped.

What it reports (`SoakReport`): requests sent, failed and wrong (a failure is allowed only for a
request in flight to, or sent to, an engine being killed; any answer must equal the plain
engine's greedy answer); what is left over at the end (memfds, registry descriptors, processes);
whether the registry's state agreed with ``/proc`` after every cycle; and memory (PSS) at the end
next to a fresh start's.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_dedup.errors import RegistryUnavailable
from vllm_dedup.registry.client import registry_stats, shutdown_registry
from vllm_dedup.registry.daemon import start_daemon
from vllm_dedup.registry.state import MAX_RECIPES
from vllm_dedup.segments.host import RECIPE_MEMFD_NAME

from .engines import PROMPTS, ServeProcess, openai_complete
from .procs import descendants, memfd_holders, processes_matching, tree_pss_bytes

__all__ = ["Soak", "SoakReport"]


@dataclass
class SoakReport:
    """The outcome of a soak (module docstring).  Bytes are PSS."""

    cycles: int = 0
    engine_kills: int = 0
    registry_kills: int = 0
    sent: int = 0
    failed: int = 0  # all failures
    failed_unexpected: int = 0  # failures of requests to an engine nobody was killing
    wrong: int = 0  # answers that differ from the plain engine's
    leaked: dict = field(default_factory=dict)  # what -> count, after everything stopped
    consistent: bool = True  # the registry agreed with /proc after every cycle
    inconsistencies: list[str] = field(default_factory=list)
    pss_start_bytes: int = 0
    pss_end_bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


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
        references: engine name -> the plain engine's greedy text per prompt of `PROMPTS`.
        logs: folder for the servers' logs.
        socket: the registry's socket (a private runtime dir: the soak kills that registry).
        interval_s: seconds between two kills.
        seed: for the victims' draw.
    """

    def __init__(self, models: dict[str, Path], references: dict[str, list[str]], logs: Path, socket: Path,
                 interval_s: float = 3.0, seed: int = 0, max_tokens: int = 16):
        self.slots = [_Slot(name, Path(m)) for name, m in models.items()]
        self.references, self.logs, self.socket = references, Path(logs), Path(socket)
        self.interval_s, self.random, self.max_tokens = interval_s, random.Random(seed), max_tokens
        self.report = SoakReport()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._starts = 0

    def run(self, cycles: int, victims: list[str] | None = None) -> SoakReport:
        """Start the engines, soak for ``cycles`` kills (victims drawn among the engines and
        ``"registry"``, or taken from ``victims`` in turn), stop everything, check leftovers."""
        begin = time.monotonic()
        try:
            for i, slot in enumerate(self.slots):
                self._start(slot, core=i % (os.cpu_count() or 1))
            self.report.pss_start_bytes = self._pss()
            self._check("after start")
            client = threading.Thread(target=self._client, name="soak-client", daemon=True)
            client.start()
            for cycle in range(cycles):
                time.sleep(self.interval_s)
                victim = victims[cycle % len(victims)] if victims else self.random.choice(
                    ["registry", *[s.name for s in self.slots]])
                if victim == "registry":
                    self._kill_registry()
                else:
                    self._kill_engine(next(s for s in self.slots if s.name == victim))
                self.report.cycles += 1
                self._check(f"after cycle {cycle + 1} ({victim})")
            time.sleep(self.interval_s)  # requests to the last one restarted
            self._stop.set()
            client.join(timeout=120)
            self.report.pss_end_bytes = self._pss()
        finally:
            self._stop.set()
            self._stop_all()
        self.report.leaked = self._leftovers()
        self.report.seconds = time.monotonic() - begin
        return self.report

    # engines ------------------------------------------------------------------------------------
    def _start(self, slot: _Slot, core: int) -> None:
        self._starts += 1
        slot.server = ServeProcess(slot.model, "dedup", self.logs / f"{slot.name}-{self._starts}.log", core=core)
        slot.server.wait_ready(600)
        slot.up = True

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
        self._start(slot, core=self.slots.index(slot) % (os.cpu_count() or 1))

    def _kill_registry(self) -> None:
        old = registry_stats(self.socket).registry_pid
        os.kill(old, signal.SIGKILL)
        self.report.registry_kills += 1
        start_daemon(self.socket)  # the engines' leases may have started one already: harmless
        # Every engine re-registers with it.
        _wait(lambda: self._registered_engines(old) == len(self.slots), 60)

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
        for slot in self.slots:
            if slot.server is not None:
                slot.server.stop()
        shutdown_registry(self.socket)

    # the client ---------------------------------------------------------------------------------
    def _client(self) -> None:
        i = 0
        while not self._stop.is_set():
            slot = self.slots[i % len(self.slots)]
            prompt = i // len(self.slots) % len(PROMPTS)
            i += 1
            with self._lock:
                if not slot.up:
                    continue
                generation, port = slot.generation, slot.server.port
            self.report.sent += 1
            try:
                reply = openai_complete(port, str(slot.model), PROMPTS[prompt], self.max_tokens)
                text = reply["choices"][0]["text"]
            except Exception:  # noqa: BLE001 (any failure of the request is counted)
                self.report.failed += 1
                with self._lock:
                    if slot.generation == generation and slot.up:
                        self.report.failed_unexpected += 1
                continue
            if text != self.references[slot.name][prompt]:
                self.report.wrong += 1

    # checks -------------------------------------------------------------------------------------
    def _check(self, when: str) -> None:
        """The registry's engines are live processes of the servers up, and only they and the
        registry hold segment descriptors."""
        try:
            stats = registry_stats(self.socket)
        except RegistryUnavailable as e:
            self._inconsistent(f"{when}: no registry ({e})")
            return
        live = {p for s in self.slots if s.up for p in descendants(s.server.proc.pid)}
        engines = {e.pid for e in stats.engines}
        if not engines <= live:
            self._inconsistent(f"{when}: registry lists engines {sorted(engines - live)} that are not live")
        if len(engines) != sum(s.up for s in self.slots):
            self._inconsistent(f"{when}: {len(engines)} engines registered, {sum(s.up for s in self.slots)} up")
        segment_holders = memfd_holders()  # one pid per descriptor: one /proc scan for both checks
        holders = set(segment_holders)
        if not holders <= engines | {stats.registry_pid}:
            self._inconsistent(f"{when}: processes {sorted(holders - engines - {stats.registry_pid})} hold segments")
        # The registry holds one memfd per segment, and its recipes (at most MAX_RECIPES for this
        # family's one load signature).
        segments = sum(g.segments for g in stats.groups)
        held = segment_holders.count(stats.registry_pid)
        if held != segments:
            self._inconsistent(f"{when}: the registry holds {held} segment memfds for {segments} segments")
        recipes = memfd_holders(RECIPE_MEMFD_NAME).count(stats.registry_pid)
        if recipes > MAX_RECIPES:
            self._inconsistent(f"{when}: the registry holds {recipes} recipe memfds (at most {MAX_RECIPES} kept)")

    def _inconsistent(self, what: str) -> None:
        self.report.consistent = False
        self.report.inconsistencies.append(what)

    def _pss(self) -> int:
        total = sum(tree_pss_bytes(s.server.proc.pid) for s in self.slots if s.up)
        try:
            total += tree_pss_bytes(registry_stats(self.socket).registry_pid)
        except RegistryUnavailable:
            pass
        return total

    def _leftovers(self) -> dict:
        def memfds() -> int:
            return len(memfd_holders()) + len(memfd_holders(RECIPE_MEMFD_NAME))

        _wait(lambda: not memfds() and not processes_matching(str(self.socket).encode()), 30)
        return {
            "memfd_holders": memfds(),
            "registry_processes": len(processes_matching(b"vllm_dedup.registry.daemon", str(self.socket).encode())),
            "serve_processes": sum(len(processes_matching(b"serve", str(s.model).encode(), b"--port")) for s in self.slots),
            "socket_files": len([p for p in self.socket.parent.glob("*.sock")]) if self.socket.parent.exists() else 0,
        }


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False
