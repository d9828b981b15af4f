"""sluice/replica/serve.process_alive: how the start-up watcher tells that tritonserver exited, from
/proc alone (sh's is_alive() ran pytriton's exit callback in the watcher's thread and hung it)."""

from __future__ import annotations

import os
import subprocess
import time

from sluice.replica.serve import process_alive


def test_a_running_child_is_alive_an_exited_one_is_not_even_before_it_is_reaped():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert process_alive(child.pid)
        child.kill()
        deadline = time.monotonic() + 5
        while process_alive(child.pid):         # a zombie until reaped: not running
            assert time.monotonic() < deadline, "a killed child still reads as running"
            time.sleep(0.01)
        assert os.waitpid(child.pid, os.WNOHANG)[0] == child.pid   # it was not reaped by the check
    finally:
        child.kill()
        child.returncode = -9                   # reaped above: Popen must not wait for it again
    assert not process_alive(child.pid)


def test_this_process_is_alive_and_a_pid_that_never_ran_is_not():
    assert process_alive(os.getpid())
    assert not process_alive(2**22 + 1)         # above any pid_max (at most 2**22)
