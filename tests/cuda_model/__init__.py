"""The CUDA driver model for tests: build it, point child processes at it, see what they hold.

``cuda_model.c`` is a strict model of NVIDIA's documented driver contract over host memory,
NOT a GPU (its README lists what it enforces), with the small NVML subset the GPU check reads.  cuda-bindings loads it in place of
``libcuda.so.1`` through the library path, and caches the driver per process, so every test
that uses it runs its CUDA code in a child process whose environment comes from `child_env`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from harness.procs import descendants

SOURCE = Path(__file__).with_name("cuda_model.c")


def build(dest: Path) -> Path:
    """Compile the model into ``dest/libcuda.so.1`` with the machine's C compiler (``$CC``,
    default ``cc``), and link ``dest/libnvidia-ml.so.1`` to it (the model's NVML subset: one
    library, one state); returns ``dest``.

    Raises:
        RuntimeError: no C compiler, or the build failed (its output in the message).
    """
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"the CUDA driver model needs a C compiler: {cc!r} is not on PATH (set CC)")
    dest.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([cc, "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-pthread",
                           "-o", str(dest / "libcuda.so.1"), str(SOURCE)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building the CUDA driver model failed:\n{proc.stdout}{proc.stderr}")
    nvml = dest / "libnvidia-ml.so.1"
    nvml.unlink(missing_ok=True)
    nvml.symlink_to("libcuda.so.1")
    return dest


def child_env(lib_dir: Path, tag: str, devices: int = 2, **extra: str) -> dict[str, str]:
    """Environment for a child that must load the model as its CUDA driver: ``tag`` names its
    allocations (`holders`); ``devices`` is how many GPUs the model shows."""
    path = os.pathsep.join(p for p in (str(lib_dir), os.environ.get("LD_LIBRARY_PATH", "")) if p)
    env = {"LD_LIBRARY_PATH": path, "CUDAMODEL_TAG": tag, "CUDAMODEL_DEVICES": str(devices)}
    env.update(extra)
    return env


def holders(tag: str) -> list[int]:
    """Pids among this process and its descendants that hold an allocation of the model tagged
    ``tag``: a descriptor of its memfd or a mapping of it (either keeps the memory alive)."""
    marker = "/memfd:cudamodel-dev"
    suffix = f"-{tag}"
    found = []
    for pid in descendants(os.getpid()):
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:  # the process ended
            continue
        names = []
        for fd in fds:
            try:
                names.append(os.readlink(fd))
            except OSError:  # closed meanwhile (the listing's own descriptor, for one)
                pass
        names = [n for n in names if n.startswith(marker)]
        names += [line.split(None, 5)[-1] for line in maps if marker in line]
        if any(n.split(" (deleted)")[0].endswith(suffix) for n in names):
            found.append(pid)
    return found
