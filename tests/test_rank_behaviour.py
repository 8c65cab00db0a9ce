"""Rank scripts nobody here wrote: the launch behaves as torchrun does, or better.

Each case once made a launch wait for its timeout, report a healthy rank as failed, lose what
it knew, or leave processes behind (issue: "sturdy under real rank behaviour"). torchrun is the
reference: a launch ends when its ranks end, whatever they left running or holding.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import ddplab
from ddplab import LaunchError, launch
from ddplab.launcher import MAX_NPROCS

SCRIPTS = Path(__file__).parent / "scripts"
LEAVES = str(SCRIPTS / "leaves_children.py")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], seconds: float = 15.0) -> list[int]:
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def children_of(result) -> list[int]:
    return [int(line.split()[1]) for rank in (0, 1) for line in result.logs.get(rank, [])
            if line.startswith("child ")]


@pytest.mark.parametrize("mode", ["session", "background", "fork"])
def test_a_launch_ends_when_its_ranks_end_whatever_they_left_running(mode):
    result = launch(LEAVES, 2, args=[mode, "120"], quiet=True, timeout=90)
    children = children_of(result)
    try:
        assert result.status == "ok", result.error  # not "timeout": the ranks had exited 0
        assert result.exit_codes == {0: 0, 1: 0}
        assert [result.log(rank).splitlines()[-1] for rank in (0, 1)] == [
            "rank 0 done", "rank 1 done"]  # everything the ranks wrote was read
        assert len(children) == 2
        if mode != "session":  # in the ranks' process group: ended with it, as torchrun does
            assert not wait_gone(children, 10)
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_a_rank_that_closes_its_stdout_is_no_failure():
    result = launch(str(SCRIPTS / "closes_stdout.py"), 2, quiet=True, timeout=90)
    assert result.ok, result.error
    assert result.exit_codes == {0: 0, 1: 0}
    assert "rank 1 sum 3" in result.log(1) and "rank 0 sum 3" in result.log(0)  # on stderr


def test_nprocs_above_the_limit_is_refused_before_anything_starts_and_up_to_it_works(tmp_path):
    with pytest.raises(LaunchError, match=f"from 1 to {MAX_NPROCS}"):
        launch(LEAVES, MAX_NPROCS + 1)
    with pytest.raises(LaunchError, match=f"from 1 to {MAX_NPROCS}"):
        launch(LEAVES, 10_000)
    script = tmp_path / "many.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], flush=True)\n")
    fds = len(os.listdir("/proc/self/fd"))
    result = launch(script, 128, quiet=True, timeout=600)
    assert result.ok, result.error
    assert sorted(result.exit_codes) == list(range(128)) and set(result.exit_codes.values()) == {0}
    assert all(result.log(rank) == f"rank {rank}" for rank in range(128))
    assert len(os.listdir("/proc/self/fd")) <= fds  # every pipe closed again


@pytest.mark.parametrize("timeout", [math.nan, math.inf, 0, -5, "10", True])
def test_a_timeout_that_is_not_a_positive_number_is_refused(timeout):
    with pytest.raises(LaunchError, match="timeout must be a finite number of seconds > 0"):
        launch(LEAVES, 2, timeout=timeout)


def test_after_a_timeout_the_result_keeps_what_it_knew_and_names_where_each_rank_waits():
    result = launch(str(SCRIPTS / "missing_rank.py"), 3, quiet=True, timeout=8)
    assert result.status == "timeout" and not result.ok
    assert result.exit_codes == {0: 0, 1: None, 2: None}  # rank 0 had exited; 1, 2 still ran
    assert result.still_running == [1, 2]
    assert "still running: rank 1, rank 2" in result.error
    assert sorted(result.stacks) == [1, 2]
    for rank in (1, 2):
        assert 'missing_rank.py", line 15' in result.stacks[rank], result.stacks[rank]
        assert "most recent call first" in result.stacks[rank]
    assert not wait_gone(list(result.pids.values()), 10)


def test_ranks_of_a_torchrun_subprocess_are_not_asked_for_a_stack(monkeypatch):
    """They have no handler for the signal, which would end them: their timeout says less."""
    monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")
    result = launch(LEAVES, 1, args=["hold", "30"], quiet=True, timeout=6)
    assert result.status == "timeout" and result.stacks == {}
    assert result.exit_codes == {0: None}
