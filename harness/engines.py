"""Real vLLM engines in child processes, for the tests, benchmarks and demo.  Not shipped.

- `ServeProcess`: ``vllm serve`` on 127.0.0.1, the multi-process path users run;
- `EngineProcess`: ``LLM()`` in one child process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), driven
  over stdin/stdout by ``python -m harness.engines``: starts in seconds, and its own PSS is the
  engine's memory.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from . import oracle as oracle_extension
from .procs import ROOT, PeerProcess, descendants, free_port, pss_bytes, pss_parts, tree_pss_bytes

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]

__all__ = ["PROMPTS", "EngineProcess", "ServeProcess", "openai_complete", "start_engines"]


def openai_complete(port: int, model: str, prompt: str, max_tokens: int = 16, logprobs: int | None = None,
                    route: str = "") -> dict:
    """One greedy completion through an OpenAI-compatible ``/v1/completions`` route on
    127.0.0.1:``port`` (under ``route``, e.g. a Serve application's ``route_prefix``); returns
    the response JSON.

    Raises:
        urllib.error.URLError: the server cannot be reached or answered an error status.
    """
    request = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if logprobs is not None:
        request["logprobs"] = logprobs
    req = urllib.request.Request(f"http://127.0.0.1:{port}{route}/v1/completions", json.dumps(request).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


_DEDUP_LINE = re.compile(r"vllm-dedup: .*")


def dedup_log_lines(log: str) -> list[str]:
    """What an engine's log says of vllm-dedup (the path, why a fast path was declined), each
    line from its ``vllm-dedup:`` on."""
    return [m.group(0) for m in _DEDUP_LINE.finditer(log)]


def dedup_warnings(log: Path) -> list[str]:
    """The vllm-dedup warnings and errors in an engine's log so far, each line cut to 400
    characters: why a dedup engine shares less than it could (a registry it could not reach,
    a fallback)."""
    with open(log, errors="replace") as f:
        return [line.strip()[:400] for line in f
                if "vllm-dedup:" in line and ("WARNING" in line or "ERROR" in line)]


class ServeProcess:
    """One ``vllm serve`` engine on 127.0.0.1, in its own process group.

    Args:
        model: model folder.
        load_format: ``auto``, ``dedup``, ...
        extra_config: ``--model-loader-extra-config`` (dict), if any.
        log: file for the server's output.
        core: CPU core for the engine's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``).
        kv_cache_bytes: the KV cache's size (the CPU backend needs one given explicitly).
        dtype: the engine's dtype.
        compiled: run as users do, under torch.compile (no ``--enforce-eager``): 60 to 100 s
            more start-up on the CPU backend.
    """

    def __init__(self, model, load_format: str, log: Path, extra_config: dict | None = None,
                 core: int | None = None, kv_cache_bytes: int = 32 << 20, env: dict | None = None,
                 dtype: str = "bfloat16", compiled: bool = False, oracle: bool = True):
        self.model = str(model)
        self.log_path = Path(log)
        self._log = open(self.log_path, "wb")
        cmd = [str(Path(sys.executable).with_name("vllm")), "serve", self.model, "--host", "127.0.0.1",
               "--dtype", dtype, "--max-model-len", "256",
               "--kv-cache-memory-bytes", str(kv_cache_bytes), "--load-format", load_format, "--seed", "0"]
        if not compiled:
            cmd.append("--enforce-eager")
        if extra_config:
            cmd += ["--model-loader-extra-config", json.dumps(extra_config)]
        full_env = {**os.environ, **(env or {})}
        if oracle:  # the final-tensor oracle (harness/oracle.py) over vLLM's dev-mode RPC route
            cmd += ["--worker-extension-cls", oracle_extension.EXTENSION]
            full_env.update(VLLM_SERVER_DEV_MODE="1", PYTHONPATH=os.pathsep.join(
                p for p in (str(ROOT), full_env.get("PYTHONPATH")) if p))
        if core is not None:
            full_env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        self._cmd, self._env, self._port_retries = cmd, full_env, 3
        self._start()

    def _start(self) -> None:
        # The port is free when chosen, and vllm serve binds it some ten seconds later: another
        # process (an outgoing connection's ephemeral port, the other test worker) may take it
        # meanwhile.  `wait_ready` then starts the server again on another port.
        self.port = free_port()
        self._log.flush()
        self._log_start = self._log.tell()  # what this start writes follows
        # A process group of its own (stop() and the soak signal the whole group), in our session:
        # a new session is a new scheduler autogroup, whose weight the kernel spreads over the
        # cores by where its threads ran, so a worker pinned to a core where its own server's
        # group seldom ran got about 4% of that core next to a busy engine, and took up to ten
        # minutes to start.
        self.proc = subprocess.Popen([*self._cmd, "--port", str(self.port)], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=self._env, process_group=0)

    def wait_ready(self, timeout_s: float = 300) -> ServeProcess:
        """Wait for ``/health``.

        Raises:
            RuntimeError: the server exited (the message holds its log's tail).
            TimeoutError: not ready within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log_path, "rb") as f:
                    f.seek(self._log_start)
                    tail = f.read().decode(errors="replace")[-5000:]
                if "Address already in use" in tail and self._port_retries > 0:  # the port was taken (`_start`)
                    self._port_retries -= 1
                    self._log.write(f"\n--- port {self.port} was taken: starting again ---\n".encode())
                    self._log.flush()
                    self._start()
                    continue
                raise RuntimeError(f"vllm serve {self.model} exited ({self.proc.returncode}):\n" + tail)
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).status == 200:
                    return self
            except OSError:
                time.sleep(0.5)
        self.dump_stacks()
        raise TimeoutError(f"vllm serve {self.model} not ready after {timeout_s} s (the stacks of its processes "
                           f"are at the end of {self.log_path})")

    def dump_stacks(self) -> None:
        """Append the Python stack of every process of the server's tree to its log (py-spy, which
        Ray installs; nothing if it is missing): where a server that never became ready waits."""
        spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
        if spy is None:
            return
        for pid in self.pids():
            dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, timeout=60)
            self._log.write(f"\n--- py-spy dump --pid {pid} (rc {dump.returncode}) ---\n".encode()
                            + dump.stdout + dump.stderr)
        self._log.flush()

    def complete(self, prompts: list[str] = PROMPTS, max_tokens: int = 16) -> list[str]:
        """Greedy completions through the OpenAI-compatible ``/v1/completions`` route."""
        return [openai_complete(self.port, self.model, p, max_tokens)["choices"][0]["text"] for p in prompts]

    def final_tensors(self) -> list[dict[str, str]]:
        """Per worker, the digest of every tensor of its model (`harness.oracle`)."""
        return oracle_extension.serve_digests(self.port)

    def pss(self) -> int:
        """PSS of the server's process tree, in bytes."""
        return tree_pss_bytes(self.proc.pid)

    def pids(self) -> list[int]:
        return descendants(self.proc.pid)

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM the process group (server, engine core, worker), SIGKILL what is left of it
        after ``timeout_s``; return once every process of the group has exited, then close the log.

        Waiting for the server alone is not enough: it can exit before its worker, whose
        registry lease would then see a registry stopped right after as one to restart.
        """
        group = self.proc.pid  # process_group=0: the server leads its own group
        try:  # the group, even where the server exited first: its engine core may live on
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if not self._group_exited(timeout_s):
            os.killpg(group, signal.SIGKILL)
            self._group_exited(30)  # the server's children are reaped by init
        self.proc.wait()
        self._log.close()

    def _group_exited(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the server's process group to have no process left."""
        deadline = time.monotonic() + timeout_s
        while _group_alive(self.proc.pid):
            if time.monotonic() > deadline:
                return False
            self.proc.poll()  # reaps the server, the group's leader, once it exits
            time.sleep(0.1)
        return True


def _group_alive(group: int) -> bool:
    """Whether process group ``group`` has a process left (a zombie not yet reaped counts)."""
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False


class EngineProcess(PeerProcess):
    """A vLLM engine (``LLM()``) alone in a child process.

    Args:
        model: model folder.
        load_format: ``auto``, ``dedup``, ...
        extra: ``model_loader_extra_config``.
        env: extra environment for the child.
        core: sets ``VLLM_CPU_OMP_THREADS_BIND`` to this core.  vLLM binds only the worker
            processes it starts, and this engine's worker runs in the child itself
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its threads are not bound: they run on
            every CPU (checked in its ``/proc/PID/task/*/status``).  The value still enters
            vLLM's compile-cache key (`tests/e2e/test_compiled.py`).
        kv_cache_bytes: the KV cache's size in bytes.
        rlimits: resource limits for the engine's process (`PeerProcess`).
        dtype: the engine's dtype (``bfloat16``; ``float32`` serves a float32 checkpoint as is).
        compiled: run as users do, under torch.compile (``enforce_eager=False``): 60 to 100 s
            more start-up on the CPU backend.
        graceful_exit: `stop` lets the engine shut down as ``LLM`` does at interpreter exit
            (vLLM's ``EngineCore.shutdown``, then Python's finalization), as a user's script
            ends.  Default: the child ends with ``os._exit(0)`` once asked to stop (Note [an
            engine's exit in the tests]).

    The child prints ``READY`` once loaded; `generate`, `complete`, `final_tensors` (the oracle,
    `harness.oracle`) and `rpc` talk to it; its stderr (vLLM's log) is kept for `log`.  `load_stats` says what loading the model cost,
    measured the same way for every load format.
    """

    def __init__(self, model, load_format: str = "dedup", extra: dict | None = None, env: dict | None = None,
                 core: int | None = None, kv_cache_bytes: int = 32 << 20, rlimits: dict[int, int] | None = None,
                 dtype: str = "bfloat16", compiled: bool = False, graceful_exit: bool = False):
        self.graceful_exit = graceful_exit
        # vLLM logs to stdout by default; to stderr here, so that stdout carries only the
        # protocol and `log` holds everything the engine said.
        full_env = {**(env or {}), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
        if core is not None:
            full_env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        self.model, self.load_format = str(model), load_format
        super().__init__(["-m", "harness.engines", self.model, load_format, json.dumps(extra or {}),
                          str(kv_cache_bytes), dtype, "compiled" if compiled else "eager"],
                         f"engine for {self.model}", full_env, rlimits=rlimits)

    def wait_ready(self, timeout_s: float = 300) -> EngineProcess:
        """Wait until the engine has loaded.

        Raises:
            ChildExited: the child exited (the message holds its log's tail).
        """
        self.read("READY", timeout_s)
        return self

    def complete(self, prompts: list[str] = PROMPTS, max_tokens: int = 16) -> dict:
        """Greedy completions: ``{"ids": [[token ids], ...], "texts": [...], "seconds": s}``."""
        self.send({"prompts": prompts, "max_tokens": max_tokens})
        return self.read_json("RESULT ", 600)

    def generate(self, prompts: list[str] = PROMPTS, max_tokens: int = 16) -> list[list[int]]:
        """Greedy token ids for each prompt."""
        return self.complete(prompts, max_tokens)["ids"]

    def embed(self, prompts: list[str] = PROMPTS) -> list[str]:
        """A pooling model's output for each prompt, as ``"shape|<XXH3-128 of its float32
        bytes>"`` (``LLM.embed``; token-level models such as ``BertForMaskedLM`` through
        ``LLM.encode`` with ``pooling_task="token_classify"``)."""
        self.send({"embed": prompts})
        return self.read_json("EMBEDDED ", 600)

    def load_stats(self) -> dict:
        """``{"seconds": wall time of vLLM's get_model (the loader's load_model), "peak_bytes":
        the largest growth of the process's private memory (RssAnon) during it,
        "new_memory_peak_bytes": the largest growth of that plus the machine's shared memory
        (``Shmem`` of /proc/meminfo: segments made meanwhile, by anyone), "user_seconds" and
        "system_seconds": the CPU time of every thread of the engine's process during it, in
        user space and in the kernel (page faults, shared memory filled; not other processes',
        such as a registry daemon the load starts), "gc_seconds" and
        "gc_collections": the garbage collector's pauses during it}``."""
        self.send({"load_stats": True})
        return self.read_json("LOADSTATS ", 60)

    def final_tensors(self) -> list[dict[str, str]]:
        """Per worker, the digest of every tensor of its model (`harness.oracle`)."""
        self.send({"final_tensors": True})
        return json.loads(self.read("TENSORS ", 300))

    def delete(self) -> None:
        """Delete the ``LLM`` and collect garbage, as a user lets an engine of their own process
        go; the process lives on, and `stop` is all that may follow."""
        self.send({"delete": True})
        self.read("DELETED", 120)

    def rpc(self, method: str) -> str:
        """``LLM.collective_rpc(method)``: ``"ok"`` or ``"error <message>"``."""
        self.send({"rpc": method})
        return self.read("RPC ", 120)

    def call(self, method: str, **kwargs) -> str:
        """``LLM.<method>(**kwargs)`` (``sleep``, ``wake_up``): ``"ok"`` or ``"error <message>"``."""
        self.send({"call": method, "kwargs": kwargs})
        return self.read("CALL ", 120)

    def pss(self, trim: bool = True) -> int:
        """The engine's PSS in bytes (engine core and worker run in this one process).

        With ``trim``, the engine first runs ``gc.collect()`` and ``malloc_trim(0)``, so that
        heap memory already freed but kept by the allocator does not count: it varies from run
        to run by tens of MB and would drown the differences measured.
        """
        self._trim(trim)
        return pss_bytes(self.pid)

    def own_pss(self, trim: bool = True) -> int:
        """The engine's heap and shared memory in bytes: ``Pss_Anon + Pss_Shmem``, trimmed as in
        `pss`.  What sharing segments changes, and nothing else: file-backed pages (torch's and
        oneDNN's libraries) are left out, because their PSS divides by every process on the
        machine that maps the same library, so it moves with engines of other tests running
        beside this one (pytest-xdist) by tens of MB.
        """
        self._trim(trim)
        parts = pss_parts(self.pid)
        return parts["Pss_Anon"] + parts["Pss_Shmem"]

    def _trim(self, trim: bool) -> None:
        """With ``trim``, have the (running) engine run ``gc.collect()`` and ``malloc_trim(0)``."""
        if trim and self.proc.poll() is None:
            self.send({"trim": True})
            self.read("TRIMMED", 60)

    def stop(self, timeout_s: float = 60) -> None:
        """Ask the engine to exit, SIGKILL it after ``timeout_s``; close its pipes."""
        if self.proc.poll() is None:
            try:
                self.send({"exit": True, "graceful": self.graceful_exit})
            except OSError:
                pass
        self.end(timeout_s)

    def __exit__(self, *exc) -> None:
        self.stop()


def start_engines(specs: list[dict]) -> list[EngineProcess]:
    """Start engines one after another (each waits for the previous: the first publishes, the
    next ones map), each given its own core (which binds nothing: `EngineProcess`).  ``specs``:
    `EngineProcess` arguments."""
    engines = []
    try:
        for i, spec in enumerate(specs):
            engines.append(EngineProcess(core=i % (os.cpu_count() or 1), **spec).wait_ready())
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


# Note [an engine's exit in the tests]
#     An ``LLM`` that ends with the interpreter runs vLLM's shutdown: ``gc.unfreeze()`` and two
#     full collections over every object vLLM's imports made, then Python's own finalization,
#     2.8-3.0 s of one core per engine here (py-spy: most of it ``gc_collect_main``).  The suite
#     stops well over a hundred engines, so that was minutes of CI spent in teardown nobody
#     tests.  vllm-dedup adds nothing to that shutdown: an engine's segments, lease and
#     start-up lock go with its process (descriptors, the registry connection, a file lock),
#     however it ends.  So by default the child ends with ``os._exit(0)`` when asked to stop;
#     the tests about a clean exit ask for the real one (``graceful_exit=True``), and
#     ``vllm serve`` engines (`ServeProcess`) always get theirs, from SIGTERM.
def _engine_main(argv: list[str]) -> None:
    """The child side of `EngineProcess`: load, say READY, answer requests until EOF."""
    from vllm import LLM, SamplingParams

    model, fmt = argv[0], argv[1]
    extra = json.loads(argv[2]) if len(argv) > 2 else {}
    kv_bytes = int(argv[3]) if len(argv) > 3 else 32 << 20
    dtype = argv[4] if len(argv) > 4 else "bfloat16"
    eager = argv[5] != "compiled" if len(argv) > 5 else True
    load_stats = _meter_get_model()
    llm = LLM(model, load_format=fmt, dtype=dtype, max_model_len=256, enforce_eager=eager,
              kv_cache_memory_bytes=kv_bytes, seed=0, worker_extension_cls=oracle_extension.EXTENSION,
              **({"model_loader_extra_config": extra} if extra else {}))
    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("exit"):
            if not req.get("graceful"):  # Note [an engine's exit in the tests]
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            break
        if req.get("delete"):  # as a user deletes an engine of their own process; only exit follows
            del llm
            gc.collect()
            print("DELETED", flush=True)
            continue
        if req.get("trim"):
            import ctypes

            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            print("TRIMMED", flush=True)
            continue
        if req.get("final_tensors"):
            print("TENSORS " + json.dumps(llm.collective_rpc("final_tensor_digests")), flush=True)
            continue
        if req.get("load_stats"):
            print("LOADSTATS " + json.dumps(load_stats), flush=True)
            continue
        if "embed" in req:
            print("EMBEDDED " + json.dumps(_pooled_digests(llm, req["embed"])), flush=True)
            continue
        if "rpc" in req or "call" in req:
            reply = "RPC" if "rpc" in req else "CALL"
            try:
                if "rpc" in req:
                    llm.collective_rpc(req["rpc"])
                else:
                    getattr(llm, req["call"])(**req["kwargs"])
                print(f"{reply} ok", flush=True)
            except Exception as e:  # reported to the parent, which decides
                print(f"{reply} error " + str(e).replace("\n", " "), flush=True)
            continue
        start = time.perf_counter()
        outs = llm.generate(req["prompts"], SamplingParams(temperature=0, max_tokens=req.get("max_tokens", 16)),
                            use_tqdm=False)
        print("RESULT " + json.dumps({"ids": [list(o.outputs[0].token_ids) for o in outs],
                                      "texts": [o.outputs[0].text for o in outs],
                                      "seconds": time.perf_counter() - start}), flush=True)


PROFILE_ENV = "HARNESS_PROFILE_GET_MODEL"  # a path: `_meter_get_model` writes a cProfile of get_model there


def _pooled_digests(llm, prompts: list[str]) -> list[str]:
    """``"shape|xxh3-128"`` of a pooling model's float32 output for each prompt."""
    import torch
    import xxhash

    try:
        outs = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    except (ValueError, TypeError, NotImplementedError):  # a token-level pooler (e.g. BertForMaskedLM)
        outs = [o.outputs.data for o in llm.encode(prompts, pooling_task="token_classify", use_tqdm=False)]
    digests = []
    for out in outs:
        t = torch.as_tensor(out).to(torch.float32).contiguous()
        digests.append(f"{list(t.shape)}|{xxhash.xxh3_128_hexdigest(t.numpy().tobytes())}")
    return digests


def _machine_shmem_bytes() -> int:
    """The machine's shared memory (``Shmem`` of /proc/meminfo: memfds, tmpfs), in bytes."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Shmem:"))


def _meter_get_model() -> dict:
    """Time vLLM's ``get_model`` (which calls the loader's ``load_model``) in this process and
    sample its private memory, whatever the load format; the figures land in the dict returned.
    With `PROFILE_ENV` set to a path, a cProfile of the call is written there (pstats format)."""
    import vllm.v1.worker.cpu_model_runner as runner

    from vllm_dedup.engine.meter import LoadMeter

    stats: dict = {}
    get_model = runner.get_model
    profile_path = os.environ.get(PROFILE_ENV)

    def measured(*args, **kwargs):
        profiler = None
        if profile_path:
            import cProfile

            profiler = cProfile.Profile()
        pauses: list[float] = []  # the garbage collector's, during the call

        def on_gc(phase, info, begun=[0.0]):
            if phase == "start":
                begun[0] = time.perf_counter()
            else:
                pauses.append(time.perf_counter() - begun[0])

        gc.callbacks.append(on_gc)
        cpu = os.times()  # every thread of this process (engine core and worker run here)
        try:
            with LoadMeter("cpu") as meter, LoadMeter("cpu", live=_machine_shmem_bytes) as with_shmem:
                if profiler is not None:
                    profiler.enable()
                model = get_model(*args, **kwargs)
                if profiler is not None:
                    profiler.disable()
        finally:
            end = os.times()
            gc.callbacks.remove(on_gc)
        if profiler is not None:
            profiler.dump_stats(profile_path)
        stats.update(seconds=meter.seconds, peak_bytes=max(meter.peak_growth, 0),
                     new_memory_peak_bytes=max(with_shmem.peak_growth, 0),
                     user_seconds=end.user - cpu.user, system_seconds=end.system - cpu.system,
                     gc_seconds=sum(pauses),
                     gc_collections=len(pauses))
        return model

    runner.get_model = measured
    return stats


if __name__ == "__main__":
    _engine_main(sys.argv[1:])
