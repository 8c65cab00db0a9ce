"""python -m ddplab: every subcommand answers, and options reach course and bench."""

import subprocess
from pathlib import Path
import sys

import pytest


def ddplab(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "ddplab", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_doctor_succeeds_and_reports_the_backend():
    done = ddplab("doctor")
    assert done.returncode == 0, done.stderr
    assert "ddplab will use" in done.stdout


@pytest.mark.parametrize("command,option", [("course", "--strip"), ("bench", "--repeats")])
def test_course_and_bench_take_their_own_options(command, option):
    done = ddplab(command, "--help")
    assert done.returncode == 0 and option in done.stdout


def test_unknown_command_is_a_usage_error():
    done = ddplab("fly")
    assert done.returncode == 2 and "invalid choice" in done.stderr


def test_max_restarts_reaches_the_elastic_agent():
    script = str(Path(__file__).parent / "scripts" / "restart_once.py")
    failed = ddplab("launch", "--nproc-per-node", "2", script)
    assert failed.returncode != 0 and "rank 1 exited with code 5" in failed.stderr
    restarted = ddplab("launch", "--nproc-per-node", "2", "--max-restarts", "1", script)
    assert restarted.returncode == 0, restarted.stderr
    assert "[rank1] attempt 1: rank 1 sum 3" in restarted.stdout
