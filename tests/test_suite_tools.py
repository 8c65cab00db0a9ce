"""The suite's own tools: the test-fast guard (tests/conftest.py) and CI's step report (.ci/run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAST = "not slow and not launch and not soak"

PROBE = '''
import subprocess, sys

def test_starts_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_runs_a_program_that_is_not_python():
    subprocess.run(["true"], check=True)
'''


def _pytest(folder: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(folder), *options, str(folder)],
                          cwd=folder, capture_output=True, text=True, timeout=120)


def test_every_test_the_conftest_names_exists():
    import conftest

    for entry in sorted(conftest.LAUNCHING | conftest.SERIAL):
        path, _, test = entry.partition("::")
        assert (ROOT / "tests" / path).is_file(), f"tests/conftest.py names {path}: no such file"
        if test:
            assert f"def {test}(" in (ROOT / "tests" / path).read_text(), (
                f"tests/conftest.py names {entry}: no such test (renamed?)")


@pytest.mark.launch
def test_the_fast_set_fails_a_test_that_starts_python_and_says_how_to_mark_it(tmp_path):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    fast = _pytest(tmp_path, "-m", FAST)
    assert fast.returncode == 1, fast.stdout
    assert "1 failed, 1 passed" in fast.stdout
    assert "test_starts_python starts a process" in fast.stdout
    assert "pytest.mark.launch" in fast.stdout
    whole = _pytest(tmp_path)
    assert whole.returncode == 0 and "2 passed" in whole.stdout, whole.stdout


def _ci(tmp_path: Path, fails: str = "", **budget: str) -> tuple[int, list[str]]:
    """.ci/run with a stand-in `make` that records its targets and fails those in ``fails``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(
        f'#!/bin/sh\necho "$*" >> {tmp_path}/made\n'
        f'case "$*" in {fails or "@none@"}) exit 3;; esac\nexit 0\n')
    (bin_dir / "make").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **budget}
    done = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, capture_output=True,
                          text=True, timeout=60)
    return done.returncode, done.stdout.strip().splitlines()


@pytest.mark.launch
def test_ci_names_every_step_it_ran_in_its_last_line(tmp_path):
    code, lines = _ci(tmp_path)
    assert code == 0
    made = (tmp_path / "made").read_text().split("\n")
    assert made[:3] == ["test", "test-browser", "test-soak"]
    assert made[3].startswith("test-compat TORCH=") and made[4].startswith("test-compat TORCH=")
    assert lines[-2] == "ci steps: 5 passed, 0 failed, 0 skipped"
    assert lines[-1].startswith("ci: make test passed (")
    for step in ("make test-browser passed", "make test-soak passed", "make test-compat"):
        assert step in lines[-1]


@pytest.mark.launch
def test_ci_fails_with_the_failed_step_and_says_what_it_skipped(tmp_path):
    code, lines = _ci(tmp_path, fails="test-browser")
    assert code == 3
    assert lines[-2] == "ci steps: 1 passed, 1 failed, 3 skipped"
    assert "make test-browser FAILED (exit 3)" in lines[-1]
    assert "make test-soak skipped (an earlier step failed)" in lines[-1]


@pytest.mark.launch
def test_ci_says_which_steps_the_budget_left_out(tmp_path):
    code, lines = _ci(tmp_path, DDPLAB_CI_BUDGET="10", DDPLAB_CI_COMPAT_BUDGET="10")
    assert code == 0
    assert lines[-2] == "ci steps: 1 passed, 0 failed, 4 skipped"
    assert lines[-1].count("skipped (") == 4 and "budget used" in lines[-1]


@pytest.mark.launch
def test_a_failing_make_test_fails_ci(tmp_path):
    code, lines = _ci(tmp_path, fails="test")
    assert code == 3 and "make test FAILED (exit 3)" in lines[-1]
