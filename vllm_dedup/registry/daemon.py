"""The standalone registry daemon, for machines without Ray (``python -m vllm_dedup.registry.daemon``).

The first engine that finds no registry starts one (`launch_daemon`, called by
`discovery.open_registry`; its lease connects once it needs the registry: Note [a lease on a
registry still starting] in `lease.py`); nobody starts it by hand.  It serves a `state.Registry` with the
same `server.RegistryServer` the Ray actor uses, outlives the engine that started it, and exits
when nothing has been connected or held for a while.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..config import is_finite_number
from ..errors import RegistryUnavailable
from .client import RegistryClient, registry_answers
from .server import RegistryServer, raise_descriptor_limit
from .state import RECLAIM_GRACE_S, Registry
from .wire import ensure_private_dir, socket_path

__all__ = ["RECLAIM_GRACE_ENV", "DaemonLaunch", "is_daemon", "launch_daemon", "main", "start_daemon"]

# The daemons an engine's lease starts inherit its environment: this sets their reclaim period.
RECLAIM_GRACE_ENV = "VLLM_DEDUP_RECLAIM_GRACE_S"
# Seconds a launch waits for an answer after its daemon gave way to another before launching
# again (Note [one daemon per socket]): the one that took the lock answers within milliseconds.
RELAUNCH_AFTER_S = 1.0


def start_daemon(path: Path, keep_warm_s: float = 0.0, idle_exit_s: float = 30.0, timeout_s: float = 30.0) -> None:
    """Start a standalone registry daemon for ``path`` (if none runs) and wait until it answers
    (`launch_daemon`, then `DaemonLaunch.wait`).

    Raises:
        RegistryUnavailable: it did not answer within ``timeout_s``.
    """
    launch_daemon(path, keep_warm_s, idle_exit_s).wait(timeout_s)


def launch_daemon(path: Path, keep_warm_s: float = 0.0, idle_exit_s: float = 30.0,
                  reply_timeout_s: float = 30.0, awaited_pid: int | None = None) -> DaemonLaunch:
    """Start a standalone registry daemon for ``path`` (if none runs), without waiting for it.

    The daemon detaches (forks once more and starts its own session), so it is no longer a
    descendant of the engine that started it: vLLM's shutdown kills its process tree, and the
    registry must outlive any one engine.  It exits after ``idle_exit_s`` seconds with no
    engine connected and no segment held.  Two engines starting at once race harmlessly: the
    daemon takes a lock, the loser exits.  It runs on the CPUs of this process's parent, not
    on the one CPU vLLM bound this worker's main thread to (Note [the daemon's CPUs]).

    Args:
        reply_timeout_s: each reply's timeout on the connection `DaemonLaunch.connect` makes.
        awaited_pid: a process that will say hello when it first needs the registry (this
            engine, `discovery.open_registry`): the daemon is not idle before it has (Note [the
            engine a daemon waits for]).

    Returns:
        The launch: `DaemonLaunch.wait` waits until the daemon answers, `DaemonLaunch.connect`
        connects to it.

    Raises:
        OSError: the launcher process cannot be started.
    """
    ensure_private_dir(path.parent)
    cpus = _launch_cpus()
    argv = [sys.executable, "-m", "vllm_dedup.registry.daemon", "--detach", "--socket", str(path),
            "--keep-warm-s", str(keep_warm_s), "--idle-exit-s", str(idle_exit_s),
            *(["--cpus", ",".join(map(str, sorted(cpus)))] if cpus else []),
            *(["--awaits-pid", str(awaited_pid)] if awaited_pid is not None else [])]
    # The daemon's stderr goes to an unlinked temporary file: nothing is left behind, and if
    # it dies before answering, its last words are still readable through our descriptor.
    err = tempfile.TemporaryFile(dir=path.parent)
    try:
        launcher = _start_launcher(argv, err)
    except BaseException:
        err.close()
        raise
    return DaemonLaunch(path, launcher, err, reply_timeout_s, argv)


def _start_launcher(argv: list[str], err) -> subprocess.Popen:
    """The daemon's launcher process (``--detach``: it returns once the daemon serves or has
    exited), its stderr into ``err``.  Raises OSError where it cannot be started."""
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                            start_new_session=True, close_fds=True)


class DaemonLaunch:
    """A standalone registry daemon this process started (`launch_daemon`), until it answers.

    Attributes:
        path: the daemon's socket.
        timeout_s: each reply's timeout on the connection `connect` makes (as
            `client.RegistryClient.timeout_s`).
    """

    def __init__(self, path: Path, launcher: subprocess.Popen, err, timeout_s: float, argv: list[str]):
        self.path, self.timeout_s = Path(path), timeout_s
        self._launcher, self._err = launcher, err  # `_err` is closed once waited for
        self._argv = argv  # to launch again (Note [one daemon per socket])
        self._outcome: RegistryUnavailable | None = None  # what waiting found (None: it answered)

    def wait(self, timeout_s: float = 30.0) -> None:
        """Wait until the daemon answers on ``path`` (or one another engine started there); a
        daemon that gave way to another one that has gone since is launched again (Note [one
        daemon per socket]).  A second call returns (or raises) what the first did.

        Raises:
            RegistryUnavailable: nothing answered within ``timeout_s``; the message has the
                daemon's last words.
        """
        if not self._err.closed:
            # What a wait cut short (an interrupt) leaves for the next call: not an answer.
            self._outcome = RegistryUnavailable(f"waiting for the registry daemon for {self.path} was interrupted")
            try:
                self._outcome = self._answered(timeout_s)
            finally:
                self._err.close()
        if self._outcome is not None:
            raise self._outcome

    @property
    def answered(self) -> bool:
        """Whether `wait` found a daemon answering (it may have gone since)."""
        return self._err.closed and self._outcome is None

    def close(self) -> None:
        """Give up on the daemon without waiting: its log is closed, and its launcher reaped if
        it has exited (else at Python's next ``Popen``).  The daemon itself is left running: it
        serves the node's other engines and exits when idle."""
        if not self._err.closed:
            self._outcome = RegistryUnavailable(f"the launch of the registry daemon for {self.path} was closed")
            self._err.close()
        self._launcher.poll()

    def connect(self, timeout_s: float = 30.0) -> RegistryClient:
        """`wait`, then a connection to the daemon (not yet said hello).

        Raises:
            RegistryUnavailable: as `wait`, or the daemon went away meanwhile.
        """
        self.wait(timeout_s)
        return RegistryClient(self.path, self.timeout_s)

    def _answered(self, timeout_s: float) -> RegistryUnavailable | None:
        deadline = time.monotonic() + timeout_s
        gave_way = 0  # launches that found another daemon holding the socket's lock
        while True:
            try:  # it returns once the daemon serves, or has exited
                status = self._launcher.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                status = None  # a busy machine: the launcher may still start it; the deadline decides
            if status not in (0, None):  # Note [a launcher that returns when ready]
                return self._did_not_start("")
            # Exit status 0 and no answer: the daemon gave way to one that is gone by now.
            gave_way += status == 0
            relaunch_at = time.monotonic() + RELAUNCH_AFTER_S if status == 0 else deadline
            while not registry_answers(self.path):
                now = time.monotonic()
                if now > deadline:  # which of the two, for whoever reads why an engine loaded privately
                    why = (f"launched {gave_way} times, it gave way each time to a daemon holding {self.path}.lock "
                           "that did not answer" if status == 0 else "it had not begun to serve")
                    return self._did_not_start(f"no answer within {timeout_s:g} s ({why})")
                if now >= relaunch_at:
                    break
                time.sleep(0.05)
            else:  # it answers
                return None
            try:  # Note [one daemon per socket]
                self._launcher = _start_launcher(self._argv, self._err)
            except OSError as e:
                return self._did_not_start(f"it could not be launched again ({e})")

    def _did_not_start(self, why: str) -> RegistryUnavailable:
        self._err.seek(0)
        tail = self._err.read()[-2000:].decode(errors="replace").strip()
        return RegistryUnavailable(f"the registry daemon for {self.path} did not start: {tail or why or 'no answer'}")


def _launch_cpus() -> set[int] | None:
    """The CPUs a daemon started from this process runs on (Note [the daemon's CPUs]): this
    process's parent's; None where they cannot be read (the parent has exited)."""
    try:
        return os.sched_getaffinity(os.getppid())
    except OSError:
        return None


# Note [the daemon's CPUs]
#     vLLM binds a CPU worker's OpenMP threads one per CPU of the worker's list (libgomp's
#     ``GOMP_CPU_AFFINITY``, Intel OpenMP's ``KMP_AFFINITY=...,explicit,proclist=[...]``, set in
#     ``vllm/utils/ompmultiprocessing.py`` before the worker starts), the main thread to the
#     first, and a new process gets the affinity of the thread that makes it.  So a daemon the
#     first engine's worker started stayed on that worker's first CPU, beside the thread that
#     leads every one of its OpenMP regions, for as long as it ran, after that engine had gone
#     too (seen with ``vllm serve`` given both CPUs of this 2-core machine,
#     ``VLLM_CPU_OMP_THREADS_BIND=0-1``: the daemon was allowed CPU 0 alone).  It serves every
#     engine on the machine, so it runs where vLLM's processes that are not workers run: on the
#     CPUs of the process that started the worker (the engine core, which vLLM does not bind;
#     for an engine in the user's own process, whatever started that process), which keep any
#     ``taskset`` the user gave ``vllm serve``.  The engine passes them as ``--cpus``.  (Letting
#     the load's own helper threads, the hashing and copying ones, onto the worker's other CPUs
#     the same way was measured and gained nothing: the 1.2B model's first engine under
#     ``vllm serve`` with both CPUs took 4.03 to 4.31 s against 3.82 to 4.00 s as born, three
#     loads each, alternating.  vLLM's OpenMP threads keep those CPUs busy through a load's
#     parallel copies and packing.)


# Note [a launcher that returns when ready]
#     ``--detach`` forks, and the parent (the launcher `DaemonLaunch.wait` waits for) exits only once
#     the daemon's socket is listening, or the daemon has exited (another one owns the socket):
#     it reads one byte from a pipe whose write end only the daemon holds, and end of file when
#     the daemon is gone.  So the engine's first connection right after `launcher.wait` is
#     answered, instead of polling for a daemon still starting.  A daemon gone before serving
#     either found another one owning the socket (it exits 0, and the launcher with it) or
#     failed: the launcher then exits 1, as it does when its own arguments or environment are
#     wrong (2, argparse's), and `DaemonLaunch.wait` says so at once, with the daemon's last
#     words, instead of polling the socket until its timeout.


# Note [the engine a daemon waits for]
#     The engine that starts the daemon does not wait for it: its lease connects when the load
#     first needs the registry (Note [a lease on a registry still starting] in `lease.py`), on
#     the CPU backend after the whole checkpoint is read, which takes minutes for a large model
#     on a cold disk.  A daemon that counted that time as idle would exit after
#     ``--idle-exit-s``, and the engine would find nobody to publish to.  So the engine gives
#     its pid (``--awaits-pid``), and the daemon is not idle before that process has said
#     hello (the pid the kernel gives for the connection, ``SO_PEERCRED``) or exited (a pidfd,
#     `server._ExitWatch`); from then on it is idle as before, when nothing is connected or
#     held.  An engine that never says hello (its lease closed unused) keeps the daemon for
#     as long as it lives, no longer.  Where two engines launch a daemon at once, the one
#     that serves waits for its own launcher only; should the first engine leave and that
#     daemon exit before the other's first call, the other launches it again (Note [one
#     daemon per socket]).  That daemon holds nothing: the other engine then publishes all.


# Note [one daemon per socket]
#     The daemon serving a socket holds ``<socket>.lock`` (``flock``) while it serves; a daemon
#     that finds it held exits (status 0: another one serves).  Two races follow.  A daemon that
#     exits unlinks the lock file and then loses its lock with its process: a daemon starting
#     meanwhile may have opened the file before the unlink and lock it after, a lock on a file
#     no longer at the path that the next daemon would not see, and two daemons would serve one
#     socket.  So a daemon serves only under a lock on the file at the path once it holds it
#     (`_socket_lock`), and tries again otherwise.  And the engine whose daemon gave way finds
#     nobody when the holder was exiting (idle), or exits idle before that engine's first call
#     (it awaits its own engine only: Note [the engine a daemon waits for]): where the launcher
#     exited 0 and nothing answers for ``RELAUNCH_AFTER_S``, `DaemonLaunch.wait` launches
#     the daemon again, until it answers or the wait's time is up.


def _socket_lock(path: Path):
    """``<path>.lock``, opened and locked: this daemon serves ``path`` while it holds it (Note
    [one daemon per socket]); None where another daemon holds it.

    Raises:
        OSError: the lock file cannot be opened or locked for another reason.
    """
    lock_path = Path(f"{path}.lock")
    while True:
        lock = open(lock_path, "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            lock.close()
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return None
            raise
        held = os.fstat(lock.fileno())
        try:
            at_path = os.stat(lock_path)
        except FileNotFoundError:
            at_path = None
        if at_path is not None and (at_path.st_dev, at_path.st_ino) == (held.st_dev, held.st_ino):
            return lock
        lock.close()  # a daemon exiting unlinked it after we opened it


def is_daemon(pid: int) -> bool:
    """Whether process ``pid`` (of this node) is a standalone registry daemon."""
    try:
        return b"vllm_dedup.registry.daemon" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _seconds(text: str) -> float:
    """A period given on the command line or in the environment: a finite number of seconds >= 0.
    inf would keep a registry warm for ever (its stats could not be encoded) or refuse every new
    lock for good; nan and negatives would turn a period off unsaid.

    Raises:
        argparse.ArgumentTypeError: what is wrong and an example."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds; give e.g. 10") from None
    if not (is_finite_number(seconds) and seconds >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds >= 0; give e.g. 10")
    return seconds


def main(argv: list[str] | None = None) -> int:
    """The daemon's entry point: serve until stopped or idle; 0 also when another daemon
    already owns the socket (it holds ``<socket>.lock``)."""
    parser = argparse.ArgumentParser(prog="python -m vllm_dedup.registry.daemon",
                                     description="standalone vllm-dedup registry")
    parser.add_argument("--socket", type=Path, default=None)
    parser.add_argument("--keep-warm-s", type=_seconds, default=0.0)
    parser.add_argument("--idle-exit-s", type=_seconds, default=None, help="exit when idle this long (default: never)")
    parser.add_argument("--detach", action="store_true", help="fork into the background and return at once")
    parser.add_argument("--awaits-pid", type=int, default=None,
                        help="not idle before this process has said hello or exited (the engine that started it)")
    parser.add_argument("--cpus", default=None,
                        help="run on these CPUs, e.g. 0,1,2 (default: those it was started on)")
    parser.add_argument("--reclaim-grace-s", type=_seconds, default=None,
                        help="seconds a daemon that replaced a dead one grants only reclaimed locks "
                             f"(default: ${RECLAIM_GRACE_ENV}, else {RECLAIM_GRACE_S:g})")
    args = parser.parse_args(argv)
    grace_s = args.reclaim_grace_s
    if grace_s is None:
        try:
            grace_s = _seconds(os.environ.get(RECLAIM_GRACE_ENV) or str(RECLAIM_GRACE_S))
        except argparse.ArgumentTypeError as e:
            parser.error(f"${RECLAIM_GRACE_ENV}: {e}, or unset it")
    if args.cpus:
        try:
            os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
        except ValueError:
            parser.error(f"--cpus {args.cpus!r}: give CPU numbers separated by commas, e.g. 0,1,2")
        except OSError:
            pass  # none of them is allowed here (a narrower cpuset): stay where it started
    ready = None  # the write end of a pipe the launcher waits on (Note [a launcher that returns when ready])
    if args.detach:
        read_end, ready = os.pipe()
        child = os.fork()
        if child > 0:
            os.close(ready)
            if os.read(read_end, 1):  # a byte: serving; end of file: the daemon exited first
                os._exit(0)  # the launcher returns; the daemon is re-parented away from its engine
            _, status = os.waitpid(child, 0)  # 0: another daemon owns the socket; else it failed
            os._exit(0 if os.waitstatus_to_exitcode(status) == 0 else 1)
        os.close(read_end)
        os.setsid()
    path = args.socket or socket_path()
    ensure_private_dir(path.parent)
    lock = _socket_lock(path)  # held until this process exits
    if lock is None:
        return 0  # another daemon owns this socket (Note [one daemon per socket])
    server = None
    raise_descriptor_limit()
    try:
        server = RegistryServer(Registry(keep_warm_s=args.keep_warm_s), path, reclaim_grace_s=grace_s,
                                awaited_pid=args.awaits_pid).start()
        if ready is not None:
            os.write(ready, b"1")
            os.close(ready)
        server.wait(args.idle_exit_s)
    except RegistryUnavailable as e:  # it cannot serve there: one line for the launcher to pass on
        print(f"vllm-dedup registry: {e}", file=sys.stderr, flush=True)
        return 1
    finally:  # also when it could not serve: no lock file left for the next daemon to find
        if server is not None:
            server.stop()
        Path(f"{path}.lock").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main())
