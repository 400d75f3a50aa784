"""`vllm-dedup status` against a real registry holding a segment two peer processes share: the
JSON shape, the table's values, and ``--watch`` (redraws, survives the registry going away and
coming back, redraws in place on a terminal, ends cleanly on Ctrl-C)."""

from __future__ import annotations

import json
import os
import shutil
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.procs import PeerProcess
from helpers import PEERS, run_cli
from vllm_dedup.registry.server import RegistryServer
from vllm_dedup.registry.state import Registry

PEER = PEERS / "segment_peer.py"
CLI = str(Path(sys.executable).with_name("vllm-dedup"))
MIB = 1 << 20


@pytest.fixture
def two_peers(registry_server, monkeypatch):
    """The test registry (namespace ``test``) with a 2 MiB segment that one peer published and
    another maps; the CLI finds the registry through ``VLLM_DEDUP_RUNTIME_DIR``."""
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(registry_server.path.parent))
    assert registry_server.path.name == "test.sock"
    publisher = PeerProcess([PEER, registry_server.path, "publish", "s1", str(2 * MIB)], "publisher")
    publisher.read_json()
    mapper = PeerProcess([PEER, registry_server.path, "map", "s1"], "mapper")
    assert mapper.read_json()["hit"] is True
    yield publisher, mapper
    assert publisher.end() == 0 and mapper.end() == 0


def test_status_json_keeps_its_shape(registry_server, two_peers):
    proc = run_cli("status", "--json", "--namespace", "test", check=True)
    data = json.loads(proc.stdout)
    assert list(data) == ["groups", "engines", "locks", "collisions", "keep_warm_s", "registry_pid"]
    (group,) = data["groups"]
    assert list(group) == ["device", "share_group", "engines", "segments", "resident_bytes", "shared_bytes",
                           "mapped_bytes", "saved_bytes", "deferred_segments"]
    assert len(data["engines"]) == 2
    for engine in data["engines"]:
        assert list(engine) == ["id", "pid", "model", "device", "share_group", "signature", "segments", "load"]
    assert data["registry_pid"] == os.getpid()  # the registry runs in this process
    assert group["engines"] == 2 and group["segments"] == 1 and group["shared_bytes"] >= 2 * MIB


def test_status_table_shows_the_live_registry(registry_server, two_peers):
    publisher, mapper = two_peers
    out = run_cli("status", "--namespace", "test", check=True).stdout
    lines = out.splitlines()
    assert lines[0].startswith(f"registry pid {os.getpid()} at {registry_server.path}")
    resident = registry_server.stats().groups[0].resident_bytes  # 2 MiB rounded up to whole pages
    group = next(line.split() for line in lines if line.startswith("cpu "))
    assert group[:4] == ["cpu", "default", "2", "1"]
    assert " ".join(group[4:6]) == " ".join(group[6:8]) == f"{resident / 1e6:.1f} MB"  # resident, shared
    header = next(line.split() for line in lines if line.lstrip().startswith("pid "))
    assert header == ["pid", "device", "share", "group", "segments", "shared", "published", "private", "load",
                      "path", "re-registered", "model"]
    for peer in (publisher, mapper):
        row = next(line.split() for line in lines if line.lstrip().startswith(f"{peer.pid} "))
        # The peers report no load: no bytes, no load path.
        assert row == [str(peer.pid), "cpu", "default", "1", "0", "B", "0", "B", "0", "B", "-", "-", "peer"]


def read_until(fd: int, done, timeout_s: float = 60.0) -> str:
    """Read ``fd`` (a pipe or a pty) until ``done(text so far)`` or ``timeout_s``; the text."""
    text, deadline = b"", time.monotonic() + timeout_s
    while not done(text.decode(errors="replace")) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty whose other end closed
                break
            if not chunk:
                break
            text += chunk
    return text.decode(errors="replace")


def default_sigint() -> None:
    """In the child before exec: SIGINT at its default, as an interactive shell starts a command.
    A test run started in the background by a shell without job control has SIGINT ignored, an
    ignored signal stays ignored across exec, and Python then installs no KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(proc: subprocess.Popen, fd: int) -> tuple[int, str]:
    """SIGINT (Ctrl-C) to ``proc``; its exit status and what it wrote after that."""
    proc.send_signal(signal.SIGINT)
    rest = read_until(fd, lambda _: proc.poll() is not None, timeout_s=20)
    try:
        return proc.wait(timeout=20), rest + read_until(fd, lambda _: False, timeout_s=0.3)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_watch_redraws_and_outlives_the_registry(registry_server, two_peers):
    publisher, _ = two_peers
    heading = "vllm-dedup status, every 0.2s"
    proc = subprocess.Popen([CLI, "status", "--watch", "0.2", "--namespace", "test"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=dict(os.environ), preexec_fn=default_sigint)
    fd = proc.stdout.fileno()
    try:
        shown = read_until(fd, lambda t: t.count(f"{publisher.pid}  cpu ") >= 2)
        assert shown.count(f"{publisher.pid}  cpu ") >= 2 and shown.count(heading) >= 2, shown
        assert "\x1b[" not in shown  # not a terminal: frames follow one another, no escape codes

        registry_server.stop()
        gone = read_until(fd, lambda t: t.count("no registry for namespace 'test'") >= 2)
        assert gone.count("no registry for namespace 'test'") >= 2, gone  # still redrawn, still trying

        again = RegistryServer(Registry(keep_warm_s=7.0), registry_server.path).start()
        try:
            back = read_until(fd, lambda t: "keep_warm_s 7" in t)
            assert f"registry pid {os.getpid()} at {registry_server.path}   keep_warm_s 7" in back, back
        finally:
            again.stop()
        status, rest = interrupt(proc, fd)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    assert status == 0
    assert "Traceback" not in shown + gone + back + rest


def test_watch_redraws_in_place_on_a_terminal(registry_server, two_peers):
    publisher, mapper = two_peers
    master, slave = pty.openpty()
    proc = subprocess.Popen([CLI, "status", "--watch", "0.2", "--namespace", "test"], stdin=slave, stdout=slave,
                            stderr=slave, env=dict(os.environ), preexec_fn=default_sigint)
    os.close(slave)
    try:
        shown = read_until(master, lambda t: t.count("\x1b[H") >= 3 and t.endswith("\x1b[J"))
        status, rest = interrupt(proc, master)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert shown.count("\x1b[2J") == 1  # the screen is cleared once, then each frame overwrites the last
    frames = shown.split("\x1b[H")[1:]
    assert len(frames) >= 3
    for frame in frames[:-1]:
        assert frame.startswith("vllm-dedup status, every 0.2s")
        assert f"{publisher.pid} " in frame and f"{mapper.pid} " in frame
        assert frame.endswith("\x1b[J") and "\x1b[K" in frame  # lines cleared to their end, then the rest
    assert status == 0
    assert "Traceback" not in shown + rest


def test_status_without_a_registry_creates_no_directory(tmp_path, monkeypatch):
    """A query makes nothing: run as root with the user's environment, a created socket
    directory would belong to root, and the user's engines would then refuse it."""
    missing = tmp_path / "no" / "such" / "dir"
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(missing))
    proc = run_cli("status")
    assert proc.returncode == 1 and "no registry" in proc.stderr and "does not exist" in proc.stderr, proc.stderr
    assert not (tmp_path / "no").exists()


def test_status_on_a_worker_node_finds_that_nodes_registry(monkeypatch):
    """A Ray worker node's registry serves ``<runtime dir>-node-<id>`` (registry/nodes.py);
    `status` on that machine found nothing at the head's directory and exited 1."""
    import tempfile

    short = Path(tempfile.mkdtemp(prefix="vds-"))  # a socket path holds 107 bytes at most
    run = short / "run"
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(run))
    monkeypatch.delenv("VLLM_DEDUP_RAY_NODE_DIR", raising=False)
    server = RegistryServer(Registry(), short / "run-node-0123456789abcdef" / "vllm-dedup.sock").start()
    try:
        proc = run_cli("status", "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["registry_pid"] == os.getpid()
    finally:
        server.stop()
    proc = run_cli("status")
    assert proc.returncode == 1 and "vllm-dedup status --all-nodes" in proc.stderr, proc.stderr
    shutil.rmtree(short)


def test_watch_of_all_nodes_retries_while_no_ray_cluster_answers(tmp_path):
    """``--watch`` keeps trying, with ``--all-nodes`` too: a cluster not up yet is a frame that
    says so, not an exit."""
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}  # nothing listens there
    proc = subprocess.Popen([CLI, "status", "--all-nodes", "--watch", "0.2"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, preexec_fn=default_sigint)
    fd = proc.stdout.fileno()
    try:
        shown = read_until(fd, lambda t: t.count("retrying every 0.2s") >= 2)
        assert shown.count("cannot read the registries through Ray at 127.0.0.1:1") >= 2, shown
        assert proc.poll() is None
        status, rest = interrupt(proc, fd)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    assert status == 0 and "Traceback" not in shown + rest
