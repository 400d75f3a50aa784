"""Each upstream-vLLM patch in patches/ still applies to the installed vLLM's source, and the
wrappers the plugin installs in its stead (`engine.worker_hooks`) cover what the patches hook.

The wheel holds vLLM's Python package only: a patch's parts for its C++ sources (``csrc/``) are
checked against vLLM's source release of the installed version: a checkout that
``VLLM_SOURCE_DIR`` names, or else the release's sdist from PyPI (pinned by its SHA-256 in
`SOURCE_RELEASES`; its ``csrc/`` extracted once into the cache).  Skipped, saying why, only
where neither can be had (no network, a vLLM version without a pinned release)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import vllm

PATCHES = sorted((Path(__file__).resolve().parents[2] / "patches").glob("*.patch"))
SITE = Path(vllm.__file__).resolve().parents[1]
# vLLM version -> (its sdist on PyPI, SHA-256): the sources the wheel was built from.
SOURCE_RELEASES = {
    "0.32.0": ("https://files.pythonhosted.org/packages/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/"
               "vllm-0.32.0.tar.gz", "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"),
}


def _vllm_source() -> Path:
    """A directory with the installed vLLM's C++ sources (``csrc/``): ``VLLM_SOURCE_DIR``, or the
    pinned sdist's, downloaded and checked once (module docstring); skips the test, saying why,
    when there is none."""
    import hashlib
    import shutil
    import tarfile
    import tempfile
    import urllib.request

    from vllm_dedup.checkpoint.manifest import default_cache_dir

    if os.environ.get("VLLM_SOURCE_DIR"):
        return Path(os.environ["VLLM_SOURCE_DIR"])
    version = vllm.__version__.split("+")[0]
    if version not in SOURCE_RELEASES:
        pytest.skip(f"no pinned source release of vLLM {version}: set VLLM_SOURCE_DIR to a checkout of it")
    url, sha256 = SOURCE_RELEASES[version]
    out = default_cache_dir() / "vllm-source" / f"vllm-{version}"
    if (out / "csrc").is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        archive = Path(tmp) / "sdist.tar.gz"
        try:
            with urllib.request.urlopen(url, timeout=120) as resp, open(archive, "wb") as f:
                shutil.copyfileobj(resp, f)
        except OSError as e:
            pytest.skip(f"vLLM {version}'s sources cannot be downloaded ({e}): set VLLM_SOURCE_DIR to a checkout")
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        assert digest == sha256, f"{url} is not the pinned release (SHA-256 {digest})"
        prefix = f"vllm-{version}/csrc/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            tar.extractall(Path(tmp) / "x", members=members, filter="data")
        os.replace(Path(tmp) / "x" / f"vllm-{version}", out)
    return out


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
def test_source_parts_apply_to_the_vllm_release(patch):
    source = _vllm_source()
    csrc = "".join(text for path, text in _parts(patch).items() if not path.startswith("vllm/"))
    proc = _dry_run(csrc, source)
    assert proc.returncode == 0, f"{patch.name} does not apply to {source}:\n{proc.stdout}"
    assert "FAILED" not in proc.stdout and "fuzz" not in proc.stdout, proc.stdout


def test_worker_hooks_cover_the_methods_the_patches_hook():
    from vllm_dedup.engine import vllm_facts, worker_hooks

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
    guarded = {name for module, cls, name, _ in vllm_facts.GUARDED if cls in ("Worker", "CPUWorker")}
    assert guarded == hooked
