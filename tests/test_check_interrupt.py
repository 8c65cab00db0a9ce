"""``ddplab check --submissions`` stopped by its caller: a Ctrl-C, or a ``kill -9`` (a CI job's
time limit, a closed terminal). A class of two: one right answer to 08, graded first, then one
whose ranks sleep an hour. Once the sleepers run, the grader is stopped; nothing of the class
may be left running, and the first verdict must be in the reports already. The hard limit is
far away (10 minutes a launch), so only the stop itself can end the sleepers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_check import at_start_of_average, variant
from test_launch import processes, until, wait_gone

from ddplab.lab.classrun import REFERENCE_CACHE

#: Where each sleeping rank notes the class's folder of reference runs (its environment).
FOLDERS = "reference-folders.txt"
#: Generous safety nets for a busy 2-core machine (the grader stops in seconds).
SAFETY = 120.0


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    root, out = tmp_path / "class", tmp_path / "out"
    pids = out / "sleepers.txt"
    out.mkdir()
    sleeper = variant(at_start_of_average(
        f"    open({str(out / FOLDERS)!r}, 'a').write(os.environ[{REFERENCE_CACHE!r}] + '\\n')\n"
        f"    open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "    import time\n    time.sleep(3600)\n"))
    for name, text in (("a-right", variant()), ("b-sleeps", sleeper)):
        (root / name / "exercises").mkdir(parents=True)
        text = text.replace("import torch\n", "import os\n\nimport torch\n", 1)
        (root / name / "exercises" / "collective.py").write_text(text)
    # a child of a non-interactive shell may inherit SIGINT ignored: give it Python's handler
    grader = subprocess.Popen(
        [sys.executable, "-m", "ddplab", "check", "--submissions", str(root), "--timeout", "600",
         "--json", str(out / "grades.json"), "--junit", str(out / "grades.xml")],
        cwd=out, env={**os.environ, "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return grader, out, pids


def _class_processes(tmp_path: Path) -> list[int]:
    marker = f"TMPDIR={tmp_path}".encode()
    return [pid for pid, _ppid, _argv, environ in processes()
            if any(item.startswith(marker) for item in environ)]


def _sleepers_run(grader: subprocess.Popen, out: Path, pids: Path) -> list[int]:
    """Wait until the first verdict is written and both sleeping ranks run; their pids."""
    def ready() -> bool:
        assert grader.poll() is None, grader.communicate()
        return (out / "grades.json").exists() and pids.exists() and \
            len(pids.read_text().split()) >= 2
    until(ready, "the sleepers never started", SAFETY)
    return [int(p) for p in pids.read_text().split()]


def _first_verdict_kept(out: Path) -> None:
    graded = json.loads((out / "grades.json").read_text())["submissions"]
    assert [(s["name"], s["passed"]) for s in graded] == [("a-right", 1)]
    assert "a-right" in (out / "grades.xml").read_text()


@pytest.mark.timeout(600)
def test_a_ctrl_c_ends_the_class_and_keeps_its_verdicts(tmp_path):
    grader, out, pids = _start(tmp_path)
    try:
        sleepers = _sleepers_run(grader, out, pids)
        grader.send_signal(signal.SIGINT)
        stdout, stderr = grader.communicate(timeout=SAFETY)
    finally:
        if grader.poll() is None:
            grader.kill()
    assert grader.returncode == 130, stderr
    assert "interrupted" in stderr and "a-right" in stdout, (stdout, stderr)
    assert wait_gone(sleepers, 5.0) == []
    assert wait_gone(_class_processes(tmp_path), 5.0) == []
    _first_verdict_kept(out)
    folders = set((out / FOLDERS).read_text().split())   # the class's, removed with it
    assert len(folders) == 1 and not any(Path(f).exists() for f in folders), folders


@pytest.mark.timeout(600)
def test_a_killed_grader_leaves_no_submission_running(tmp_path):
    grader, out, pids = _start(tmp_path)
    try:
        sleepers = _sleepers_run(grader, out, pids)
        grader.kill()   # kill -9: it cleans nothing up; its grading process does
        grader.communicate(timeout=SAFETY)
        assert wait_gone(sleepers, SAFETY) == []
        assert wait_gone(_class_processes(tmp_path), SAFETY) == []
    finally:
        if grader.poll() is None:
            grader.kill()
    _first_verdict_kept(out)


FORGER = (
    "    import json as _json, signal as _signal\n"
    "    pid = os.getppid()\n"
    "    while pid > 1:   # up to the grading process, whose argv names the verdict's file\n"
    "        argv = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
    "        if b'ddplab.lab.grading' in argv:\n"
    "            where = argv[argv.index(b'ddplab.lab.grading') + 2].decode()\n"
    "            open(where, 'w').write(_json.dumps({'key': '08', 'file': 'collective.py',\n"
    "                                               'correct': True, 'message': 'correct'}))\n"
    "            os.kill(pid, _signal.SIGKILL)\n"
    "            break\n"
    "        pid = int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1])\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the forger reads /proc")
@pytest.mark.timeout(600)
def test_a_verdict_written_by_the_exercise_itself_is_not_taken(tmp_path):
    """A rank that writes a 'correct' verdict where its grading process would, then kills that
    process, is not graded correct: only a grading process that ended as it ends is believed."""
    from ddplab.lab import grading

    course = tmp_path / "course"
    (course / "exercises").mkdir(parents=True)
    text = variant(at_start_of_average(FORGER))
    (course / "exercises" / "collective.py").write_text(
        text.replace("import torch\n", "import os\n\nimport torch\n", 1))
    (outcome,) = grading.check_course(course, ["08"], timeout=SAFETY, out=open(os.devnull, "w"))
    assert not outcome.correct and "could not judge" in outcome.message, outcome


GUARDED_JUDGE = """
import os, sys, time
from pathlib import Path
from ddplab.lab import grading

def judge_here(key, timeout=None):   # a judge that fails as soon as the guard ends its launches
    while not grading._GUARDED:
        time.sleep(0.01)
    raise RuntimeError("the launch helper did not start")

def end_marked(mark):                # ending them takes a while (50 tries of 0.05 s at most)
    time.sleep(1.0)

grading.judge_here, grading.end_marked = judge_here, end_marked
os.environ[grading.MARK] = "m"
sys.exit(grading.main(["08", sys.argv[1]]))
"""


def test_a_judge_that_fails_past_the_limit_leaves_the_guard_s_verdict_and_exit(tmp_path):
    """Past its limit the grading process's guard ends the exercise, which can make the judge
    fail: the process must still exit as its guard does (3), with the guard's verdict, which is
    what ``run_exercise`` believes (a plain failure, exit 1, is not believed)."""
    from ddplab.lab import grading

    verdict = tmp_path / "verdict-08.json"
    done = subprocess.run(
        [sys.executable, "-c", GUARDED_JUDGE, str(verdict)], capture_output=True, text=True,
        timeout=SAFETY, env={**os.environ, grading.LIMIT: "0.2", grading.PARENT: str(os.getpid())})
    assert done.returncode == 3, done.stderr[-2000:]
    assert "still running after 0.2 s" in json.loads(verdict.read_text())["message"]
