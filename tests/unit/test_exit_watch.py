"""`registry.server._ExitWatch`, which a daemon uses to tell that the engine it waits for has
exited (Note [the engine a daemon waits for]): through a pidfd, and through ``/proc/PID/stat``
where ``pidfd_open`` is missing or refused (older kernels, some seccomp profiles).  Real child
processes; an exited child not yet reaped (a zombie) has exited."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from helpers import wait_for
from vllm_dedup.registry.server import _ExitWatch


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "proc"])
def test_a_process_is_seen_to_exit_reaped_or_not(monkeypatch, pidfd):
    if not pidfd:
        def refused(pid, flags=0):
            raise OSError(errno.ENOSYS, "pidfd_open refused for the test")

        monkeypatch.setattr(os, "pidfd_open", refused)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    watch = _ExitWatch(child.pid)
    try:
        assert not watch.exited()
        child.kill()
        assert wait_for(watch.exited, 10)  # a zombie: not reaped yet
        child.wait()
        assert watch.exited()
    finally:
        child.kill()
        child.wait()
        watch.close()
    gone = _ExitWatch(child.pid)  # reaped: no such process (a reused pid aside)
    assert gone.exited()
    gone.close()
