"""Whether vLLM packs linear weights here, and whether packed weights can be shared here."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ...errors import PackedWeightError, kept_unless_passing, out_of_descriptors_or_memory
from .handler import find_packed, install
from .layout import check_packing
from .library import library

__all__ = ["Support", "probe", "vllm_packs"]


@dataclass(frozen=True)
class Support:
    """`probe`'s answer: ``supported``, else ``reason`` says why not (one line); ``passing``:
    the reason may pass (this process was out of descriptors or memory), so it is not kept."""

    supported: bool
    reason: str = ""
    details: dict = field(default_factory=dict)
    passing: bool = False


def _on_the_cpu(probe_fn):
    """``probe_fn`` run with the CPU as torch's default device.

    Note [probes under a device context]
        The loader may first ask while a model is made on the meta device (a replay's
        ``create_model`` runs under ``torch.device("meta")``).  Tensors made there without a
        device, a probe's own and those vLLM makes inside ``create_onednn_mm``, are meta
        tensors: oneDNN then read a null data pointer, and a float32 router gate asked about
        first there crashed the engine in oneDNN's reorder (SIGSEGV).  An inner device
        context wins over an outer one, so each probe runs under ``torch.device("cpu")``.
    """

    @functools.wraps(probe_fn)
    def run(*args, **kwargs):
        import torch

        with torch.device("cpu"):
            return probe_fn(*args, **kwargs)

    return run


def vllm_packs(dtype_name: str = "bfloat16") -> bool:
    """Whether vLLM's CPU backend packs linear weights of this dtype for oneDNN here: its
    ``create_onednn_mm`` makes a handler (``dispatch_cpu_unquantized_gemm`` falls back to
    ``F.linear`` when it raises, e.g. for bfloat16 on AVX2).  Asks on the CPU whatever the
    caller's default device (Note [probes under a device context]).  An answer is kept for the
    process, except a "no" of a process out of descriptors or memory, asked again next time
    (vLLM asks each layer afresh)."""
    return _vllm_packs(dtype_name)[0]


@kept_unless_passing(lambda answer: answer[1])
@_on_the_cpu
def _vllm_packs(dtype_name: str) -> tuple[bool, bool]:
    """`vllm_packs`' question: ``(packs, the answer may pass)``."""
    try:
        import torch
        from vllm import _custom_ops as ops

        if not ops._supports_onednn:
            return False, False
        ops.create_onednn_mm(torch.zeros(64, 32, dtype=getattr(torch, dtype_name)).t(), 32)
        return True, False
    except Exception as e:  # vLLM's own test: any failure means F.linear
        return False, out_of_descriptors_or_memory(e)


@kept_unless_passing(lambda support: support.passing)
@_on_the_cpu
def probe(dtype_name: str = "bfloat16") -> Support:
    """Whether packed weights can be shared here, for linear layers of this dtype: this
    process's vLLM extension is found with its symbol table, and a small handler passes the
    whole cycle (find, check every element, put a sealed memfd's mapping in place, bit-identical
    ``onednn_mm`` results before and after, destroy).  Takes milliseconds; runs on the CPU
    whatever the caller's default device (Note [probes under a device context]).  Call it where
    the loader chooses between packed sharing and ``F.linear`` (model creation).  An answer is
    kept for the process, except one that may pass (``Support.passing``: out of descriptors
    or memory), which the next call asks again.

    Returns:
        `Support`: ``supported``, or the reason why not (one line, for the log).
    """
    try:
        import torch
        from vllm import _custom_ops as ops

        from ...segments.host import HostSegment

        lib = library()
        dtype = getattr(torch, dtype_name)
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(96, 320, generator=generator).to(dtype)  # N=96, K=320: padded on some ISAs
        handler = ops.create_onednn_mm(weight.t(), 32)
        packed = find_packed(handler)
        check_packing(packed, weight.t(), sample=None)
        x = torch.randn(5, 320, generator=generator).to(dtype)
        before = [ops.onednn_mm(handler, x[:m], None) for m in (1, 5)]
        segment = HostSegment.create_packed([(torch.frombuffer(bytearray(packed.view()), dtype=torch.uint8), 0)],
                                            packed.nbytes)
        segment.close_fd()
        install(packed, segment.tensor(0, torch.uint8, (packed.nbytes,), (1,)))
        after = [ops.onednn_mm(handler, x[:m], None) for m in (1, 5)]
        if not all(torch.equal(a, b) for a, b in zip(before, after)):
            return Support(False, "oneDNN's results changed after the packed weight moved to a segment")
        del handler, packed
        return Support(True, details={"library": lib.name, "onednn": lib.onednn, "isa": hex(lib.isa),
                                      "vllm": lib.vllm})
    except PackedWeightError as e:
        return Support(False, str(e), passing=out_of_descriptors_or_memory(e))
    except Exception as e:  # anything else from vLLM or oneDNN: not supported, say what
        return Support(False, f"{type(e).__name__}: {e}", passing=out_of_descriptors_or_memory(e))
