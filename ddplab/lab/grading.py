"""``ddplab check``: the coding exercises' judges from a terminal, one exercise at a time.

A learner who works in an editor runs ``ddplab check`` in their course folder: every exercise
whose file differs from the shipped skeleton is launched as its notebook launches it (the table
``LAUNCHES``) and judged by the notebook's judge, one verdict per exercise. An exercise about
ranks is judged at two world sizes (2 and 4), so that a solution written for two ranks fails.

Each exercise is judged in a process of its own (``python -m ddplab.lab.grading``), in a session
of its own, under a hard wall-clock limit that process keeps itself (it also ends when its
caller is gone); afterwards every process it left is ended (found by a mark in its
environment). :func:`stop_all` (a Ctrl-C) ends them all. An exercise that is a shipped
reference (``ddplab.lab.copies``) is not launched: its verdict is :data:`COPIED`.

A teacher's class (``ddplab check --submissions``: each submission in a fresh working copy,
the table, ``--json`` and ``--junit``) is :mod:`ddplab.lab.classrun`, which grades each
exercise here.

Example::

    ddplab check                       # in a course folder: the exercises you changed
    ddplab check ~/ddplab-course 04 05

Lessons: the coding exercises of 03-13.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from ..launcher.procs import marked, private_folder   # (private: a kill -9 leaves none)

#: Marks every process of one graded exercise (its environment), to end what it leaves.
MARK = "DDPLAB_CHECK_MARK"
#: The grading process's hard limit (seconds) and the process it dies with (environment).
LIMIT, PARENT = "DDPLAB_CHECK_LIMIT", "DDPLAB_CHECK_PARENT"
#: Seconds the caller waits beyond the hard limit before it ends a grading process itself
#: (which ends its exercise at the limit on its own).
BACKSTOP = 30.0
#: Lines of each rank's output the launcher keeps in memory while grading (the tail).
KEEP_LINES = 2000
#: Seconds a launch may take beyond its own timeout (starting the launcher, the stack dump,
#: ending the ranks) before the exercise's process is killed.
SLACK = 45.0


@dataclass(frozen=True)
class Launch:
    """How a coding exercise's notebook launches it (on a machine without GPUs)."""

    key: str
    skeleton: str  # exercises/<skeleton>
    sizes: tuple[int, ...]  # world sizes judged, in order; the notebook's first
    args: tuple[str, ...] = ()
    backend: Optional[str] = None  # None: nccl when every rank has a GPU, else gloo (auto)
    timeout: float = 60.0
    training: bool = False  # imports ddplab's training stack: the launcher preloads it


#: Exercise -> launch. The sizes beyond the notebook's are for ``check``: a solution written
#: for two ranks fails at four. 06 (a precision per device) and 11 (a two-stage pipeline) do
#: not depend on the world size; 08's ring is judged at the notebook's 4 and at 2; 11b's sizes
#: are its three launches (``FSDP2_RUNS``), judged as one set.
LAUNCHES = {spec.key: spec for spec in (
    Launch("03", "ddp_wrap.py", (2, 4), training=True),
    Launch("03b", "accumulate.py", (2, 4)),
    Launch("04", "sampler.py", (2, 4), training=True),
    Launch("05", "checkpoint.py", (2, 4), training=True),
    Launch("06", "amp.py", (2,), training=True),
    Launch("08", "collective.py", (4, 2)),
    Launch("10", "uneven_join.py", (2, 4), ("--pg-timeout", "3"), backend="gloo"),
    Launch("11", "pipeline_forward.py", (2,)),
    Launch("11b", "fsdp2.py", (2, 4, 1)),
    Launch("12", "tp_plan.py", (2, 4)),
    # the capstone's five runs (its judge's LAUNCHES) are on 2 and 4 ranks; the skeleton on 2
    Launch("13", "capstone.py", (2, 4), ("--dataset", "digits"), timeout=300.0, training=True),
)}
#: Exercise 11b's three launches (notebook 11), judged as one set: train and save on 2 ranks,
#: then load that checkpoint on 4 ranks and in one process; {dir} is a fresh folder.
FSDP2_RUNS = (("save", 2, ("--save", "{dir}")), ("load4", 4, ("--load", "{dir}")),
              ("load1", 1, ("--load", "{dir}")))


def keys() -> list[str]:
    """Every exercise ``check`` knows, in course order."""
    return list(LAUNCHES)


def exercise_key(word: str) -> Optional[str]:
    """The exercise ``word`` names: a key (``04``), a file name (``sampler.py``) or its path."""
    if word in LAUNCHES:
        return word
    name = Path(word).name
    return next((key for key, spec in LAUNCHES.items()
                 if name in (spec.skeleton, spec.skeleton[:-3])), None)


def shipped_exercise(skeleton: str) -> Path:
    from ..workspace import shipped_dir

    return shipped_dir() / "exercises" / skeleton


def changed(course: Path) -> list[str]:
    """The exercises whose file in ``course`` differs from the shipped skeleton."""
    found = []
    for key, spec in LAUNCHES.items():
        mine = course / "exercises" / spec.skeleton
        if mine.is_file() and mine.read_bytes() != shipped_exercise(spec.skeleton).read_bytes():
            found.append(key)
    return found


# ------------------------------------------------------------------ one exercise, in its process


#: An exercise's verdict, beyond right and wrong: a copy of a shipped reference (not launched).
COPIED = "copied from the reference"


@dataclass
class Outcome:
    """The verdict on one exercise of one submission: ``verdict`` is "correct", "wrong",
    :data:`COPIED`, "not handed in" or "not attempted"."""

    key: str
    file: str
    correct: bool
    message: str
    seconds: float = 0.0
    sizes: list[int] = field(default_factory=list)
    verdict: str = ""

    def __post_init__(self) -> None:
        self.verdict = self.verdict or ("correct" if self.correct else "wrong")


def copy_outcome(key: str, mine: Path) -> Optional[Outcome]:
    """The verdict :data:`COPIED` when the file ``mine`` of exercise ``key`` is a shipped
    reference, imports it or runs it (``ddplab.lab.copies``), else None: launch it."""
    from .copies import copied

    spec = LAUNCHES[key]
    what = copied(key, mine, shipped_exercise(spec.skeleton))
    if what is None:
        return None
    return Outcome(key, spec.skeleton, False, f"{COPIED}: {what}. A copy is not graded; "
                   "write the exercise yourself.", verdict=COPIED)


def judge_here(key: str, timeout: Optional[float] = None) -> Outcome:
    """Launch exercise ``key`` from the course folder above the working directory (a
    notebook's kernel runs in ``notebooks/``), as its notebook does, and judge it.

    An exercise about ranks is launched at each of its sizes, and stops at the first wrong one.
    """
    from . import judges

    spec = LAUNCHES[key]
    limit = timeout or spec.timeout
    target = f"../exercises/{spec.skeleton}"
    start = time.monotonic()
    if key == "13":
        return _judge_capstone(spec, target, limit, start)
    if key == "11b":
        return _judge_fsdp2(spec, target, limit, start)
    done: list[int] = []
    for size in spec.sizes:
        result = _launch(target, size, spec, limit)
        hint = judges.run_failed(result) or judges.load_all()[key].judge(result)
        if hint is not None:
            where = f" at {size} ranks" if len(spec.sizes) > 1 else ""
            return Outcome(key, spec.skeleton, False, f"not yet{where}: {hint}",
                           time.monotonic() - start, done + [size])
        done.append(size)
    return Outcome(key, spec.skeleton, True, "correct" + (
        f" at {' and '.join(map(str, done))} ranks" if len(done) > 1 else ""),
        time.monotonic() - start, done)


def _launch(target: str, size: int, spec: Launch, timeout: float, args: Sequence[str] = (),
            on_event: Any = None) -> Any:
    from ..launcher.api import launch

    return launch(target, size, args=[*spec.args, *args], backend=spec.backend,
                  timeout=timeout, quiet=True, live=False, on_event=on_event)


def _judge_capstone(spec: Launch, target: str, timeout: float, start: float) -> Outcome:
    """Notebook 13: one launch while the file holds its TODO and that launch trains nothing
    (the skeleton) or fails (five more would fail or hang as it did), else the notebook's five
    runs (and the reference's, which the judge launches to compare them with)."""
    from .judges import capstone

    sizes = list(spec.sizes)
    work = Path(private_folder("ddplab-13-"))
    try:
        first: Any = None
        if capstone.unanswered(Path(target)):
            first = _launch(target, sizes[0], spec, min(timeout, 60.0),
                            ("--checkpoint-dir", str(work / "first")))
        if first is not None and (not first.ok or capstone.unanswered(Path(target), first)):
            sizes, runs = sizes[:1], first   # the skeleton, or a failed run: judged alone
        else:
            runs = capstone.launch_runs(   # after the first, a hang ends once certain
                lambda nprocs, args, **watch: _launch(
                    target, nprocs, spec, min(timeout, watch.get("timeout", timeout)), args,
                    watch.get("on_event")), work)
        hint = capstone.judge_capstone(runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Outcome("13", spec.skeleton, hint is None, "correct" if hint is None else
                   f"not yet: {hint}", time.monotonic() - start, sizes)


def _judge_fsdp2(spec: Launch, target: str, timeout: float, start: float) -> Outcome:
    """Notebook 11's FSDP2 exercise: save on 2 ranks, load on 4 and 1, judged together."""
    from . import judges

    work = Path(private_folder("ddplab-11b-"))
    try:
        runs = {name: _launch(target, size, spec, timeout,
                              [a.replace("{dir}", str(work / "dcp")) for a in args])
                for name, size, args in FSDP2_RUNS}
        hint = judges.load_all()["11b"].judge(runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Outcome("11b", spec.skeleton, hint is None, "correct" if hint is None else
                   f"not yet: {hint}", time.monotonic() - start, list(spec.sizes))


def _launches(key: str) -> int:
    if key == "13":   # the five runs and the reference's, which its judge launches
        from .judges.capstone import RUNS

        return len(RUNS) + 1
    return len(LAUNCHES[key].sizes)


def _tree_of(mark: str) -> list[int]:
    """Every process whose environment holds ``MARK=mark`` (Linux's /proc; elsewhere none)."""
    return marked(MARK, mark)


def end_all(proc: subprocess.Popen, mark: str) -> None:
    """End ``proc``'s session and every process marked ``mark``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()
    end_marked(mark)


def end_marked(mark: str) -> None:
    """End every process marked ``mark`` but this one."""
    for _ in range(50):  # a process may start another while the first is ended
        pids = _tree_of(mark)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)


def run_exercise(key: str, course: Path, work: Path, timeout: Optional[float] = None,
                 env: Optional[dict[str, str]] = None) -> Outcome:
    """Judge exercise ``key`` of the course folder ``course`` in a process of its own.

    The process runs in ``course/notebooks`` in a session of its own, with ``env`` over the
    caller's environment; it is killed after the launches' timeouts and a margin, and every
    process marked as its own is ended after it. ``work`` holds its verdict and its log.
    """
    spec = LAUNCHES[key]
    mark = uuid.uuid4().hex
    verdict, log = work / f"verdict-{key}.json", work / f"log-{key}.txt"
    verdict.unlink(missing_ok=True)
    (course / "notebooks").mkdir(parents=True, exist_ok=True)
    limit = _launches(key) * ((timeout or spec.timeout) + SLACK)
    cmd = [sys.executable, "-m", "ddplab.lab.grading", key, str(verdict)]
    if timeout:
        cmd.append(str(timeout))
    child_env = {**os.environ, **(env or {}), MARK: mark, LIMIT: repr(limit),
                 PARENT: str(os.getpid()),
                 "DDPLAB_KEEP_LINES": str(KEEP_LINES),
                 "DDPLAB_PRELOAD_TRAINING": "1" if spec.training else "0",
                 "DDPLAB_RESULTS": str(course / "results")}
    start = time.monotonic()
    with open(log, "wb") as out:
        with _RUNNING_LOCK:
            if STOPPING.is_set():
                return Outcome(key, spec.skeleton, False, INTERRUPTED, verdict="interrupted")
            proc = subprocess.Popen(cmd, cwd=course / "notebooks", env=child_env,
                                    stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            _RUNNING[proc.pid] = (proc, mark)
        try:
            proc.wait(limit + BACKSTOP)   # the grading process keeps the limit itself
            killed = False
        except subprocess.TimeoutExpired:
            killed = True
        finally:
            end_all(proc, mark)
            with _RUNNING_LOCK:
                _RUNNING.pop(proc.pid, None)
    seconds = time.monotonic() - start
    if STOPPING.is_set() and not verdict.exists():
        return Outcome(key, spec.skeleton, False, INTERRUPTED, seconds, verdict="interrupted")
    if killed:
        return Outcome(key, spec.skeleton, False, _too_long(limit), seconds)
    try:   # a verdict counts only from a grading process that ended as it ends (0, or its
        # guard's 3): the exercise's own code can write the file too, then kill its grader
        if proc.returncode not in (0, 3):
            raise ValueError(proc.returncode)
        outcome = Outcome(**json.loads(verdict.read_text()))
    except (OSError, ValueError, TypeError):
        tail = _tail(log)
        return Outcome(key, spec.skeleton, False, "not yet: the grader could not judge the "
                       f"run (exit {proc.returncode}): {tail}", seconds)
    outcome.seconds = seconds
    outcome.message = outcome.message.replace(f"{course.resolve()}{os.sep}", "")
    return outcome


def _too_long(limit: float) -> str:
    return (f"not yet: still running after {limit:g} s (the launches' timeouts and a margin): "
            "ended. Look for a loop that never ends, or a rank that never exits.")


#: The grading processes running now (pid -> process, mark), for :func:`stop_all`.
_RUNNING: dict[int, tuple[subprocess.Popen, str]] = {}
_RUNNING_LOCK = threading.Lock()
#: Set by :func:`stop_all`: no exercise starts while it is set (a class run clears it first).
STOPPING = threading.Event()
INTERRUPTED = "not graded: the grading was interrupted"


def stop_all() -> None:
    """End every exercise being graded, and start no other (a Ctrl-C in ``ddplab check``)."""
    STOPPING.set()
    with _RUNNING_LOCK:
        running = list(_RUNNING.values())
    for proc, mark in running:
        end_all(proc, mark)


#: Set once the guard has taken over: the verdict is its, whatever the judge still does.
_GUARD = threading.Lock()
_GUARDED: list[bool] = []


def _watch(limit: float, parent: int, verdict: Path, key: str) -> None:
    """The grading process's own guard (a thread): at ``limit`` seconds it writes that verdict
    and ends every process of its exercise; when its caller ``parent`` is gone (killed, its
    terminal closed) it ends them too. Either way it then exits, so that no part of a
    submission outlives its grading. (Once the guard has begun, the judge writes no verdict:
    ending a launch makes the judge fail, and its verdict must not be the one read.)"""
    deadline = time.monotonic() + limit
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.2)
    with _GUARD:
        _GUARDED.append(True)
    mark = os.environ.get(MARK)
    if mark:   # first: none of the exercise's processes may write after the verdict
        end_marked(mark)
    if os.getppid() == parent:
        spec = LAUNCHES[key]
        verdict.write_text(json.dumps(asdict(Outcome(key, spec.skeleton, False,
                                                     _too_long(limit), limit))))
    os._exit(3)


def _tail(path: Path, size: int = 2000) -> str:
    data = path.read_bytes()[-size:].decode(errors="replace").strip()
    return data or "(no output)"


# ------------------------------------------------------------------------- a learner's folder


def check_course(course: Path, selected: Sequence[str], timeout: Optional[float] = None,
                 out: Any = None) -> list[Outcome]:
    """Judge ``selected`` exercises in the learner's own folder, printing one verdict each."""
    out = out or sys.stdout
    outcomes = []
    work = Path(private_folder("ddplab-check-"))
    try:
        for key in selected:
            spec = LAUNCHES[key]
            sizes = " and ".join(map(str, spec.sizes))
            print(f"checking {key} (exercises/{spec.skeleton}) at {sizes} rank(s)...",
                  file=sys.stderr, flush=True)
            outcome = (copy_outcome(key, course / "exercises" / spec.skeleton) or
                       run_exercise(key, course, work, timeout))
            print(f"Exercise {key} ({spec.skeleton}): {outcome.message}", file=out, flush=True)
            outcomes.append(outcome)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return outcomes


# ------------------------------------------------------------------------ the grading process


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ddplab.lab.grading KEY VERDICT [TIMEOUT]``: what ``run_exercise`` runs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    key, verdict = argv[0], Path(argv[1])
    timeout = float(argv[2]) if len(argv) > 2 else None
    if os.environ.get(LIMIT) and os.environ.get(PARENT):
        threading.Thread(target=_watch, args=(float(os.environ[LIMIT]), int(os.environ[PARENT]),
                                              verdict, key), daemon=True).start()
    outcome: Optional[Outcome] = None
    error: Optional[BaseException] = None
    try:
        outcome = judge_here(key, timeout)
    except BaseException as failed:   # ending the exercise's processes can make the judge fail:
        error = failed                 # then the guard's verdict and exit (3) are the ones
    with _GUARD:
        guarded = bool(_GUARDED)
        if not guarded and outcome is not None:
            verdict.write_text(json.dumps(asdict(outcome)))
    if guarded:   # the guard writes the verdict, then ends this process (exit 3)
        threading.Event().wait()
    if error is not None:
        raise error
    return 0


if __name__ == "__main__":
    sys.exit(main())
