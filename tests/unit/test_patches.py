"""Each upstream-vLLM patch in patches/ still applies to the installed vLLM's source, and the
wrappers the plugin installs in its stead (`engine.worker_hooks`) cover what the patches hook.

The wheel holds vLLM's Python package only: a patch's parts for its C++ sources (``csrc/``) are
checked against a vLLM source checkout of the installed version when ``VLLM_SOURCE_DIR`` names
one, and skipped (saying so) otherwise."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import vllm

PATCHES = sorted((Path(__file__).resolve().parents[2] / "patches").glob("*.patch"))
SITE = Path(vllm.__file__).resolve().parents[1]


def _parts(patch: Path) -> dict[str, str]:
    """The patch's text per file it changes (``a/``-relative path -> its headers and hunks)."""
    chunks = re.split(r"(?m)^(?=--- a/)", patch.read_text())
    return {chunk.split("\n", 1)[0][len("--- a/"):].split("\t")[0]: chunk for chunk in chunks if chunk.startswith("--- a/")}


def _dry_run(text: str, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["patch", "--dry-run", "--batch", "-p1", "-d", str(root)], input=text,
                          capture_output=True, text=True)


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_applies_to_installed_vllm(patch):
    parts = _parts(patch)
    wheel = "".join(text for path, text in parts.items() if path.startswith("vllm/"))
    assert wheel or parts, f"{patch.name} changes nothing"
    if not wheel:
        pytest.skip(f"{patch.name} changes only vLLM's C++ sources (not in the wheel)")
    proc = _dry_run(wheel, SITE)
    assert proc.returncode == 0, f"{patch.name} no longer applies to vLLM {vllm.__version__}:\n{proc.stdout}"
    assert "FAILED" not in proc.stdout and "fuzz" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("patch", [p for p in PATCHES if any(not f.startswith("vllm/") for f in _parts(p))],
                         ids=lambda p: p.name)
def test_source_parts_apply_to_a_vllm_checkout(patch):
    source = os.environ.get("VLLM_SOURCE_DIR")
    if not source:
        pytest.skip(f"{patch.name} also changes csrc/, which the wheel does not ship: set VLLM_SOURCE_DIR "
                    f"to a vLLM {vllm.__version__} checkout to check it")
    proc = _dry_run(patch.read_text(), Path(source))
    assert proc.returncode == 0, f"{patch.name} does not apply to {source}:\n{proc.stdout}"
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
