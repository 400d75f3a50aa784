"""The test harness (harness/): a silent child cannot hang a test, a signal cannot cut a clean-up short."""

import os
import time

import pytest

from harness.procs import ChildExited, PeerProcess, descendants
from helpers import wait_for

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
        # SIGKILL is delivered asynchronously: the grandchild may take a moment to be gone.
        assert wait_for(lambda: all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in family), 30)
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


DEFERRED = """
import os, signal, sys, threading, time
from harness.chaos import Interrupted, _signals_deferred, _signals_raise
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # a thread that blocks nothing
steps = []
try:
    with _signals_raise():
        with _signals_deferred():
            for i in range(5):
                if i == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
                steps.append(i)
        steps.append("after")
except Interrupted as e:
    print(steps, e.args[0])
"""


def test_the_chaos_soaks_clean_up_finishes_before_a_signal_that_came_meanwhile_interrupts():
    """The soak stops its servers under `_signals_deferred`: a SIGTERM in the middle (delivered
    to whichever thread the kernel picks) waits for the block's end, then interrupts."""
    import subprocess
    import sys

    from harness.procs import ROOT

    child = subprocess.run([sys.executable, "-c", DEFERRED], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert child.stdout.strip() == "[0, 1, 2, 3, 4] SIGTERM", (child.stdout, child.stderr[-2000:])
