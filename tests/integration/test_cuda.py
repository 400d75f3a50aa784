"""The CUDA segment path.  On a machine with a GPU these run `benchmarks/gpu_check.py` with the
CUDA backend (marked ``cuda``; skipped without one); everywhere, the same script runs on host
segments, and a CUDA segment on a machine without a usable driver fails with a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
HAS_CUDA = torch.cuda.is_available()


def run_check(backend: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backend", backend, "--json", *args],
                          capture_output=True, text=True, timeout=600)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = [c for c in result["checks"] if not c["ok"]]
    assert proc.returncode == 0 and not failed, f"{failed}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return result


def test_gpu_check_protocol_on_host_segments():
    result = run_check("host", "--segment-mb", "32", "--throughput-mb", "64")
    names = {c["check"] for c in result["checks"]}
    assert {"used memory does not grow when C maps", "a write through a read-only mapping faults",
            "after A exits, B and C still compute the same result"} <= names
    assert result["throughput"]["fingerprint_gb_s"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_check_on_cuda():
    result = run_check("cuda")
    assert result["segment_bytes"] % (2 << 20) == 0


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_fingerprint_equals_for_equal_bytes_and_packs_round_to_granularity():
    from vllm_dedup.content.fingerprint import device_fingerprints
    from vllm_dedup.segments.cuda import CudaSegment

    w = torch.randn(1000, 1000, device="cuda").to(torch.bfloat16)
    assert device_fingerprints([w])[0] == device_fingerprints([w.clone()])[0]
    gran = CudaSegment.granularity(w.device)
    seg = CudaSegment.create_packed([(w, 0), (w, 2 << 20)], (2 << 20) + w.numel() * 2, None)
    assert seg.size % gran == 0 and seg.device.startswith("cuda:GPU-")
    assert torch.equal(seg.tensor(2 << 20, w.dtype, w.shape, w.stride()), w)


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on machines without CUDA")
def test_cuda_segment_without_a_driver_says_what_is_missing():
    from vllm_dedup.segments.cuda import CudaError, CudaSegment

    with pytest.raises(CudaError, match="CUDA driver is not usable here"):
        CudaSegment.device_key(0)
