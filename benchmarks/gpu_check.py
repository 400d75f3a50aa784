"""Every check of the CUDA segment path in one run: real processes, a real broker, no Ray, no vLLM.

    python benchmarks/gpu_check.py                   # CUDA (a GPU, cuda-bindings, nvidia-ml-py)
    python benchmarks/gpu_check.py --backend host    # the same protocol on memfd segments (CI)

The registry runs in this process behind its Unix socket (`BrokerServer`), as on a machine
without Ray; each engine is a child process (``--child``) driven over stdin/stdout.  Steps:

1. ``A`` creates one pack: a seeded bfloat16 weight of ``--segment-mb`` and, in the granule
   after it, a second 1 MiB member; publishes both;
2. ``B`` then ``C`` map only the weight (a mapping smaller than the allocation); each step's
   device used memory is read with NVML, on the device NVML finds by the device key's UUID
   (``GPU-`` or ``MIG-``: ``CUDA_VISIBLE_DEVICES`` and MIG cannot point it at another device;
   host: the kernel's ``Shmem`` figure, where memfd pages count), so growth once per segment
   rather than once per process shows.  Each child's CUDA context is created before the step is
   measured; naming every visible device, creating and mapping must leave the child's current
   context as it was and create no context on another GPU;
3. A, B, C compute ``W @ x`` through their own mapping and compare results;
4. ``A`` exits; B and C compute again and must get the same result;
5. ``D`` maps the segment and writes into it in place: the write must fault (or the driver
   refuses read-only mappings, which the table then says); B re-reads the bytes, unchanged;
6. throughput on the device: the device fingerprint and the exact compare, next to a
   device-to-device copy of the same tensor, in GB/s; and the fingerprint + compare time of a
   whole synthetic model next to loading it from a safetensors file onto the device.

Prints a table; writes ``benchmarks/results/gpu_check-<backend>.json`` (``--json``: also the
JSON object as the last stdout line).  Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/ and a bare checkout's vllm_dedup (the lent GPU machines)

RESULTS = ROOT / "benchmarks" / "results"
KEY, EXTRA = "gpu-check-weight", "gpu-check-extra"  # the pack's two members; children map only KEY
MB = 1 << 20


# child ---------------------------------------------------------------------------------------
def child(sock: str, backend: str, segment_mb: int) -> None:
    """An engine: answers one JSON command per stdin line with one ``OK``/``ERR`` JSON line."""
    import torch

    from vllm_dedup.content.fingerprint import device_fingerprints
    from vllm_dedup.registry.client import BrokerClient
    from vllm_dedup.segments import segment_class

    device = torch.device("cuda", 0) if backend == "cuda" else torch.device("cpu")
    if backend == "cuda":
        torch.ones(1, device=device)  # the CUDA context exists before the parent measures
        torch.cuda.synchronize()
    seg_cls = segment_class(device.type)
    contexts = ContextProbe(backend)
    device_key = seg_cls.device_key(device)
    keys_ok = contexts.unchanged_after(lambda: [seg_cls.device_key(i) for i in range(contexts.count)])
    client = BrokerClient(sock)
    client.hello(f"gpu-check-{os.getpid()}", device_key, "default")
    state: dict = {}
    rows = segment_mb * MB // 2 // 4096

    def reply(obj: dict) -> None:
        print("OK " + json.dumps(obj), flush=True)

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
                seg = None

                def create():
                    nonlocal seg
                    seg = seg_cls.create_packed([(weight, 0), (extra, offset)], offset + MB, device_key)

                ctx_ok = contexts.unchanged_after(create)
                client.publish(seg.fileno(), seg.size, [(KEY, 0, wbytes), (EXTRA, offset, MB)])
                seg.close_fd()
                state["w"] = seg.tensor(0, weight.dtype, weight.shape, weight.stride())
                fingerprint = device_fingerprints([weight])[0].hex()
                del weight, extra
                if backend == "cuda":
                    torch.cuda.empty_cache()
                reply({"fingerprint": fingerprint, "size": seg.size, "read_only": getattr(seg, "read_only", True),
                       "context_ok": ctx_ok})
            elif op == "map":
                (found,) = client.acquire([KEY])  # the pack's first member only
                (hit,), fd = found.hits, found.fd
                seg = None

                def attach():
                    nonlocal seg
                    seg = seg_cls.attach(fd, hit.offset + hit.nbytes, device_key)

                ctx_ok = contexts.unchanged_after(attach)
                seg.close_fd()
                state["w"] = seg.tensor(hit.offset, torch.bfloat16, (rows, 4096), (4096, 1))
                reply({"fingerprint": device_fingerprints([state["w"]])[0].hex(), "size": seg.size,
                       "read_only": getattr(seg, "read_only", True), "context_ok": ctx_ok})
            elif op == "compute":
                x = torch.randn(4096, 8, generator=torch.Generator(device=device).manual_seed(1), device=device)
                y = state["w"].float() @ x
                reply({"result": device_fingerprints([y])[0].hex(), "fingerprint":
                       device_fingerprints([state["w"]])[0].hex()})
            elif op == "write":
                print("WRITING", flush=True)
                state["w"].add_(1)  # must fault: the mapping is read-only
                if backend == "cuda":
                    torch.cuda.synchronize()
                reply({"wrote": True})
            elif op == "throughput":
                reply(throughput(device, int(cmd["mb"])))
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # reported to the parent, which decides what it means
            print("ERR " + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    client.close()


class ContextProbe:
    """Whether an operation leaves this thread's CUDA context and torch's current device as they
    were and makes no other GPU's primary context active (``cuCtxGetCurrent``,
    ``cuDevicePrimaryCtxGetState``).  On host segments there is nothing to check."""

    def __init__(self, backend: str):
        from vllm_dedup.segments import cudadrv

        self.cuda = backend == "cuda"
        self.count = cudadrv.device_count() if self.cuda else 0

    def _state(self) -> tuple:
        import torch

        from vllm_dedup.segments.cudadrv import call

        active = [i for i in range(self.count) if call("cuDevicePrimaryCtxGetState", call("cuDeviceGet", i))[1]]
        return int(call("cuCtxGetCurrent")), torch.cuda.current_device(), active

    def unchanged_after(self, fn) -> bool:
        """Run ``fn()``; True when the context state is the same afterwards."""
        before = self._state() if self.cuda else None
        fn()
        return not self.cuda or self._state() == before


def _timed(fn, device, repeat: int = 5) -> float:
    """Median seconds of ``fn()`` on ``device`` (synchronised)."""
    import torch

    times = []
    for _ in range(repeat + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]  # the first run warms up


def throughput(device, mb: int) -> dict:
    """GB/s of fingerprint, exact compare and copy on one ``mb`` tensor; and fingerprint +
    compare of a synthetic model (``mb`` in 64 MiB tensors) next to loading it from a
    safetensors file onto ``device``."""
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_dedup.content.fingerprint import device_fingerprints, same_bytes

    n = mb * MB // 2
    a = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
    b = a.clone()
    gb = n * 2 / 1e9
    out = {
        "tensor_bytes": n * 2,
        "fingerprint_gb_s": gb / _timed(lambda: device_fingerprints([a]), device),
        "compare_gb_s": gb / _timed(lambda: same_bytes(a, b), device),  # GB of one tensor; reads both
        "copy_gb_s": gb / _timed(lambda: b.copy_(a), device),  # GB copied: one read, one write
    }
    del a, b
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_file({f"w{i}": torch.randn(32 * MB, dtype=torch.float32).to(torch.bfloat16) for i in range(mb // 64)},
                  path)
        # On the host, safetensors only maps the file; a loader then copies into its own tensors.
        load = ((lambda: load_file(path, device=str(device))) if device.type == "cuda"
                else (lambda: [t.clone() for t in load_file(path).values()]))
        load_s = _timed(load, device, repeat=3)
        tensors = list(load_file(path, device=str(device)).values())
        copies = [t.clone() for t in tensors]
        fp_cmp_s = _timed(lambda: (device_fingerprints(tensors), [same_bytes(t, c) for t, c in zip(tensors, copies)]),
                          device, repeat=3)
    out.update(model_bytes=sum(t.numel() * 2 for t in tensors), load_s=load_s, fingerprint_compare_s=fp_cmp_s,
               fingerprint_compare_share_of_load=fp_cmp_s / load_s)
    return out


# parent ------------------------------------------------------------------------------------
class Child:
    """An engine child (``--child``) with its protocol: one JSON command per line, one ``OK``
    or ``ERR`` JSON reply."""

    def __init__(self, name: str, sock: Path, backend: str, segment_mb: int):
        from harness.procs import PeerProcess

        self.name = name
        self.peer = PeerProcess([__file__, "--child", sock, "--backend", backend, "--segment-mb", segment_mb], name)
        self.proc = self.peer.proc
        self.info = self._read()

    def _read(self, timeout_s: float = 300) -> dict:
        from harness.procs import ChildExited

        try:
            return self.peer.read_json(("OK ", "ERR "), timeout_s)
        except ChildExited as e:  # e.g. killed by the fault of a write through a read-only mapping
            return {"error": f"exited with status {e.returncode}", "exit": e.returncode}

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


def used_memory(backend: str, key: str | None):
    """A function returning the device's used memory in bytes: NVML for CUDA (the device named
    by ``key``), the kernel's ``Shmem`` (memfd pages) for host segments."""
    if backend == "cuda":
        import pynvml

        handle = nvml_handle(key)
        return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used

    def shmem() -> int:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no Shmem in /proc/meminfo")

    return shmem


def settle(measure, wait_s: float = 0.5) -> int:
    time.sleep(wait_s)
    return measure()


def run(backend: str, segment_mb: int, throughput_mb: int) -> dict:
    from vllm_dedup.registry.client import registry_stats
    from vllm_dedup.registry.server import BrokerServer
    from vllm_dedup.registry.state import Registry

    key = None
    if backend == "cuda":  # this process's device 0, named without creating a context
        from vllm_dedup.segments.cudadrv import device_key

        key = device_key(0)
    measure = used_memory(backend, key)
    checks: list[dict] = []
    memory: list[dict] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks.append({"check": name, "ok": bool(ok), "detail": detail})

    def mem(step: str) -> int:
        value = settle(measure)
        memory.append({"step": step, "used_bytes": value})
        return value

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        server = BrokerServer(Registry(), Path(tmp) / "run" / "broker.sock").start()
        children: dict[str, Child] = {}
        try:
            base = mem("before")
            children["A"] = a = Child("A", server.path, backend, segment_mb)
            before_create = mem("A started (context)")
            if backend == "cuda":
                check("the device key names the GPU NVML measures (found by UUID)", a.info.get("device") == key,
                      f"{a.info.get('device')} vs {key}")
            check("naming every visible device leaves the context as it was and creates none",
                  a.info.get("device_key_context_ok") is True, json.dumps(a.info))
            created = a.ask("create")
            after_create = mem("A created the segment")
            seg_size = created.get("size", 0)
            check("A creates and publishes a pack", "fingerprint" in created, json.dumps(created))
            check("creating leaves A's context as it was", created.get("context_ok") is True, json.dumps(created))
            grew = {"A": after_create - before_create}
            for name in ("B", "C"):
                children[name] = c = Child(name, server.path, backend, segment_mb)
                started = mem(f"{name} started (context)")
                mapped = c.ask("map")
                grew[name] = mem(f"{name} mapped the segment") - started
                check(f"{name} maps the pack's first member and reads the same bytes",
                      mapped.get("fingerprint") == created.get("fingerprint"), json.dumps(mapped))
                check(f"{name} maps less than the allocation (a pack mapped in part)",
                      0 < mapped.get("size", 0) < seg_size, f"{mapped.get('size')} of {seg_size} bytes")
                check(f"mapping leaves {name}'s context as it was", mapped.get("context_ok") is True,
                      json.dumps(mapped))
                check(f"{name}'s mapping is read-only", mapped.get("read_only") is True,
                      "driver refused read-only access" if mapped.get("read_only") is False else "")
            tolerance = max(seg_size // 20, 4 * MB)
            check("used memory grows once per segment (creator)", abs(grew["A"] - seg_size) <= tolerance,
                  f"A +{grew['A'] / MB:.1f} MiB for a {seg_size / MB:.1f} MiB segment")
            for name in ("B", "C"):
                check(f"used memory does not grow when {name} maps", grew[name] <= tolerance,
                      f"{name} +{grew[name] / MB:.1f} MiB")
            results = {n: children[n].ask("compute") for n in "ABC"}
            check("A, B and C compute the same W @ x", len({r.get("result") for r in results.values()}) == 1,
                  json.dumps(results))
            reference = results["A"].get("result")
            check("A exits normally", a.end() == 0)
            mem("A exited")
            again = {n: children[n].ask("compute") for n in "BC"}
            check("after A exits, B and C still compute the same result",
                  all(r.get("result") == reference for r in again.values()), json.dumps(again))
            stats = registry_stats(server.path)
            check("the registry still holds the segment once", [g.segments for g in stats.groups] == [1],
                  json.dumps(stats.to_dict()["groups"]))
            children["D"] = d = Child("D", server.path, backend, segment_mb)
            d.ask("map")
            wrote = d.ask("write")
            status = d.proc.poll()
            faulted = "error" in wrote or (status is not None and status != 0)
            after = children["B"].ask("compute")
            check("a write through a read-only mapping faults", faulted, json.dumps(wrote))
            check("the bytes are unchanged after the write attempt",
                  after.get("fingerprint") == created.get("fingerprint"), json.dumps(after))
            d.end()
            tp = children["B"].ask("throughput", mb=throughput_mb)
            check("throughput measured", "copy_gb_s" in tp, json.dumps(tp))
        finally:
            for c in children.values():
                try:
                    c.end()
                except Exception:
                    c.proc.kill()
            server.stop()
        mem("all exited")
    return {"backend": backend, "segment_bytes": seg_size, "baseline_used_bytes": base, "memory": memory,
            "checks": checks, "throughput": tp, "passed": all(c["ok"] for c in checks)}


def print_report(result: dict) -> None:
    print(f"backend: {result['backend']}; segment: {result['segment_bytes'] / MB:.1f} MiB")
    print(f"{'step':<28}{'used (MiB)':>12}{'change':>10}")
    prev = result["baseline_used_bytes"]
    for m in result["memory"]:
        print(f"{m['step']:<28}{m['used_bytes'] / MB:>12.1f}{(m['used_bytes'] - prev) / MB:>+10.1f}")
        prev = m["used_bytes"]
    print()
    for c in result["checks"]:
        print(f"[{'PASS' if c['ok'] else 'FAIL'}] {c['check']}" + (f"  ({c['detail'][:160]})" if not c["ok"] else ""))
    tp = result.get("throughput") or {}
    if "copy_gb_s" in tp:
        print()
        print(f"{'operation':<44}{'GB/s':>8}")
        for label, key in (("device fingerprint", "fingerprint_gb_s"), ("exact compare (reads both)", "compare_gb_s"),
                           ("device-to-device copy", "copy_gb_s")):
            print(f"{label:<44}{tp[key]:>8.1f}")
        print(f"fingerprint + compare of a {tp['model_bytes'] / 1e9:.2f} GB model: {tp['fingerprint_compare_s'] * 1e3:.1f} ms"
              f" = {100 * tp['fingerprint_compare_share_of_load']:.2f}% of loading it from a safetensors file "
              f"({tp['load_s']:.2f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--segment-mb", type=int, default=1024, help="size of the shared weight (MiB)")
    parser.add_argument("--throughput-mb", type=int, default=2048, help="size of the throughput tensor (MiB)")
    parser.add_argument("--json", action="store_true", help="also print the JSON result as the last line")
    parser.add_argument("--child", metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.backend, args.segment_mb)
        return 0
    result = run(args.backend, args.segment_mb, args.throughput_mb)
    print_report(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"gpu_check-{args.backend}.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
