"""The test harness's child processes (harness/procs.py): a silent child cannot hang a test."""

import os
import time

import pytest

from harness.procs import ChildExited, PeerProcess, descendants

SILENT_FAMILY = """
import subprocess, sys, time
print("STARTED", flush=True)
# A grandchild holds the pipe too, as a vLLM engine core does.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
time.sleep(120)
"""


def test_a_child_silent_past_the_deadline_times_out_and_its_family_is_killed():
    """A child that writes nothing more (a vLLM load logs to stderr) used to block `read`
    forever: the deadline was checked only between lines."""
    child = PeerProcess(["-c", SILENT_FAMILY], "silent")
    try:
        child.read("STARTED", timeout_s=60)
        time.sleep(0.5)
        family = descendants(child.pid)
        assert len(family) == 2
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="silent did not answer in 1 s"):
            child.read("OK ", timeout_s=1)
        assert time.monotonic() - started < 30
        child.proc.wait(timeout=10)
        assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in family)
    finally:
        child.end(timeout_s=5)


def test_a_child_that_answers_in_time_is_left_alone_and_one_that_exits_says_so():
    child = PeerProcess(["-c", "import sys, time\nprint('noise'); print('OK 7', flush=True)\n"
                               "sys.stdin.readline(); time.sleep(2)"], "quick")
    try:
        assert child.read("OK ", timeout_s=1.5) == "7"
        time.sleep(2)  # past that read's deadline: its timer was cancelled
        assert child.proc.poll() is None
        child.send("bye")
        with pytest.raises(ChildExited, match=r"quick exited \(0\)"):
            child.read("OK ", timeout_s=30)
    finally:
        child.end(timeout_s=5)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
