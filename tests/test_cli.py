"""python -m ddplab: every subcommand answers, and options reach course and bench."""

import subprocess
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
