"""The GPU proof, `benchmarks/gpu_check.py`, in every form that runs without a GPU: its
``segments`` and ``model`` steps on host segments, and its ``driver`` step (device keys, the
context probe, NVML) against the CUDA driver model (tests/cuda_model: NVIDIA's documented
contract over host memory, NOT a GPU).  On a machine with a GPU the whole script runs on CUDA
(marked ``cuda``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cuda_model

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
HAS_CUDA = torch.cuda.is_available()


# Its `sitecustomize` makes the packages the lent GPU machines lack unimportable (vLLM, Ray,
# blake3, gguf), in the script and in every child it starts: the script must run there.
DEVICE_IMAGE = Path(__file__).resolve().parents[1] / "device_image"


def run_check(tmp_path: Path, backend: str, *args: str, env: dict | None = None) -> dict:
    import os

    out = tmp_path / "out"
    path = os.pathsep.join(p for p in (str(DEVICE_IMAGE), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backend", backend, "--out", str(out), "--json", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {}), "PYTHONPATH": path})
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = [c for c in result["checks"] if not c["ok"]]
    assert proc.returncode == 0 and not failed, f"{failed}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert json.loads((out / f"gpu_check-{backend}.json").read_text()) == result
    assert (out / f"gpu_check-{backend}.txt").read_text().rstrip().endswith("PASSED")
    return result


@pytest.mark.parametrize("package", ["vllm", "ray", "blake3", "gguf"])
def test_the_device_image_stand_in_refuses_what_the_gpu_machines_lack(package):
    """Without this, `run_check` would pass where the GPU machine fails."""
    import os

    proc = subprocess.run([sys.executable, "-c", f"import {package}"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(DEVICE_IMAGE)})
    assert proc.returncode == 1 and "not on the GPU machines' image" in proc.stderr, proc.stderr


@pytest.mark.slow  # the whole script: seven child processes, each importing torch (about 25 s)
def test_gpu_check_segments_and_model_steps_on_host_segments(tmp_path):
    result = run_check(tmp_path, "host")
    names = {(c["step"], c["check"]) for c in result["checks"]}
    assert {("segments", "used memory does not grow when C maps"),
            ("segments", "a write through a read-only mapping faults"),
            ("segments", "after A exits, B and C still compute the same result"),
            ("segments", "F maps a segment whose creator exited before anyone mapped it, and reads its bytes"),
            ("segments", "the registry holding the descriptor never loaded the CUDA driver"),
            ("model", "M2 maps every shareable weight from M1's segments and publishes nothing"),
            ("model", "M2's logits through M1's segments equal its private ones and M1's (bit for bit)"),
            ("model", "after M1 exits, M2 computes the same logits"),
            ("in_place", "P1 publishes every shareable weight where it lies (no copy)"),
            ("in_place", "P2's logits through P1's segments equal P1's private ones (bit for bit)"),
            ("all", "no process imported vLLM or Ray")} <= names
    assert result["throughput"]["fingerprint_gb_s"] > 0
    model = result["model"]
    assert model["mapped"]["shared_bytes"] == model["shareable_bytes"] > 30 * (1 << 20)
    in_place = result["in_place"]
    assert in_place["published"]["created_bytes"] == 0 and in_place["published"]["sealed_bytes"] > 0
    processes = {name for m in result["memory"] for name in m["processes"]}
    assert {"parent", "A", "B", "C", "M1", "M2", "P1", "P2"} <= processes


@pytest.mark.parametrize("mig", [False, True], ids=["gpu", "mig"])
def test_gpu_check_driver_step_against_the_driver_model(tmp_path, model_lib, mig):
    """Device keys, the context probe (``cuDevicePrimaryCtxGetState``) and NVML by UUID (``GPU-``,
    or ``MIG-`` for a MIG instance), as the script runs them on a GPU, against the model."""
    env = cuda_model.child_env(model_lib, f"gpu-check-{tmp_path.name}", 2, **({"CUDAMODEL_MIG": "1"} if mig else {}))
    result = run_check(tmp_path, "cuda", "--steps", "driver", env=env)
    assert [c["check"] for c in result["checks"]][-1] == "no process imported vLLM or Ray"
    assert len(result["checks"]) == 5
    driver = result["driver"]
    assert driver["allocation_seen_bytes"] == 64 << 20 and driver["this_process_bytes"] == 64 << 20


def test_gpu_check_refuses_a_step_its_backend_lacks(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backend", "host", "--steps", "driver", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown step(s) for backend host: driver" in proc.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_check_on_cuda(tmp_path):
    result = run_check(tmp_path, "cuda")
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
