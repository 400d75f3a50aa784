"""An engine-like process that shares a small model through a registry with `share_model`
(for tests/integration/test_share.py).

    python tests/peers/share_peer.py SOCKET VARIANT PACK_GRANULARITY [fail]

Builds the test model (VARIANT ``base``, ``tuned``: mid1 differs, or ``retuned``: mid1 and
small0 differ), shares it with
segments packed to PACK_GRANULARITY bytes, prints ``OK {result, digests}``, then answers each
line read from stdin with ``OK {digests}`` (XXH3-128 of every parameter's bytes, read through
whatever memory now backs it) until stdin closes.  With ``fail`` it shares as
``on_registry_error="fail"`` does, and prints ``ERR {type, error}`` if sharing raises.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import xxhash
from torch import nn

from vllm_dedup.config import DedupConfig
from vllm_dedup.content.views import tensor_bytes
from vllm_dedup.engine.context import LoadContext
from vllm_dedup.engine.share import share_model
from vllm_dedup.registry.client import RegistryClient
from vllm_dedup.registry.lease import Lease

# name -> bytes (bfloat16: 2 bytes per element)
SIZES = {"big0": 1536 << 10, "big1": 1536 << 10, "mid0": 300 << 10, "mid1": 300 << 10, "mid2": 300 << 10,
         "small0": 100 << 10, "small1": 100 << 10}


def build(variant: str) -> nn.Module:
    model = nn.Module()
    for i, (name, nbytes) in enumerate(SIZES.items()):
        changed = {"base": (), "tuned": ("mid1",), "retuned": ("mid1", "small0")}[variant]
        gen = torch.Generator().manual_seed(i + (1000 if name in changed else 0))
        model.register_parameter(name, nn.Parameter(torch.randn(nbytes // 2, generator=gen).to(torch.bfloat16),
                                                    requires_grad=False))
    return model


def digests(model: nn.Module) -> dict[str, str]:
    return {n: xxhash.xxh3_128_hexdigest(tensor_bytes(p.data)) for n, p in model.named_parameters()}


def main() -> None:
    sock, variant, granularity = sys.argv[1], sys.argv[2], int(sys.argv[3])
    fail = sys.argv[4:] == ["fail"]
    lease = Lease(RegistryClient(sock), f"test-{variant}", "cpu", "default", variant)
    model = build(variant)
    expected = digests(model)
    config = DedupConfig(min_tensor_bytes=1, on_registry_error="fail" if fail else "fallback")
    try:
        result = share_model(model, LoadContext(config, lease, torch.device("cpu"), "cpu"),
                             pack_granularity=granularity)
    except Exception as e:
        print("ERR " + json.dumps({"type": type(e).__name__, "error": str(e)}), flush=True)
        return
    result.placement = {}
    print("OK " + json.dumps({"result": dataclasses.asdict(result), "expected": expected,
                              "digests": digests(model)}), flush=True)
    for _ in sys.stdin:
        print("OK " + json.dumps({"digests": digests(model)}), flush=True)
    lease.close()


if __name__ == "__main__":
    main()
