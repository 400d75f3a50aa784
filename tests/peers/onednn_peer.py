"""A process holding one of vLLM's oneDNN handlers, whose packed weight it shares or maps (for
tests/integration/test_onednn_packed.py).

    python tests/peers/onednn_peer.py N K SEED

Builds the handler of a seeded bf16 N x K weight (``ops.create_onednn_mm``), prints
``OK {"nbytes", "tag"}``, then answers one JSON request per stdin line:

- ``{"publish": true}``: its packed bytes into a sealed memfd, mapped read-only in place of the
  private copy; ``OK {"fd": n}`` (the descriptor stays open: a peer opens /proc/PID/fd/n);
- ``{"attach": [pid, fd]}``: map that peer's segment in place of its own copy, after an exact
  compare; ``OK {"freed": bytes}``;
- ``{"run": true}``: ``OK {"digest"}``: XXH3-128 of ``onednn_mm`` on seeded inputs (M = 1 and 7);
- ``{"memory": true}``: ``OK {"segment_rss", "segment_pss", "private"}`` from /proc/self/smaps
  (the ``vllm-dedup`` memfd mappings, and the process's private bytes);
- ``{"write": true}``: writes one byte into the packed weight (a shared one must fault).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import torch
import xxhash
from vllm import _custom_ops as ops

from vllm_dedup.engine import heap, onednn
from vllm_dedup.segments.host import SEGMENT_MEMFD_NAME, HostSegment


def _memory() -> dict:
    rss = pss = private = 0
    in_segment = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                in_segment = line.rstrip().endswith(f"/memfd:{SEGMENT_MEMFD_NAME} (deleted)")
                continue
            if head[0] in ("Private_Clean:", "Private_Dirty:"):
                private += int(head[1]) << 10
            if in_segment and head[0] == "Rss:":
                rss += int(head[1]) << 10
            if in_segment and head[0] == "Pss:":
                pss += int(head[1]) << 10
    return {"segment_rss": rss, "segment_pss": pss, "private": private}


def main() -> None:
    n, k, seed = (int(a) for a in sys.argv[1:4])
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    handler = ops.create_onednn_mm(weight.t(), 32)
    del weight
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16)
    packed = onednn.find_packed(handler)
    print("OK " + json.dumps({"nbytes": packed.nbytes, "tag": packed.layout.tag}), flush=True)
    keep = []
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("publish"):
            seg = HostSegment.create_packed([(torch.frombuffer(bytearray(packed.view()), dtype=torch.uint8), 0)],
                                            packed.nbytes)
            onednn.install(packed, seg.tensor(0, torch.uint8, (packed.nbytes,), (1,)))
            heap.trim()
            keep.append(seg)
            reply = {"fd": seg.fileno()}
        elif "attach" in req:
            pid, fd = req["attach"]
            seg = HostSegment.attach(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC), packed.nbytes)
            seg.close_fd()
            freed = onednn.install(packed, seg.tensor(0, torch.uint8, (packed.nbytes,), (1,)))
            heap.trim()
            reply = {"freed": freed}
        elif req.get("run"):
            out = torch.cat([ops.onednn_mm(handler, x[:m], None).reshape(-1) for m in (1, 7)])
            reply = {"digest": xxhash.xxh3_128_hexdigest(out.view(torch.int16).numpy().tobytes())}
        elif req.get("memory"):
            reply = _memory()
        elif req.get("write"):
            address = onednn.find_packed(handler).address
            ctypes.memset(address, 1, 1)
            reply = {"wrote": True}
        else:
            reply = {"error": f"unknown request {req}"}
        print("OK " + json.dumps(reply), flush=True)
        packed = onednn.find_packed(handler)


if __name__ == "__main__":
    main()
