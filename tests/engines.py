"""Starting and talking to real engine processes (`engine_host.py`), and reading their memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOST = Path(__file__).with_name("engine_host.py")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


def pss_bytes(pid: int) -> int:
    """Proportional set size of a process, in bytes (/proc/PID/smaps_rollup)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss line for pid {pid}")


class Engine:
    """A vLLM engine in a child process (see `engine_host.py`)."""

    def __init__(self, model, load_format: str = "dedup", extra: dict | None = None, env: dict | None = None,
                 core: int | None = None):
        full_env = {**os.environ, **(env or {})}
        if core is not None:
            full_env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        # stderr to a file: vLLM logs a lot, and an unread pipe would fill and block the engine.
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, str(HOST), str(model), load_format, json.dumps(extra or {})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, env=full_env,
        )
        self.model = str(model)
        self.stderr_tail = ""

    def wait_ready(self, timeout_s: float = 300) -> Engine:
        line = self._read_line("READY ", timeout_s)
        self.pid = json.loads(line)["pid"]
        return self

    def _read_line(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                self.stderr_tail = self.log()[-6000:]
                raise RuntimeError(f"engine for {self.model} exited ({self.proc.wait()}):\n{self.stderr_tail}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise TimeoutError(f"engine for {self.model} did not answer in {timeout_s} s")

    def generate(self, prompts=PROMPTS, max_tokens: int = 16) -> list[list[int]]:
        """Greedy token ids for each prompt."""
        return self.complete(prompts, max_tokens)["ids"]

    def complete(self, prompts=PROMPTS, max_tokens: int = 16) -> dict:
        """Greedy completions: ``{"ids": [[...], ...], "texts": [...]}``."""
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read_line("RESULT ", 300))

    def rpc(self, method: str) -> str:
        self.proc.stdin.write(json.dumps({"rpc": method}) + "\n")
        self.proc.stdin.flush()
        return self._read_line("RPC ", 120)

    def log(self) -> str:
        """Everything the engine wrote to stderr so far."""
        self._err.seek(0)
        return self._err.read().decode(errors="replace")

    def pss(self) -> int:
        return pss_bytes(self.proc.pid)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 60) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self._err):
            try:
                stream.close()
            except OSError:
                pass

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_engines(specs: list[dict]) -> list[Engine]:
    """Start engines one after another (each waits for the previous: the first publishes,
    the next ones map), each bound to its own core."""
    engines = []
    try:
        for i, spec in enumerate(specs):
            engines.append(Engine(core=i % (os.cpu_count() or 1), **spec).wait_ready())
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines
