"""Processes, as the tests, benchmarks and demo see them: memory (PSS), process trees, segment
descriptors, ports, and child processes that answer on stdout.  Not shipped with vllm-dedup.

Memory is the proportional set size (``Pss`` in ``/proc/PID/smaps_rollup``): a page mapped by n
processes counts 1/n in each, so summing PSS over engines counts shared weights once, which RSS
would not.  A ``vllm serve`` engine is three processes (API server, engine core, worker);
`tree_pss_bytes` sums a process and all its descendants.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from vllm_dedup.segments.host import SEGMENT_MEMFD_NAME

ROOT = Path(__file__).resolve().parents[1]

# Set by `mark_session` (tests/conftest.py, the chaos benchmark) to a value of its own, and
# inherited by every process started after (engines, registry daemons, Ray's workers): the
# process checks below look only at processes that carry it, so that what other programs on the
# machine run never counts as a leak.
SESSION_ENV = "VLLM_DEDUP_TEST_SESSION"


def mark_session(name: str) -> str:
    """Mark this process and every process it starts from now on as one session's
    (`SESSION_ENV`), unless a session is marked already; returns the session's value.

    vLLM titles its engine-core and worker processes with ``setproctitle``, which writes over
    the memory ``/proc/PID/environ`` shows; ``SPT_NOENV`` tells it to leave the environment
    alone, so that the mark stays readable there."""
    os.environ["SPT_NOENV"] = "1"
    return os.environ.setdefault(SESSION_ENV, f"{name}-{os.getpid()}-{time.time_ns()}")

__all__ = ["PSS_PARTS", "ROOT", "ChildExited", "PeerProcess", "descendants", "fd_targets", "free_port", "memfd_holders", "processes_matching",
           "mark_session", "pss_bytes", "pss_parts", "read_reply", "reap", "SESSION_ENV", "serve_replica_pids", "tree_pss_bytes", "tree_pss_parts"]


class ChildExited(RuntimeError):
    """A child process closed its stdout (it exited) before giving the answer waited for.

    Attributes:
        returncode: its exit status (negative: killed by that signal).
    """

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def read_reply(proc: subprocess.Popen, prefix: str | tuple[str, ...], timeout_s: float, name: str,
               details=lambda: "") -> str:
    """The rest of the first line on ``proc``'s (text) stdout that starts with ``prefix``, stripped;
    other lines are skipped.

    A read of a pipe cannot be given a deadline while the pipe's text wrapper may hold lines
    read ahead, so a timer keeps it: at the deadline it SIGKILLs the child and every process
    below it (which hold the pipe open too), the read then ends, and this raises
    `TimeoutError`.  A child silent for the whole of a vLLM load (its log goes to stderr) is
    caught this way, where a check between lines never ran.

    Args:
        proc: a child started with ``stdout=PIPE, text=True``.
        prefix: one line prefix or several.
        timeout_s: seconds to wait.
        name: the child's name in error messages.
        details: called when the child exited, for the message (e.g. its log's tail).

    Raises:
        ChildExited: the child exited first.
        TimeoutError: no such line within ``timeout_s``; the child and its descendants are
            SIGKILLed.
    """
    prefixes = (prefix,) if isinstance(prefix, str) else tuple(prefix)
    lock, state = threading.Lock(), {"expired": False, "done": False}

    def expire() -> None:
        with lock:
            if state["done"]:
                return
            state["expired"] = True
        for pid in reversed(descendants(proc.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    def said(what: str) -> str:
        extra = details()
        return f"{name} {what}" + (f":\n{extra}" if extra else "")

    try:
        while True:
            line = proc.stdout.readline()
            match = next((p for p in prefixes if line.startswith(p)), None)
            with lock:  # the reply and the timer's kill exclude each other
                expired = state["expired"]
                state["done"] = not expired and (not line or match is not None)
            if expired:
                raise TimeoutError(said(f"did not answer in {timeout_s} s (killed)"))
            if not line:
                code = proc.wait()
                raise ChildExited(said(f"exited ({code})"), code)
            if match is not None:
                return line[len(match):].strip()
    finally:
        timer.cancel()


PSS_PARTS = ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")


def pss_parts(pid: int | str) -> dict[str, int]:
    """``Pss`` of one process and its parts, in bytes (`PSS_PARTS`): ``Pss_Anon`` (private heap),
    ``Pss_File`` (file-backed pages: libraries, Python modules, mapped checkpoints, which the page
    cache holds once for every process that maps them) and ``Pss_Shmem`` (shared memory, e.g.
    memfd segments), from its ``smaps_rollup``.

    Raises:
        FileNotFoundError: no such process.
    """
    parts = dict.fromkeys(PSS_PARTS, 0)
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in parts:
            parts[name] = int(value.split()[0]) * 1024
    return parts


def pss_bytes(pid: int) -> int:
    """PSS of one process in bytes.

    Raises:
        FileNotFoundError: no such process.
    """
    return pss_parts(pid)["Pss"]


def fd_targets(pid: int | str = "self") -> list[str]:
    """What each open descriptor of a process is (``readlink`` of ``/proc/PID/fd/*``: a path,
    ``/memfd:NAME``, ``socket:[...]``, ``pipe:[...]``, ``anon_inode:...``); [] once it exited."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    out = []
    for name in names:
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:  # closed meanwhile (the listing's own descriptor, for one)
            pass
    return out


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # Field 4 of /proc/PID/stat is the parent pid; the name (field 2) may hold spaces.
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_pss_bytes(pid: int) -> int:
    """PSS of ``pid`` and all its descendants, in bytes."""
    total = 0
    for p in descendants(pid):
        try:
            total += pss_bytes(p)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def tree_pss_parts(pid: int) -> dict[str, int]:
    """`pss_parts` of ``pid`` and all its descendants, summed."""
    parts = dict.fromkeys(PSS_PARTS, 0)
    for p in descendants(pid):
        try:
            one = pss_parts(p)
        except (FileNotFoundError, ProcessLookupError):
            continue
        for name in parts:
            parts[name] += one[name]
    return parts


def _ours() -> list[Path]:
    """``/proc/PID`` of every process, or, under a test session (`SESSION_ENV` set), of those
    that inherited the session's value."""
    session = os.environ.get(SESSION_ENV)
    marker = f"{SESSION_ENV}={session}".encode() if session else None
    procs = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        if marker is not None:
            try:
                if marker not in (proc / "environ").read_bytes().split(b"\0"):
                    continue
            except OSError:
                continue
        procs.append(proc)
    return procs


def processes_matching(*markers: bytes) -> list[int]:
    """Pids of the other processes whose command line contains every one of ``markers``
    (under a test session: of its processes only, `SESSION_ENV`)."""
    pids = []
    for proc in _ours():
        if int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if all(m in cmd for m in markers):
            pids.append(int(proc.name))
    return pids


def serve_replica_pids(app: str, deployment: str) -> list[int]:
    """Pids of the Ray Serve replicas of ``deployment`` in application ``app`` on this machine.

    Ray titles a replica's process ``ray::ServeReplica:<app>:<deployment>``, with
    ``.<method>`` appended while it runs one (e.g. ``.initialize_and_get_metadata``).
    """
    title = f"ray::ServeReplica:{app}:{deployment}".encode()
    pids = []
    for pid in processes_matching(title):
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].rstrip()
        except OSError:
            continue
        if name == title or name.startswith(title + b"."):
            pids.append(pid)
    return pids


def memfd_holders(name: str = SEGMENT_MEMFD_NAME) -> list[int]:
    """One pid per open descriptor of a memfd named exactly ``name``, machine-wide (under a test
    session: in its processes, `SESSION_ENV`): by default a weight segment's; `RECIPE_MEMFD_NAME`
    counts recipes, which a registry keeps after its engines exit (at most `MAX_RECIPES` per
    share group and load signature)."""
    targets = (f"/memfd:{name}", f"/memfd:{name} (deleted)")
    pids = []
    for proc in _ours():
        pids += [int(proc.name) for target in fd_targets(proc.name) if target in targets]
    return pids


def reap(pids: list[int], grace_s: float) -> None:
    """Wait up to ``grace_s`` for ``pids`` to exit, then SIGKILL those left."""
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if Path(f"/proc/{p}").exists()]
        time.sleep(0.1)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerProcess:
    """A child Python process driven over stdin/stdout: it answers with lines that start with a
    prefix (``OK {json}``, ``READY``, ...), and its stderr goes to a temporary file (`log`), so
    that a pipe nobody reads can never block it.

    The repository root is put on the child's ``PYTHONPATH``, so children import ``harness``
    and the test peers from a checkout as they are.

    Args:
        argv: what follows the interpreter: a script path or ``-m module``, and arguments.
        name: the child's name in error messages.
        env: extra environment variables.
        user: run the child as this uid (``setpriv``), or None for ours.
        rlimits: resource limits for the child (``resource.RLIMIT_*`` -> soft and hard value).
    """

    def __init__(self, argv: list[str], name: str, env: dict | None = None, user: int | None = None,
                 rlimits: dict[int, int] | None = None):
        import resource
        import tempfile

        self.name = name
        self._err = tempfile.TemporaryFile()
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        full_env = {**os.environ, **(env or {}), "PYTHONPATH": path}
        cmd = [sys.executable, *map(str, argv)]
        if user is not None:
            cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
        limit = (lambda: [resource.setrlimit(k, (v, v)) for k, v in rlimits.items()]) if rlimits else None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     text=True, env=full_env, preexec_fn=limit)
        self.pid = self.proc.pid

    def read(self, prefix: str | tuple[str, ...] = "OK ", timeout_s: float = 60) -> str:
        """The rest of the next stdout line starting with ``prefix`` (see `read_reply`).

        Raises:
            ChildExited: the child exited first (the message holds its stderr's tail).
            TimeoutError: no such line within ``timeout_s`` (the child is then killed).
        """
        return read_reply(self.proc, prefix, timeout_s, self.name, lambda: self.log()[-6000:])

    def read_json(self, prefix: str | tuple[str, ...] = "OK ", timeout_s: float = 60) -> dict:
        """`read`, parsed as JSON."""
        return json.loads(self.read(prefix, timeout_s))

    def send(self, line: str | dict) -> None:
        """One line to the child's stdin (a dict is sent as JSON)."""
        self.proc.stdin.write((json.dumps(line) if isinstance(line, dict) else line) + "\n")
        self.proc.stdin.flush()

    def log(self) -> str:
        """What the child wrote to stderr so far."""
        self._err.seek(0)
        return self._err.read().decode(errors="replace")

    def end(self, timeout_s: float = 60) -> int:
        """Close the child's stdin (its cue to finish), wait for it; returns its exit status.
        SIGKILLs it after ``timeout_s``.  Processes it started (a vLLM engine core and its
        workers) get 30 s more to exit after it, then are SIGKILLed: none outlives the child."""
        family = descendants(self.pid)[1:] if self.proc.poll() is None else []
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self._close()
        reap(family, grace_s=30)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind runs in the child."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def _close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout, self._err):
            try:
                stream.close()
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.end()


def evict_from_page_cache(path) -> None:
    """Write back and drop ``path``'s pages from the page cache (``fsync`` then
    ``posix_fadvise(POSIX_FADV_DONTNEED)``), so that a later reader must read it from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_bytes(path, start: int = 0) -> int:
    """Bytes of ``path`` from byte ``start`` on that are in the page cache now (``mincore`` over a
    fresh read-only mapping, which itself reads nothing).  With `evict_from_page_cache` before,
    this is what was read since."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(addr, size, pages) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(p & 1 for p in pages[start // page:]) * page
