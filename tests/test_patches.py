"""Each upstream-vLLM patch in patches/ still applies to the installed vLLM's source, and the
guards the plugin installs in its stead are in place."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import vllm

PATCHES = sorted((Path(__file__).resolve().parents[1] / "patches").glob("*.patch"))
SITE = Path(vllm.__file__).resolve().parents[1]


def test_there_are_patches():
    assert PATCHES, "patches/ holds no .patch file"


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_applies_to_installed_vllm(patch):
    proc = subprocess.run(["patch", "--dry-run", "--batch", "-p1", "-d", str(SITE), "-i", str(patch)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{patch.name} no longer applies to vLLM {vllm.__version__}:\n{proc.stdout}"
    assert "FAILED" not in proc.stdout and "fuzz" not in proc.stdout, proc.stdout


def test_guards_cover_the_methods_the_patch_hooks():
    from vllm_dedup import guards

    guards.install()
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    for cls, names in ((Worker, ("sleep", "reload_weights", "start_weight_update", "update_weights",
                                 "reset_weights")), (CPUWorker, ("sleep",))):
        for name in names:
            assert getattr(cls.__dict__[name], "__vllm_dedup_guard__", False), f"{cls.__name__}.{name}"
    hooked = {line.split('"')[1] for p in PATCHES for line in p.read_text().splitlines()
              if "_check_weights_writable(\"" in line and line.startswith("+")}
    assert hooked == {"sleep", "reload_weights", "start_weight_update", "update_weights", "reset_weights"}
