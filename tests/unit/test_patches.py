"""Each upstream-vLLM patch in patches/ still applies to the installed vLLM's source, and the
wrappers the plugin installs in its stead (`engine.worker_hooks`) cover what the patches hook."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import vllm

PATCHES = sorted((Path(__file__).resolve().parents[2] / "patches").glob("*.patch"))
SITE = Path(vllm.__file__).resolve().parents[1]


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_applies_to_installed_vllm(patch):
    proc = subprocess.run(["patch", "--dry-run", "--batch", "-p1", "-d", str(SITE), "-i", str(patch)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{patch.name} no longer applies to vLLM {vllm.__version__}:\n{proc.stdout}"
    assert "FAILED" not in proc.stdout and "fuzz" not in proc.stdout, proc.stdout


def test_worker_hooks_cover_the_methods_the_patches_hook():
    from vllm_dedup.engine import worker_hooks

    worker_hooks.install()
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    for cls, names in ((Worker, ("sleep", "reload_weights", "start_weight_update", "update_weights",
                                 "reset_weights")), (CPUWorker, ("sleep",))):
        for name in names:
            assert getattr(cls.__dict__[name], "__vllm_dedup_hook__", False), f"{cls.__name__}.{name}"
    hooked = {line.split('"')[1] for p in PATCHES for line in p.read_text().splitlines()
              if "_check_weights_writable(\"" in line and line.startswith("+")}
    assert hooked == {"sleep", "reload_weights", "start_weight_update", "start_draft_weight_update",
                      "update_weights", "reset_weights"}
    guarded = {name for module, cls, name, _ in worker_hooks.GUARDED if cls in ("Worker", "CPUWorker")}
    assert guarded == hooked
