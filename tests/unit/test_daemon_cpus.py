"""The registry daemon an engine starts runs on the CPUs of the engine's parent, not on the one CPU
vLLM bound the worker's main thread to (Note [the daemon's CPUs], `registry/daemon.py`).  A real
daemon, started from a child process whose main thread is bound as vLLM binds a CPU worker's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import wait_for
from harness.procs import processes_matching
from vllm_dedup.registry.client import registry_stats, shutdown_registry

CPUS = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CPUS) < 2, reason="a thread bound apart from its process needs two CPUs to tell")
def test_the_daemon_runs_on_the_cpus_of_its_launchers_parent_not_the_bound_main_thread(tmp_path):
    sock = tmp_path / "run" / "vllm-dedup.sock"
    code = textwrap.dedent(f"""
        import os, sys, threading
        from pathlib import Path
        from vllm_dedup.registry.daemon import start_daemon
        os.sched_setaffinity(threading.get_native_id(), {{{CPUS[0]}}})  # as vLLM binds a worker's main thread
        start_daemon(Path(sys.argv[1]), idle_exit_s=30)
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(sock)], capture_output=True, text=True, timeout=120)
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        pid = registry_stats(sock).registry_pid
        assert sorted(os.sched_getaffinity(pid)) == CPUS  # this test's: the launcher's parent's
    finally:
        shutdown_registry(sock)
    assert wait_for(lambda: not processes_matching(b"vllm_dedup.registry.daemon", str(sock).encode()), 30)


def test_a_daemon_given_cpus_that_are_not_numbers_says_what_to_give(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vllm_dedup.registry.daemon", "--socket", str(tmp_path / "s.sock"),
                           "--cpus", "0-1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--cpus '0-1': give CPU numbers separated by commas, e.g. 0,1,2" in proc.stderr
    assert not (tmp_path / "s.sock.lock").exists()  # refused before taking the socket's lock
