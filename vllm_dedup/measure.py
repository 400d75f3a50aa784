"""Measuring engines side by side: engines in child processes, and memory as PSS.

Memory is the proportional set size (``Pss`` in ``/proc/PID/smaps_rollup``): a page mapped by n
processes counts 1/n in each, so summing PSS over engines counts shared weights once, which RSS
would not (ENV-NOTES.md).  A ``vllm serve`` engine is three processes (API server, engine core,
worker); `tree_pss_bytes` sums a process and all its descendants.

Two kinds of engine process:

- `ServeProcess`: ``vllm serve`` on 127.0.0.1, the multi-process path users run;
- `EngineProcess`: ``LLM()`` in one child process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), driven
  over stdin/stdout by ``python -m vllm_dedup.measure``: starts in seconds, and its own PSS is
  the engine's memory.

Used by the demo (``examples/demo.py``), ``benchmarks/`` and the tests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]

__all__ = ["PROMPTS", "ChildExited", "read_reply", "pss_bytes", "tree_pss_bytes", "descendants", "processes_matching", "memfd_holders", "free_port", "ServeProcess", "EngineProcess"]


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
    other lines are skipped.  The deadline is checked between lines.

    Args:
        proc: a child started with ``stdout=PIPE, text=True``.
        prefix: one line prefix or several.
        timeout_s: seconds to wait.
        name: the child's name in error messages.
        details: called when the child exited, for the message (e.g. its log's tail).

    Raises:
        ChildExited: the child exited first.
        TimeoutError: no such line within ``timeout_s``.
    """
    prefixes = (prefix,) if isinstance(prefix, str) else tuple(prefix)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            code = proc.wait()
            extra = details()
            raise ChildExited(f"{name} exited ({code})" + (f":\n{extra}" if extra else ""), code)
        for p in prefixes:
            if line.startswith(p):
                return line[len(p):].strip()
    raise TimeoutError(f"{name} did not answer in {timeout_s} s")


def pss_bytes(pid: int) -> int:
    """PSS of one process in bytes.

    Raises:
        FileNotFoundError: no such process.
    """
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/smaps_rollup has no Pss line")


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


def processes_matching(*markers: bytes) -> list[int]:
    """Pids of the other processes whose command line contains every one of ``markers``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
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


def openai_complete(port: int, model: str, prompt: str, max_tokens: int = 16, logprobs: int | None = None) -> dict:
    """One greedy completion through an OpenAI-compatible ``/v1/completions`` route on
    127.0.0.1:``port``; returns the response JSON.

    Raises:
        urllib.error.URLError: the server cannot be reached or answered an error status.
    """
    request = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if logprobs is not None:
        request["logprobs"] = logprobs
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(request).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def memfd_holders(prefix: str = "/memfd:vllm-dedup") -> list[int]:
    """One pid per open descriptor of a segment memfd (names starting ``prefix``), machine-wide."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd).startswith(prefix):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """One ``vllm serve`` engine on 127.0.0.1, in its own process group.

    Args:
        model: model folder.
        load_format: ``auto``, ``dedup``, ...
        extra_config: ``--model-loader-extra-config`` (dict), if any.
        log: file for the server's output.
        core: CPU core for the engine's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``).
        kv_cache_bytes: the KV cache's size (the CPU backend needs one given explicitly).
    """

    def __init__(self, model, load_format: str, log: Path, extra_config: dict | None = None,
                 core: int | None = None, kv_cache_bytes: int = 32 << 20, env: dict | None = None):
        self.model = str(model)
        self.port = free_port()
        self.log_path = Path(log)
        self._log = open(self.log_path, "wb")
        cmd = [str(Path(sys.executable).with_name("vllm")), "serve", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "bfloat16", "--max-model-len", "256", "--enforce-eager",
               "--kv-cache-memory-bytes", str(kv_cache_bytes), "--load-format", load_format, "--seed", "0"]
        if extra_config:
            cmd += ["--model-loader-extra-config", json.dumps(extra_config)]
        full_env = {**os.environ, **(env or {})}
        if core is not None:
            full_env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 300) -> ServeProcess:
        """Wait for ``/health``.

        Raises:
            RuntimeError: the server exited (the message holds its log's tail).
            TimeoutError: not ready within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve {self.model} exited ({self.proc.returncode}):\n"
                                   + self.log_path.read_text(errors="replace")[-5000:])
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).status == 200:
                    return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"vllm serve {self.model} not ready after {timeout_s} s")

    def complete(self, prompts: list[str] = PROMPTS, max_tokens: int = 16) -> list[str]:
        """Greedy completions through the OpenAI-compatible ``/v1/completions`` route."""
        return [openai_complete(self.port, self.model, p, max_tokens)["choices"][0]["text"] for p in prompts]

    def pss(self) -> int:
        """PSS of the server's process tree, in bytes."""
        return tree_pss_bytes(self.proc.pid)

    def pids(self) -> list[int]:
        return descendants(self.proc.pid)

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; close the log."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


class EngineProcess:
    """A vLLM engine (``LLM()``) alone in a child process.

    Args:
        model: model folder.
        load_format: ``auto``, ``dedup``, ...
        extra: ``model_loader_extra_config``.
        env: extra environment for the child.
        core: CPU core for its OpenMP threads.
        kv_cache_bytes: the KV cache's size in bytes.

    The child prints ``READY`` once loaded; `generate`, `complete` and `rpc` talk to it; its
    stderr (vLLM's log) goes to a temporary file, read with `log` (a pipe nobody reads would
    fill up and block the engine).
    """

    def __init__(self, model, load_format: str = "dedup", extra: dict | None = None, env: dict | None = None,
                 core: int | None = None, kv_cache_bytes: int = 32 << 20):
        # vLLM logs to stdout by default; to stderr here, so that stdout carries only the
        # protocol and `log` holds everything the engine said.
        full_env = {**os.environ, **(env or {}), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                    "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
        if core is not None:
            full_env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        self._err = tempfile.TemporaryFile()
        self.model = str(model)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_dedup.measure", self.model, load_format, json.dumps(extra or {}),
             str(kv_cache_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, env=full_env,
        )
        self.pid = self.proc.pid

    def wait_ready(self, timeout_s: float = 300) -> EngineProcess:
        """Wait until the engine has loaded.

        Raises:
            RuntimeError: the child exited (the message holds its log's tail).
        """
        self._read_line("READY", timeout_s)
        return self

    def _read_line(self, prefix: str, timeout_s: float) -> str:
        return read_reply(self.proc, prefix, timeout_s, f"engine for {self.model}", lambda: self.log()[-6000:])

    def _send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def complete(self, prompts: list[str] = PROMPTS, max_tokens: int = 16) -> dict:
        """Greedy completions: ``{"ids": [[token ids], ...], "texts": [...], "seconds": s}``."""
        self._send({"prompts": prompts, "max_tokens": max_tokens})
        return json.loads(self._read_line("RESULT ", 600))

    def generate(self, prompts: list[str] = PROMPTS, max_tokens: int = 16) -> list[list[int]]:
        """Greedy token ids for each prompt."""
        return self.complete(prompts, max_tokens)["ids"]

    def rpc(self, method: str) -> str:
        """``LLM.collective_rpc(method)``: ``"ok"`` or ``"error <message>"``."""
        self._send({"rpc": method})
        return self._read_line("RPC ", 120)

    def log(self) -> str:
        """What the engine wrote to stderr so far."""
        self._err.seek(0)
        return self._err.read().decode(errors="replace")

    def pss(self, trim: bool = True) -> int:
        """The engine's PSS in bytes (engine core and worker run in this one process).

        With ``trim``, the engine first runs ``gc.collect()`` and ``malloc_trim(0)``, so that
        heap memory already freed but kept by the allocator does not count: it varies from run
        to run by tens of MB and would drown the differences measured.
        """
        if trim and self.proc.poll() is None:
            self._send({"trim": True})
            self._read_line("TRIMMED", 60)
        return pss_bytes(self.proc.pid)

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind runs in the engine."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 60) -> None:
        """Ask the engine to exit, SIGKILL it after ``timeout_s``; close its pipes."""
        if self.proc.poll() is None:
            try:
                self._send({"exit": True})
                self.proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self._err):
            try:
                stream.close()
            except OSError:
                pass

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _engine_main(argv: list[str]) -> None:
    """The child side of `EngineProcess`: load, say READY, answer requests until EOF."""
    from vllm import LLM, SamplingParams

    model, fmt = argv[0], argv[1]
    extra = json.loads(argv[2]) if len(argv) > 2 else {}
    kv_bytes = int(argv[3]) if len(argv) > 3 else 32 << 20
    llm = LLM(model, load_format=fmt, dtype="bfloat16", max_model_len=256, enforce_eager=True,
              kv_cache_memory_bytes=kv_bytes, seed=0, **({"model_loader_extra_config": extra} if extra else {}))
    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("exit"):
            break
        if req.get("trim"):
            import ctypes
            import gc

            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            print("TRIMMED", flush=True)
            continue
        if "rpc" in req:
            try:
                llm.collective_rpc(req["rpc"])
                print("RPC ok", flush=True)
            except Exception as e:  # reported to the parent, which decides
                print("RPC error " + str(e).replace("\n", " "), flush=True)
            continue
        start = time.perf_counter()
        outs = llm.generate(req["prompts"], SamplingParams(temperature=0, max_tokens=req.get("max_tokens", 16)),
                            use_tqdm=False)
        print("RESULT " + json.dumps({"ids": [list(o.outputs[0].token_ids) for o in outs],
                                      "texts": [o.outputs[0].text for o in outs],
                                      "seconds": time.perf_counter() - start}), flush=True)


if __name__ == "__main__":
    _engine_main(sys.argv[1:])
