"""ddplab.lab.pyspy: py-spy on a hung job stops at once when py-spy may not trace (notebook 10)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ddplab.lab import pyspy

PARENT = """
import os, subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         env={**os.environ, "RANK": str(r)}) for r in range(2)]
time.sleep(60)
"""


@pytest.fixture
def job():
    """A parent with two children, each with its RANK, as torchrun starts its workers."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True)
    yield parent
    os.killpg(parent.pid, 9)
    parent.wait()


def test_a_py_spy_that_may_not_trace_ends_the_wait_and_says_why(job, tmp_path):
    denied = tmp_path / "py-spy"
    denied.write_text("#!/bin/sh\necho 'Permission Denied: Try running again with elevated "
                      "permissions' >&2\nexit 1\n")
    denied.chmod(0o755)
    start = time.monotonic()
    found = pyspy.dump_ranks(job.pid, 2, __file__, deadline_s=60, executable=denied)
    assert time.monotonic() - start < 30          # not the deadline
    assert found.error and "may not trace" in found.error and "Permission Denied" in found.error
    assert found.dumps == {} and found.lines == {}


def test_a_py_spy_that_keeps_failing_for_another_reason_ends_the_wait_too(job, tmp_path):
    broken = tmp_path / "py-spy"
    broken.write_text("#!/bin/sh\necho 'Error: something else' >&2\nexit 1\n")
    broken.chmod(0o755)
    found = pyspy.dump_ranks(job.pid, 2, __file__, deadline_s=60, executable=broken)
    assert found.error and "something else" in found.error and "may not trace" not in found.error


def test_no_py_spy_is_said_at_once(tmp_path):
    found = pyspy.dump_ranks(os.getpid(), 2, __file__, executable=tmp_path / "py-spy")
    assert found.error and "not installed" in found.error and found.dumps == {}


def test_the_waiting_line_is_read_from_a_coloured_dump(tmp_path):
    source = tmp_path / "worker.py"
    source.write_text("x = 1\ndist.all_reduce(total)\n")
    dump = ("Thread 1 (idle): \"MainThread\"\n    \x1b[1mall_reduce\x1b[0m (torch/c10d.py:9)\n"
            f"    main (\x1b[2m{source}:2\x1b[0m)\n")
    assert pyspy.waiting_line(dump, str(source)) == "dist.all_reduce(total)"
    assert pyspy.waiting_line("no frames", str(source)) is None
