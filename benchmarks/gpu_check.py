"""The GPU proof: every check of the CUDA path in one run, with real processes and a real registry,
without vLLM and without Ray.

    python benchmarks/gpu_check.py --out DIR                    # on a GPU: every step
    python benchmarks/gpu_check.py --backend host --out DIR     # the same steps on memfd segments (CI)

It needs torch, cuda-bindings (CUDA backend), nvidia-ml-py (NVML, CUDA backend), xxhash,
safetensors and transformers, which the lent GPU machines have, and not blake3, gguf, vLLM or
Ray, which they lack (CI runs it with those unimportable: tests/device_image); nothing is
downloaded.  A child that exits early has its stderr's last lines in the check.  The registry runs in this process behind
its Unix socket (`RegistryServer`), as on a machine without Ray; each engine is a child process
(``--child``) driven over stdin/stdout.  Every process checks that it never imported vLLM or Ray.
It prints a table and writes ``gpu_check-<backend>.json`` and ``gpu_check-<backend>.txt`` to DIR.
Exit status 0 only if every check passed.

Steps (``--steps``, default all that the backend has):

``driver`` (CUDA only; no torch CUDA, so CI runs it against the driver model in tests/cuda_model):
   naming every visible device leaves the thread's context as it was and activates no primary
   context, and the probe that says so notices a change; NVML finds the device by the key's
   UUID (``GPU-`` or ``MIG-``) and sees a new allocation in its used memory.

``segments``: 1. ``A`` creates one pack (a seeded bfloat16 weight of ``--segment-mb`` and, in the
   granule after it, a 1 MiB member) and publishes it; 2. ``B`` then ``C`` map only the weight (a
   mapping smaller than the allocation on the host; on a GPU the whole allocation, since the
   driver maps no part of an imported one); the device's used memory grows once per segment, not
   once per process (CUDA: NVML, on the device found by the key's UUID; host: the anonymous and
   shared-memory PSS of this run's processes); creating and mapping leave each child's CUDA
   context as it was; 3. A, B, C compute ``W @ x`` through their own mapping; 4. ``A`` exits, B and
   C compute again; 5. ``D`` writes into its read-only mapping: the write faults (or the table says
   the driver refused read-only mappings), B reads the bytes unchanged; 6. throughput: the device
   fingerprint and the exact compare next to a device-to-device copy, and both over a whole
   synthetic model next to loading it from a safetensors file.

``model``: two processes build the same small transformers model (a ``LlamaForCausalLM`` from a
   config, seeded random weights, tied embeddings; ``--model-size``), each computes its logits on a
   fixed prompt privately, then shares its weights with the loader's own sharing pass
   (`engine.share.share_model`) through segments and the registry: ``M1`` publishes, ``M2`` maps
   every shareable weight; both compute again and must get bit-identical logits (deterministic
   algorithms on); used memory of the device and of each process (NVML per process; host: PSS)
   is recorded after each step; ``M1`` exits and ``M2`` computes once more.

``in_place``: publish in place (`engine.in_place_packed`): ``P1`` builds the model, moves its
   storages into writable packed segments (the host backend packs at 2 MiB as a GPU does),
   zeroes them and writes them again from a CPU copy as vLLM's weight loaders write, and the
   sharing pass publishes every pack where it lies: no copy, and on a GPU its used memory after
   publishing is a private load's plus the packs' padding (within 5%); its logits equal its
   private ones; ``P2`` maps every weight and computes the same logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/ and a bare checkout's vllm_dedup (the lent GPU machines)
# ... and in the processes the library starts itself (a registry daemon, `start_daemon`).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

KEY, EXTRA = "gpu-check-weight", "gpu-check-extra"  # the pack's two members; children map only KEY
MB = 1 << 20
FORBIDDEN = ("vllm", "ray")  # not on the GPU machines: no path of this script may import them
STEPS = {"cuda": ("driver", "segments", "model", "in_place"), "host": ("segments", "model", "in_place")}
HOST_GRANULARITY = 2 * MB  # the host backend has none; in_place lays packs out as on a GPU
# (hidden, intermediate, layers, heads, kv heads, vocab): the model step's LlamaForCausalLM
MODEL_SIZES = {"tiny": (512, 1376, 4, 8, 4, 16384), "small": (1024, 2816, 8, 16, 8, 32000)}
PROMPT = [[1, 15, 27, 3, 99, 512, 7, 64, 300, 2, 11, 900]]  # token ids < every vocabulary above


def forbidden_imports() -> list[str]:
    """Modules of vLLM or Ray this process has imported (must stay empty)."""
    return sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in FORBIDDEN})


class Platform:
    """What differs between the backends inside an engine process: the torch device, waiting
    for the device, and giving torch's cached blocks back."""

    def __init__(self, backend: str):
        import torch

        self.cuda = backend == "cuda"
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def release_cached(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.empty_cache()


# child ---------------------------------------------------------------------------------------
def child(sock: str, backend: str, segment_mb: int, model_size: str) -> None:
    """An engine: answers one JSON command per stdin line with one ``OK``/``ERR`` JSON line."""
    if backend == "cuda":  # before torch initialises CUDA: cuBLAS's deterministic workspace
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    from vllm_dedup.content.fingerprint import device_fingerprints
    from vllm_dedup.engine.resident import map_resident
    from vllm_dedup.registry.client import RegistryClient
    from vllm_dedup.registry.lease import Lease
    from vllm_dedup.segments import segment_class

    platform = Platform(backend)
    device = platform.device
    if platform.cuda:
        torch.ones(1, device=device)  # the CUDA context exists before the parent measures
        platform.sync()
    seg_cls = segment_class(device.type)
    contexts = ContextProbe(backend)
    device_key = seg_cls.device_key(device)
    keys_ok = contexts.unchanged_after(lambda: [seg_cls.device_key(i) for i in range(contexts.count)])
    client = Lease(RegistryClient(sock), f"gpu-check-{os.getpid()}", device_key, "default", "gpu-check")
    state: dict = {}
    rows = segment_mb * MB // 2 // 4096

    def reply(obj: dict) -> None:
        print("OK " + json.dumps({**obj, "forbidden_imports": forbidden_imports()}), flush=True)

    def fingerprint(t) -> str:
        return device_fingerprints([t.contiguous()])[0].hex()

    reply({"pid": os.getpid(), "device": device_key, "device_key_context_ok": keys_ok})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "create":
                gen = torch.Generator(device=device).manual_seed(0)
                weight = torch.randn(rows, 4096, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
                extra = torch.ones(MB, dtype=torch.uint8, device=device)
                wbytes = weight.numel() * 2
                offset = -(-wbytes // (2 * MB)) * 2 * MB  # the granule after the weight
                made = []
                ctx_ok = contexts.unchanged_after(lambda: made.append(
                    seg_cls.create_packed([(weight, 0), (extra, offset)], offset + MB, device_key)))
                seg = made[0]
                client.publish(seg.fileno(), seg.size, [(KEY, 0, wbytes), (EXTRA, offset, MB)])
                seg.close_fd()
                state["w"] = seg.tensor(0, weight.dtype, weight.shape, weight.stride())
                digest = fingerprint(weight)
                del weight, extra
                platform.release_cached()
                reply({"fingerprint": digest, "size": seg.size, "read_only": seg.read_only, "context_ok": ctx_ok})
            elif op == "map":
                made = []  # the pack's first member only, mapped as an engine maps it
                ctx_ok = contexts.unchanged_after(lambda: made.extend(map_resident(client, seg_cls, device_key, [KEY])))
                (mapped,) = made
                if mapped.error is not None:
                    raise mapped.error
                seg, (hit,) = mapped.segment, mapped.found.hits
                state["w"] = seg.tensor(hit.offset, torch.bfloat16, (rows, 4096), (4096, 1))
                digest = fingerprint(state["w"])
                platform.release_cached()  # the reading after it is the mapping's alone
                reply({"fingerprint": digest, "size": seg.size, "read_only": seg.read_only, "context_ok": ctx_ok})
            elif op == "compute":
                x = torch.randn(4096, 8, generator=torch.Generator(device=device).manual_seed(1), device=device)
                y = state["w"].float() @ x
                out = {"result": fingerprint(y), "fingerprint": fingerprint(state["w"])}
                del x, y
                platform.release_cached()  # the float32 copy of W
                reply(out)
            elif op == "write":
                print("WRITING", flush=True)
                state["w"].add_(1)  # must fault: the mapping is read-only
                platform.sync()
                reply({"wrote": True})
            elif op == "throughput":
                reply(throughput(platform, int(cmd["mb"])))
            elif op == "build":
                state["model"] = build_model(model_size, platform)
                reply(model_bytes(state["model"], int(cmd["min_tensor_bytes"])))
            elif op == "logits":
                reply(logits(state, platform, fingerprint))
            elif op == "place":
                reply(place(state, seg_cls, platform, device_key, int(cmd["min_tensor_bytes"])))
            elif op == "share":
                reply(share(state["model"], client, platform, device_key, int(cmd["min_tensor_bytes"]),
                            state.get("in_place")))
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # reported to the parent, which decides what it means
            print("ERR " + json.dumps({"error": f"{type(e).__name__}: {e}", "forbidden_imports": forbidden_imports()}),
                  flush=True)
    client.close()


def build_model(size: str, platform: Platform):
    """A ``LlamaForCausalLM`` from a config (no download), its weights drawn from a fixed seed
    on the CPU (the same in every process and on every backend), in bfloat16 on the device.  The
    weights are made bfloat16 on the CPU: converting on the device would interleave float32
    copies with them in torch's cache, which the weights' blocks then cannot leave whole."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, layers, heads, kv_heads, vocab = MODEL_SIZES[size]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    return model.to(dtype=torch.bfloat16).to(device=platform.device).eval()


def model_bytes(model, min_tensor_bytes: int) -> dict:
    """Bytes of the model's distinct storages in all, and of those the sharing pass takes
    (at least ``min_tensor_bytes``)."""
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return {"bytes": sum(storages.values()),
            "shareable_bytes": sum(n for n in storages.values() if n >= min_tensor_bytes)}


def logits(state: dict, platform: Platform, fingerprint) -> dict:
    """The model's logits on `PROMPT`: their fingerprint, and how they compare with this
    process's first (private) logits."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    with torch.no_grad():
        out = state["model"](torch.tensor(PROMPT, device=platform.device)).logits.float()
    platform.sync()
    out = out.cpu()  # kept on the host: nothing of this check's own pins torch's cached blocks
    first = state.setdefault("private_logits", out)
    return {"fingerprint": fingerprint(out), "equal_to_private": bool(torch.equal(out, first)),
            "max_abs_diff_to_private": float((out - first).abs().max()),
            "next_tokens": out[0].argmax(-1).tolist()}


def share(model, lease, platform: Platform, device_key: str, min_tensor_bytes: int, in_place=None) -> dict:
    """The loader's sharing pass (`engine.share.share_model`) over the model, publishing
    ``in_place``'s packs where they lie if given; its figures."""
    from vllm_dedup.config import DedupConfig
    from vllm_dedup.engine.context import LoadContext
    from vllm_dedup.engine.share import share_model

    config = DedupConfig(min_tensor_bytes=min_tensor_bytes, on_registry_error="fail")
    granularity = None if in_place is None else in_place.granularity
    result = share_model(model, LoadContext(config, lease, platform.device, device_key), pack_granularity=granularity,
                         in_place=in_place)
    if in_place is not None:
        in_place.release()
    out = {k: v for k, v in dataclasses.asdict(result).items() if k != "placement"}
    out["allocator"] = allocator(platform)
    if in_place is not None:
        out.update(sealed_bytes=in_place.sealed_bytes, in_place_failures=in_place.failures[:3])
    return out


def place(state: dict, seg_cls, platform: Platform, device_key: str, min_tensor_bytes: int) -> dict:
    """What the loader does around ``load_weights`` with publish in place
    (`engine.in_place_packed.PackedInPlace`): the model's storages are moved into writable packed
    segments, zeroed, then written again from a copy on the CPU (the "checkpoint"), as vLLM's
    weight loaders write (``param.data.copy_``).  Returns what was placed."""
    import torch

    from vllm_dedup.engine.in_place_packed import PackedInPlace

    model = state["model"]
    checkpoint = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    granularity = seg_cls.granularity(platform.device) or HOST_GRANULARITY
    placed = PackedInPlace(seg_cls, device_key, platform.device.type, granularity, min_tensor_bytes)
    placed.place(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data.zero_()
        for name, p in model.named_parameters():
            p.data.copy_(checkpoint[name])
    platform.sync()
    state["in_place"] = placed
    return {"placed_bytes": placed.placed_bytes, "held_bytes": placed.held_bytes, "failures": placed.failures[:3],
            "allocator": allocator(platform)}


def allocator(platform: Platform) -> dict:
    """What torch's CUDA caching allocator holds (bytes): handed out, reserved from the driver,
    and its segments that hold live blocks (size, bytes live in it; the 12 biggest), which are
    what a device's used memory keeps beside the segments.  Empty on the host."""
    if not platform.cuda:
        return {}
    import torch

    live = sorted(((s["total_size"], s["allocated_size"]) for s in torch.cuda.memory_snapshot()
                   if s["allocated_size"]), reverse=True)
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "segments_with_live_blocks": len(live), "biggest": live[:12]}


class ContextProbe:
    """Whether an operation leaves this thread's CUDA context (and torch's current device, where
    torch has CUDA) as they were and makes no other GPU's primary context active
    (``cuCtxGetCurrent``, ``cuDevicePrimaryCtxGetState``).  On host segments there is nothing to
    check."""

    def __init__(self, backend: str):
        from vllm_dedup.segments import cudadrv

        self.cuda = backend == "cuda"
        self.count = cudadrv.device_count() if self.cuda else 0

    def state(self) -> tuple:
        import torch

        from vllm_dedup.segments.cudadrv import call

        # torch first: should its first call initialise anything, both readings include it.
        current = torch.cuda.current_device() if torch.cuda.is_available() else None
        active = [i for i in range(self.count) if call("cuDevicePrimaryCtxGetState", call("cuDeviceGet", i))[1]]
        return int(call("cuCtxGetCurrent")), current, active

    def unchanged_after(self, fn) -> bool:
        """Run ``fn()``; True when the context state is the same afterwards."""
        before = self.state() if self.cuda else None
        fn()
        return not self.cuda or self.state() == before


def _timed(fn, platform: Platform, repeat: int = 5) -> float:
    """Median seconds of ``fn()`` (synchronised)."""
    times = []
    for _ in range(repeat + 1):
        platform.sync()
        start = time.perf_counter()
        fn()
        platform.sync()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]  # the first run warms up


def _tensor_rates(platform: Platform, n: int) -> dict:
    """GB/s of fingerprint, exact compare and copy on one bfloat16 tensor of ``n`` elements
    (freed on return)."""
    import torch

    from vllm_dedup.content.fingerprint import device_fingerprints, same_bytes

    src = torch.randn(n, device=platform.device, dtype=torch.float32).to(torch.bfloat16)
    dst = src.clone()
    gb = n * 2 / 1e9
    return {
        "tensor_bytes": n * 2,
        "fingerprint_gb_s": gb / _timed(lambda: device_fingerprints([src]), platform),
        "compare_gb_s": gb / _timed(lambda: same_bytes(src, dst), platform),  # GB of one tensor; reads both
        "copy_gb_s": gb / _timed(lambda: dst.copy_(src), platform),  # GB copied: one read, one write
        "fingerprint_peak_bytes": _peak_bytes(lambda: device_fingerprints([src]), platform),
        "compare_peak_bytes": _peak_bytes(lambda: same_bytes(src, dst), platform),
    }


def _peak_bytes(fn, platform: Platform) -> int | None:
    """Bytes ``fn()`` allocates at its peak beyond what was allocated before (torch's CUDA
    allocator); None on the host."""
    if not platform.cuda:
        return None
    import torch

    platform.sync()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    platform.sync()
    return torch.cuda.max_memory_allocated() - before


def throughput(platform: Platform, mb: int) -> dict:
    """GB/s of fingerprint, exact compare and copy on one ``mb`` tensor; and fingerprint +
    compare of a synthetic model (``mb`` in 64 MiB tensors) next to loading it from a
    safetensors file onto the device."""
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_dedup.content.fingerprint import device_fingerprints, same_bytes

    device = platform.device
    out = _tensor_rates(platform, mb * MB // 2)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_file({f"w{i}": torch.randn(32 * MB, dtype=torch.float32).to(torch.bfloat16)
                   for i in range(max(1, mb // 64))}, path)
        # On the host, safetensors only maps the file; a loader then copies into its own tensors.
        load = ((lambda: load_file(path, device=str(device))) if platform.cuda
                else (lambda: [t.clone() for t in load_file(path).values()]))
        load_s = _timed(load, platform, repeat=3)
        tensors = list(load_file(path, device=str(device)).values())
        copies = [t.clone() for t in tensors]
        fp_cmp_s = _timed(lambda: (device_fingerprints(tensors), [same_bytes(t, c) for t, c in zip(tensors, copies)]),
                          platform, repeat=3)
    out.update(model_bytes=sum(t.numel() * 2 for t in tensors), load_s=load_s, fingerprint_compare_s=fp_cmp_s,
               fingerprint_compare_share_of_load=fp_cmp_s / load_s)
    return out


# parent ------------------------------------------------------------------------------------
class Child:
    """An engine child (``--child``) with its protocol: one JSON command per line, one ``OK``
    or ``ERR`` JSON reply."""

    def __init__(self, name: str, sock: Path, args, imported: set):
        from harness.procs import PeerProcess

        self.name, self.imported = name, imported
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # nothing is downloaded
        self.peer = PeerProcess([__file__, "--child", sock, "--backend", args.backend, "--segment-mb",
                                 args.segment_mb, "--model-size", args.model_size], name, env)
        self.proc = self.peer.proc
        self.pid = self.peer.pid
        self.info = self._read()

    def _read(self, timeout_s: float = 300) -> dict:
        from harness.procs import ChildExited

        try:
            got = self.peer.read_json(("OK ", "ERR "), timeout_s)
            self.imported.update(f"{self.name}: {m}" for m in got.get("forbidden_imports", ()))
            return got
        except ChildExited as e:  # e.g. killed by the fault of a write through a read-only mapping
            said = self.peer.log().strip().splitlines()[-12:]  # why, where it says (an import that failed)
            return {"error": f"exited with status {e.returncode}", "exit": e.returncode, "stderr": said}

    def ask(self, op: str, **args) -> dict:
        self.peer.send({"op": op, **args})
        return self._read()

    def end(self) -> int:
        return self.peer.end()


def nvml_handle(key: str):
    """NVML's handle of the device named by a device key (``cuda:GPU-<uuid>``), found by UUID
    (``nvmlDeviceGetHandleByUUID``) as a GPU (``GPU-``) or a MIG instance (``MIG-``), so that
    ``CUDA_VISIBLE_DEVICES`` renumbering and MIG cannot point NVML at another device.

    Raises:
        LookupError: NVML knows no device with that UUID.
    """
    import pynvml

    pynvml.nvmlInit()
    uuid = key.split(":", 1)[1][len("GPU-"):]
    for name in (f"GPU-{uuid}", f"MIG-{uuid}"):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(name)
        except pynvml.NVMLError:
            continue
    raise LookupError(f"NVML knows no GPU or MIG instance with UUID {uuid}")


class DeviceMemory:
    """Used memory in bytes, of the device and per process.

    CUDA: NVML on the device named by ``key`` (``nvmlDeviceGetMemoryInfo``; per process
    ``nvmlDeviceGetComputeRunningProcesses``, None where NVML does not say, e.g. another PID
    namespace).  Host: the anonymous and shared-memory PSS of the given processes
    (``/proc/PID/smaps_rollup``: memfd segment pages are shared memory, split between the
    processes mapping them), so that other programs on the machine do not enter the figures.
    """

    def __init__(self, backend: str, key: str | None):
        self.cuda = backend == "cuda"
        self.handle = nvml_handle(key) if self.cuda else None

    def used(self, pids: list[int]) -> int:
        if self.cuda:
            import pynvml

            return int(pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)
        return sum(v or 0 for v in self.per_process(pids).values())

    def per_process(self, pids: list[int]) -> dict[int, int | None]:
        if self.cuda:
            import pynvml

            got = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)}
            return {pid: got.get(pid) for pid in pids}
        return {pid: _host_pss(pid) for pid in pids}


def _host_pss(pid: int) -> int | None:
    """``Pss_Anon + Pss_Shmem`` of a process in bytes (None once it exited)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return sum(int(fields.get(name, "0 kB").split()[0]) * 1024 for name in ("Pss_Anon", "Pss_Shmem"))


class Run:
    """One run's checks, memory readings and figures, in the order they happened."""

    def __init__(self, backend: str, memory: DeviceMemory):
        self.backend, self.memory = backend, memory
        self.checks: list[dict] = []
        self.readings: list[dict] = []
        self.children: dict[str, Child] = {}
        self.figures: dict = {}
        self.imported: set[str] = set()  # "process: module" of vLLM or Ray, from every child's replies

    def check(self, step: str, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"step": step, "check": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def pids(self) -> list[int]:
        return [os.getpid(), *(c.pid for c in self.children.values() if c.proc.poll() is None)]

    def read(self, step: str, label: str) -> int:
        """Record the device's used memory and each live child's.  On CUDA, after half a second:
        NVML's figures trail a free or a process exit; a host reading (smaps_rollup) is exact
        once the child has replied or been reaped."""
        if self.backend == "cuda":
            time.sleep(0.5)
        pids = self.pids()
        per = self.memory.per_process(pids)
        names = {c.pid: n for n, c in self.children.items()}
        value = self.memory.used(pids)
        self.readings.append({"step": step, "label": label, "used_bytes": value,
                              "processes": {names.get(pid, "parent"): per[pid] for pid in pids}})
        return value

    def child(self, name: str, sock: Path, args) -> Child:
        c = self.children[name] = Child(name, sock, args, self.imported)
        return c

    def end_children(self) -> None:
        for c in self.children.values():
            try:
                c.end()
            except Exception:
                c.proc.kill()
        self.children.clear()


def step_driver(run: Run, key: str) -> None:
    """Device keys, the context probe and NVML, through the driver only (no torch CUDA)."""
    from vllm_dedup.segments import cudadrv, vmm

    step = "driver"
    probe = ContextProbe("cuda")
    keys: list[str] = []
    run.check(step, "naming every visible device leaves the context as it was and activates no primary context",
              probe.unchanged_after(lambda: keys.extend(cudadrv.device_key(i) for i in range(probe.count))),
              json.dumps(keys))
    run.check(step, "device keys are distinct and name the GPUs by UUID",
              len(set(keys)) == len(keys) and all(k.startswith("cuda:GPU-") for k in keys), json.dumps(keys))
    other = probe.count - 1
    ctx = cudadrv.call("cuDevicePrimaryCtxRetain", cudadrv.call("cuDeviceGet", other))
    changed = not probe.unchanged_after(lambda: cudadrv.call("cuCtxPushCurrent", ctx))
    cudadrv.call("cuCtxPopCurrent")
    cudadrv.call("cuDevicePrimaryCtxRelease", cudadrv.call("cuDeviceGet", other))
    run.check(step, "the probe notices a context made current", changed)
    cudadrv.memory_info(0)  # device 0's primary context exists (and stays) before the reading
    before = run.memory.used([os.getpid()])
    mapping, fd = vmm.allocate(0, 64 * MB)
    try:
        deadline = time.monotonic() + 2  # NVML's figures may trail an allocation as they trail a free
        while (grew := run.memory.used([os.getpid()]) - before) < 64 * MB and time.monotonic() < deadline:
            time.sleep(0.1)
        own = run.memory.per_process([os.getpid()])[os.getpid()]
        run.check(step, "NVML sees a 64 MiB allocation in the device's used memory, and only it",
                  64 * MB <= grew < 96 * MB, f"+{grew / MB:.1f} MiB")
        run.figures["driver"] = {"keys": keys, "allocation_seen_bytes": grew, "this_process_bytes": own}
    finally:
        os.close(fd)
        mapping.close()


def step_segments(run: Run, sock: Path, args, key: str | None) -> None:
    from vllm_dedup.registry.client import registry_stats

    step = "segments"
    run.read(step, "before")
    a = run.child("A", sock, args)
    before_create = run.read(step, "A started (context)")
    if key is not None:
        run.check(step, "the device key names the GPU NVML measures (found by UUID)", a.info.get("device") == key,
                  f"{a.info.get('device')} vs {key}")
    run.check(step, "naming every visible device leaves the context as it was and creates none",
              a.info.get("device_key_context_ok") is True, json.dumps(a.info))
    created = a.ask("create")
    after_create = run.read(step, "A created the segment")
    seg_size = created.get("size", 0)
    run.check(step, "A creates and publishes a pack", "fingerprint" in created, json.dumps(created))
    run.check(step, "creating leaves A's context as it was", created.get("context_ok") is True, json.dumps(created))
    run.check(step, "A's own mapping of the pack it published is read-only", created.get("read_only") is True,
              "driver refused read-only access" if created.get("read_only") is False else json.dumps(created))
    grew = {"A": after_create - before_create}
    for name in ("B", "C"):
        c = run.child(name, sock, args)
        started = run.read(step, f"{name} started (context)")
        mapped = c.ask("map")
        grew[name] = run.read(step, f"{name} mapped the segment") - started
        run.check(step, f"{name} maps the pack's first member and reads the same bytes",
                  mapped.get("fingerprint") == created.get("fingerprint"), json.dumps(mapped))
        if run.backend == "cuda":  # the driver maps no part of an imported allocation
            run.check(step, f"{name} maps the whole allocation", mapped.get("size") == seg_size,
                      f"{mapped.get('size')} of {seg_size} bytes")
        else:
            run.check(step, f"{name} maps less than the allocation (a pack mapped in part)",
                      0 < mapped.get("size", 0) < seg_size, f"{mapped.get('size')} of {seg_size} bytes")
        run.check(step, f"mapping leaves {name}'s context as it was", mapped.get("context_ok") is True,
                  json.dumps(mapped))
        run.check(step, f"{name}'s mapping is read-only", mapped.get("read_only") is True,
                  "driver refused read-only access" if mapped.get("read_only") is False else "")
    tolerance = max(seg_size // 20, 4 * MB)
    run.check(step, "used memory grows once per segment (creator)", abs(grew["A"] - seg_size) <= tolerance,
              f"A +{grew['A'] / MB:.1f} MiB for a {seg_size / MB:.1f} MiB segment")
    for name in ("B", "C"):
        run.check(step, f"used memory does not grow when {name} maps", grew[name] <= tolerance,
                  f"{name} +{grew[name] / MB:.1f} MiB")
    results = {n: run.children[n].ask("compute") for n in "ABC"}
    run.check(step, "A, B and C compute the same W @ x", len({r.get("result") for r in results.values()}) == 1,
              json.dumps(results))
    reference = results["A"].get("result")
    run.check(step, "A exits normally", a.end() == 0)
    run.read(step, "A exited")
    again = {n: run.children[n].ask("compute") for n in "BC"}
    run.check(step, "after A exits, B and C still compute the same result",
              all(r.get("result") == reference for r in again.values()), json.dumps(again))
    stats = registry_stats(sock)
    run.check(step, "the registry still holds the segment once", [g.segments for g in stats.groups] == [1],
              json.dumps(stats.to_dict()["groups"]))
    d = run.child("D", sock, args)
    mapped = d.ask("map")  # else the write below fails for want of a mapping, not by a fault
    run.check(step, "D maps the segment read-only and reads the same bytes",
              mapped.get("fingerprint") == created.get("fingerprint") and mapped.get("read_only") is True,
              json.dumps(mapped))
    wrote = d.ask("write")
    status = d.proc.poll()
    # A fault, not any error: the host's kills the writer (SIGSEGV); a GPU's is an illegal
    # address (a CUDA error the child reports, or a process that dies of it).
    if run.backend == "cuda":
        faulted = (bool(re.search(r"illegal (memory )?(access|address)|CUDA error", wrote.get("error", ""), re.I))
                   or (status is not None and status != 0))
    else:
        faulted = wrote.get("exit") == -signal.SIGSEGV
    after = run.children["B"].ask("compute")
    run.check(step, "a write through a read-only mapping faults", faulted, json.dumps(wrote))
    run.check(step, "the bytes are unchanged after the write attempt",
              after.get("fingerprint") == created.get("fingerprint"), json.dumps(after))
    d.end()
    tp = run.children["B"].ask("throughput", mb=args.throughput_mb)
    run.check(step, "throughput measured", "copy_gb_s" in tp, json.dumps(tp))
    run.figures["segment_bytes"] = seg_size
    run.figures["throughput"] = tp
    run.end_children()
    run.read(step, "all exited")
    _step_descriptor_only(run, sock.parent / "warm.sock", args, step, tolerance)


def _step_descriptor_only(run: Run, sock: Path, args, step: str, tolerance: int) -> None:
    """A segment whose creator has exited before anybody mapped it, held by the registry's
    descriptor alone (a registry with ``keep_warm_s``): a newcomer maps it and reads its bytes;
    once the registry lets go, the device has its memory back (CUDA: NVML's used memory).  The
    registry is a standalone daemon, a process that never loads the CUDA driver, as in
    production (DESIGN.md: the registry holds descriptors, never a context): this parent
    has a context by now, which would not show that a descriptor alone keeps the memory."""
    from harness.procs import reap
    from vllm_dedup.registry.client import registry_stats, shutdown_registry
    from vllm_dedup.registry.daemon import start_daemon

    start_daemon(sock, keep_warm_s=600, idle_exit_s=600, timeout_s=60)
    daemon = registry_stats(sock).registry_pid
    try:
        before = run.read(step, "a registry keeping unheld segments warm")
        e = run.child("E", sock, args)
        made = e.ask("create")
        run.check(step, "E exits normally after publishing", e.end() == 0, json.dumps(made))
        held = run.read(step, "E exited: its segment held by the registry's descriptor alone")
        f = run.child("F", sock, args)
        got = f.ask("map")
        run.check(step, "F maps a segment whose creator exited before anyone mapped it, and reads its bytes",
                  "fingerprint" in made and got.get("fingerprint") == made.get("fingerprint"), json.dumps(got))
        run.check(step, "F exits normally", f.end() == 0)
        maps = Path(f"/proc/{daemon}/maps").read_text()
        run.check(step, "the registry holding the descriptor never loaded the CUDA driver", "libcuda" not in maps,
                  "; ".join(sorted({line.split()[-1] for line in maps.splitlines() if "libcuda" in line})))
    finally:
        run.end_children()
        shutdown_registry(sock)
        reap([daemon], grace_s=30)  # its descriptor closed before the memory is read
    freed = run.read(step, "the registry let go of the segment")
    if run.backend == "cuda":  # a memfd's pages that no process maps are in nobody's PSS
        run.check(step, "the segment's memory stays while only the registry's descriptor holds it",
                  held - before >= made.get("size", 0) - tolerance, f"+{(held - before) / MB:.1f} MiB")
        run.check(step, "the device has the segment's memory back once the registry lets go",
                  abs(freed - before) <= tolerance, f"{(freed - before) / MB:+.1f} MiB against before")


def step_model(run: Run, sock: Path, args) -> None:
    from vllm_dedup.registry.client import registry_stats

    step = "model"
    # The loader's default on the host would leave a tiny model's tensors private: take them all.
    min_bytes = 65536 if args.model_size == "small" else 4096
    start = run.read(step, "before")
    m1 = run.child("M1", sock, args)
    started = run.read(step, "M1 started")
    built = m1.ask("build", min_tensor_bytes=min_bytes)
    shareable = built.get("shareable_bytes", 0)
    run.check(step, "M1 builds the model", shareable > 0, json.dumps(built))
    # Read after the first forward, whose cuBLAS workspace and kernels stay: the sharing alone
    # moves the next reading.
    private1 = m1.ask("logits")
    after_build = run.read(step, "M1 built the model and ran it (private)")
    published = m1.ask("share", min_tensor_bytes=min_bytes)
    after_share1 = run.read(step, "M1 shared (published)")
    run.check(step, "M1 publishes every shareable weight",
              published.get("published_bytes") == shareable and not published.get("errors"), json.dumps(published))
    shared1 = m1.ask("logits")
    run.check(step, "M1's logits through its segments equal its private ones (bit for bit)",
              shared1.get("equal_to_private") is True, json.dumps(shared1)[:400])
    m2 = run.child("M2", sock, args)
    started2 = run.read(step, "M2 started")
    m2.ask("build", min_tensor_bytes=min_bytes)
    private2 = m2.ask("logits")
    after_build2 = run.read(step, "M2 built the model and ran it (private)")
    run.check(step, "M2's private logits equal M1's (the same seeded model)",
              private2.get("fingerprint") == private1.get("fingerprint"), json.dumps(private2)[:400])
    mapped = m2.ask("share", min_tensor_bytes=min_bytes)
    after_share2 = run.read(step, "M2 shared (mapped from M1)")
    run.check(step, "M2 maps every shareable weight from M1's segments and publishes nothing",
              mapped.get("shared_bytes") == shareable and mapped.get("published_bytes") == 0
              and not mapped.get("errors"), json.dumps(mapped))
    shared2 = m2.ask("logits")
    run.check(step, "M2's logits through M1's segments equal its private ones and M1's (bit for bit)",
              shared2.get("equal_to_private") is True and shared2.get("fingerprint") == private1.get("fingerprint"),
              json.dumps(shared2)[:400])
    freed = after_build2 - after_share2
    # On a GPU the private copy goes back to the driver whole; on the host, glibc keeps a part of
    # the freed heap and the processes' PSS moves by a few MB meanwhile.
    enough = 0.9 if run.backend == "cuda" else 0.75
    run.check(step, "M2's private copy is given back once it maps M1's weights",
              freed >= enough * shareable, f"-{freed / MB:.1f} MiB for {shareable / MB:.1f} MiB mapped")
    run.check(step, "M1 exits normally", m1.end() == 0)
    run.read(step, "M1 exited")
    after_exit = m2.ask("logits")
    run.check(step, "after M1 exits, M2 computes the same logits", after_exit.get("equal_to_private") is True,
              json.dumps(after_exit)[:400])
    groups = registry_stats(sock).groups
    run.check(step, "the registry holds M1's segments once, M2 their only engine",
              len(groups) == 1 and groups[0].engines == 1 and groups[0].resident_bytes >= shareable,
              json.dumps([dataclasses.asdict(g) for g in groups]))
    run.figures["model"] = {"size": args.model_size, "bytes": built.get("bytes"), "shareable_bytes": shareable,
                            "published": published, "mapped": mapped, "next_tokens": private1.get("next_tokens"),
                            "growth": {"M1 start": started - start, "M1 build": after_build - started,
                                       "M1 share": after_share1 - after_build, "M2 start": started2 - after_share1,
                                       "M2 build": after_build2 - started2, "M2 share": after_share2 - after_build2}}
    run.end_children()
    run.read(step, "all exited")


def step_in_place(run: Run, sock: Path, args) -> None:
    """Publish in place (`engine.in_place_packed`): the first engine loads into packed segments
    of its own and publishes them with no copy, so its device memory is a private load's; the
    second maps them."""
    from vllm_dedup.registry.client import registry_stats

    step = "in_place"
    min_bytes = 65536 if args.model_size == "small" else 4096
    p1 = run.child("P1", sock, args)
    built = p1.ask("build", min_tensor_bytes=min_bytes)
    shareable = built.get("shareable_bytes", 0)
    private = p1.ask("logits")
    after_build = run.read(step, "P1 built the model (private)")
    placed = p1.ask("place", min_tensor_bytes=min_bytes)
    after_place = run.read(step, "P1 loaded in place")
    run.check(step, "P1 loads every shareable weight into its own segments",
              placed.get("placed_bytes") == shareable, json.dumps(placed))
    published = p1.ask("share", min_tensor_bytes=min_bytes)
    after_share = run.read(step, "P1 published where they lie")
    run.check(step, "P1 publishes every shareable weight where it lies (no copy)",
              published.get("published_bytes") == shareable and published.get("created_bytes") == 0
              and not published.get("errors"), json.dumps(published))
    shared = p1.ask("logits")
    run.check(step, "P1's logits through its own published segments equal its private ones (bit for bit)",
              shared.get("fingerprint") == private.get("fingerprint"), json.dumps(shared)[:400])
    growth = after_share - after_build
    padding = published.get("padding_bytes", 0)
    if run.backend == "cuda":  # the host's figure includes what glibc keeps of the freed heap
        run.check(step, "P1's device memory after publishing is its private load's (+ padding, + 5%)",
                  growth <= padding + 0.05 * shareable,
                  f"{growth / MB:+.1f} MiB for {shareable / MB:.1f} MiB ({padding / MB:.1f} MiB padding)")
    p2 = run.child("P2", sock, args)
    p2.ask("build", min_tensor_bytes=min_bytes)
    mapped = p2.ask("share", min_tensor_bytes=min_bytes)
    run.read(step, "P2 mapped P1's segments")
    run.check(step, "P2 maps every shareable weight from P1's segments",
              mapped.get("shared_bytes") == shareable and mapped.get("published_bytes") == 0, json.dumps(mapped))
    logits2 = p2.ask("logits")
    run.check(step, "P2's logits through P1's segments equal P1's private ones (bit for bit)",
              logits2.get("fingerprint") == private.get("fingerprint"), json.dumps(logits2)[:400])
    groups = registry_stats(sock).groups
    run.check(step, "the registry holds P1's segments once", len(groups) == 1 and groups[0].engines == 2,
              json.dumps([dataclasses.asdict(g) for g in groups]))
    run.figures["in_place"] = {"shareable_bytes": shareable, "placed": placed, "published": published,
                               "growth": {"P1 place": after_place - after_build, "P1 publish": after_share - after_place,
                                          "P1 load to published": growth}}
    run.end_children()
    run.read(step, "all exited")


def run_all(args) -> dict:
    from vllm_dedup.registry.server import RegistryServer
    from vllm_dedup.registry.state import Registry

    key = None
    if args.backend == "cuda":  # this process's device 0, named without creating a context
        from vllm_dedup.segments.cudadrv import device_key

        key = device_key(0)
    run = Run(args.backend, DeviceMemory(args.backend, key))
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        server = RegistryServer(Registry(), Path(tmp) / "run" / "registry.sock").start()
        try:
            for step in args.steps:
                began = time.perf_counter()
                try:
                    if step == "driver":
                        step_driver(run, key)
                    elif step == "segments":
                        step_segments(run, server.path, args, key)
                    elif step == "model":
                        step_model(run, server.path, args)
                    else:
                        step_in_place(run, server.path, args)
                except Exception as e:  # one step's crash is a failed check, the next step still runs
                    run.check(step, "the step ran to its end", False, f"{type(e).__name__}: {e}")
                finally:
                    run.end_children()
                seconds[step] = time.perf_counter() - began
        finally:
            server.stop()
    run.imported.update(f"parent: {m}" for m in forbidden_imports())
    run.check("all", "no process imported vLLM or Ray", not run.imported, json.dumps(sorted(run.imported)))
    from harness.machine import machine

    return {"backend": args.backend, "machine": machine(), "gpus": gpu_names() if args.backend == "cuda" else [],
            "steps": list(args.steps), "seconds": seconds, "checks": run.checks,
            "memory": run.readings, **run.figures, "passed": all(c["ok"] for c in run.checks)}


def gpu_names() -> list[str]:
    """``nvidia-smi``'s name, driver version and memory of each GPU, one line each (asked of
    another process: this one makes no CUDA context of its own, which would enter the memory
    figures); empty where it cannot say."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def report(result: dict) -> str:
    """The run as a plain-text table."""
    from harness.machine import describe

    lines = [describe(), *(f"GPU: {g}" for g in result.get("gpus", [])),
             f"backend: {result['backend']}; steps: {', '.join(result['steps'])}; "
             + ", ".join(f"{s} {t:.1f} s" for s, t in result["seconds"].items())]
    if result["memory"]:
        lines += ["", f"{'step':<10}{'reading':<32}{'used (MiB)':>12}{'change':>10}   per process (MiB)"]
        prev = result["memory"][0]["used_bytes"]
        for m in result["memory"]:
            per = ", ".join(f"{n} {'n/a' if v is None else f'{v / MB:.0f}'}" for n, v in m["processes"].items())
            lines.append(f"{m['step']:<10}{m['label']:<32}{m['used_bytes'] / MB:>12.1f}"
                         f"{(m['used_bytes'] - prev) / MB:>+10.1f}   {per}")
            prev = m["used_bytes"]
    lines.append("")
    for c in result["checks"]:
        lines.append(f"[{'PASS' if c['ok'] else 'FAIL'}] {c['step']}: {c['check']}"
                     + (f"  ({c['detail'][:200]})" if not c["ok"] else ""))
    tp = result.get("throughput") or {}
    if "copy_gb_s" in tp:
        lines += ["", f"{'operation':<44}{'GB/s':>8}"]
        for label, key in (("device fingerprint", "fingerprint_gb_s"), ("exact compare (reads both)", "compare_gb_s"),
                           ("device-to-device copy", "copy_gb_s")):
            lines.append(f"{label:<44}{tp[key]:>8.1f}")
        lines.append(f"fingerprint + compare of a {tp['model_bytes'] / 1e9:.2f} GB model: "
                     f"{tp['fingerprint_compare_s'] * 1e3:.1f} ms = {100 * tp['fingerprint_compare_share_of_load']:.2f}% "
                     f"of loading it from a safetensors file ({tp['load_s']:.2f} s)")
        if tp.get("fingerprint_peak_bytes") is not None:
            lines.append(f"temporaries of a {tp['tensor_bytes'] / MB:.0f} MiB tensor's fingerprint: "
                         f"{tp['fingerprint_peak_bytes'] / MB:.1f} MiB; of its compare: "
                         f"{tp['compare_peak_bytes'] / MB:.1f} MiB")
    model = result.get("model")
    if model:
        lines += ["", f"model ({model['size']}): {model['bytes'] / MB:.1f} MiB, {model['shareable_bytes'] / MB:.1f} MiB "
                      f"shareable; M1 published {model['published'].get('published_bytes', 0) / MB:.1f} MiB, M2 mapped "
                      f"{model['mapped'].get('shared_bytes', 0) / MB:.1f} MiB"]
        lines.append("used memory growth: " + ", ".join(f"{k} {v / MB:+.1f} MiB" for k, v in model["growth"].items()))
    in_place = result.get("in_place")
    if in_place:
        lines += ["", f"in place: {in_place['shareable_bytes'] / MB:.1f} MiB shareable, "
                      f"{in_place['published'].get('sealed_bytes', 0) / MB:.1f} MiB of segments published where they lie, "
                      f"{in_place['published'].get('created_bytes', 0) / MB:.1f} MiB copied"]
        lines.append("used memory growth: " + ", ".join(f"{k} {v / MB:+.1f} MiB" for k, v in in_place["growth"].items()))
    lines.append("")
    lines.append("PASSED" if result["passed"] else "FAILED")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                        help="directory for gpu_check-<backend>.json and .txt")
    parser.add_argument("--steps", default=None,
                        help="comma-separated: driver (CUDA only), segments, model; default: all of the backend's")
    parser.add_argument("--segment-mb", type=int, default=None, help="size of the shared weight (MiB)")
    parser.add_argument("--throughput-mb", type=int, default=None, help="size of the throughput tensor (MiB)")
    parser.add_argument("--model-size", choices=tuple(MODEL_SIZES), default=None)
    parser.add_argument("--json", action="store_true", help="also print the JSON result as the last line")
    parser.add_argument("--child", metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    gpu = args.backend == "cuda"
    args.segment_mb = args.segment_mb or (1024 if gpu else 32)
    args.throughput_mb = args.throughput_mb or (2048 if gpu else 64)
    args.model_size = args.model_size or ("small" if gpu else "tiny")
    if args.child:
        child(args.child, args.backend, args.segment_mb, args.model_size)
        return 0
    steps = tuple(s.strip() for s in args.steps.split(",")) if args.steps else STEPS[args.backend]
    unknown = [s for s in steps if s not in STEPS[args.backend]]
    if unknown:
        parser.error(f"unknown step(s) for backend {args.backend}: {', '.join(unknown)} "
                     f"(it has {', '.join(STEPS[args.backend])})")
    args.steps = steps
    result = run_all(args)
    text = report(result)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu_check-{args.backend}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"gpu_check-{args.backend}.txt").write_text(text + "\n")
    print(f"wrote {args.out / f'gpu_check-{args.backend}.json'} and .txt", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
