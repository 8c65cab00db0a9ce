"""``ddplab check --submissions``: a teacher's class, graded in one run.

A teacher runs ``ddplab check --submissions ROOT``: each folder (or ``.zip``) in ROOT is one
submission, a course folder or just its exercise files. Each is graded in a fresh working copy
(the shipped exercises with the submission's files over them) with a ``TMPDIR`` of its own,
each exercise in a grading process of its own (:func:`ddplab.lab.grading.run_exercise`: its
hard limit, its processes ended after it). A Ctrl-C ends them all and keeps the verdicts
reached. The results: a table, ``--json`` and ``--junit`` (one test case per exercise),
written as each submission finishes.

What does not depend on the learner is done once per class: the capstone's judge launches the
reference job to compare a run with, and every grading process of the class gets one folder
for those runs (:data:`REFERENCE_CACHE`), so each is launched once per class, not once per
submission. The folder is removed at the end (after a Ctrl-C too), unless the teacher set the
variable: then the teacher's folder is used, and kept.

Submissions are code run as the calling user: this isolates folders, processes and time, not
the machine (a file written to a hard-coded path such as ``/tmp/x`` is not caught; the
reference folder, named in every grading process's environment, is reachable too); grade code
you do not trust inside a container (README, "Grading from a terminal").

Example::

    ddplab check --submissions class/ --jobs 2 --json grades.json --junit grades.xml

Lessons: the coding exercises of 03-13.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence
from xml.etree import ElementTree

from ..launcher.procs import private_folder
from .grading import (COPIED, LAUNCHES, STOPPING, Outcome, copy_outcome, run_exercise,
                      shipped_exercise, stop_all)
from .judges.capstone.reference import CACHE_ENV

#: The largest zip a submission may be, unpacked.
ZIP_LIMIT = 64 << 20
#: The folder where the capstone's judge keeps the reference runs it launched (environment):
#: shared by every grading process of a class.
REFERENCE_CACHE = CACHE_ENV


# ----------------------------------------------------------------------------- a class


@dataclass
class Submission:
    """The verdicts on one submission (or on a learner's own folder), one per exercise."""

    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""  # why it could not be graded at all (a broken zip)

    @property
    def passed(self) -> int:
        return sum(o.correct for o in self.outcomes)


def submissions(root: Path) -> list[Path]:
    """The submissions in ``root``: its folders and ``.zip`` files, by name (hidden ones left
    out)."""
    return sorted(p for p in root.iterdir() if not p.name.startswith(".") and (
        p.is_dir() or (p.is_file() and p.suffix.lower() == ".zip")))


def _unzip(archive: Path, into: Path) -> None:
    """Unpack a submission's zip; refuse paths that leave ``into`` and zips too large."""
    with zipfile.ZipFile(archive) as zipped:
        members = zipped.infolist()
        if sum(m.file_size for m in members) > ZIP_LIMIT:
            raise ValueError(f"unpacks to more than {ZIP_LIMIT >> 20} MB")
        for member in members:
            target = (into / member.filename).resolve()
            if into.resolve() not in target.parents and target != into.resolve():
                raise ValueError(f"holds a path outside its folder: {member.filename}")
        zipped.extractall(into)


def exercise_files(folder: Path) -> dict[str, Path]:
    """The exercise files of a submission: ``exercises/*.py`` of the shallowest course folder
    in it, or else the shallowest skeleton-named ``.py`` files."""
    names = {spec.skeleton for spec in LAUNCHES.values()}
    level = [folder]
    for _depth in range(4):
        for here in level:
            if (here / "exercises").is_dir():
                return {p.name: p for p in sorted((here / "exercises").glob("*.py"))}
        for here in level:
            found = {p.name: p for p in sorted(here.glob("*.py")) if p.name in names}
            if found:
                return found
        level = [d for here in level for d in sorted(here.iterdir())
                 if d.is_dir() and not d.name.startswith((".", "__"))]
    return {}


def handed_in(path: Path) -> list[str]:
    """The exercises a submission (folder or zip) changed from the shipped skeletons."""
    contents: dict[str, bytes] = {}
    if path.is_dir():
        contents = {name: file.read_bytes() for name, file in exercise_files(path).items()}
    else:
        try:
            with zipfile.ZipFile(path) as zipped:
                contents = {Path(m.filename).name: zipped.read(m) for m in zipped.infolist()
                            if Path(m.filename).name in {s.skeleton for s in LAUNCHES.values()}
                            and m.file_size < ZIP_LIMIT}
        except (zipfile.BadZipFile, OSError):
            pass
    return [key for key, spec in LAUNCHES.items() if spec.skeleton in contents and
            contents[spec.skeleton] != shipped_exercise(spec.skeleton).read_bytes()]


def grade(path: Path, selected: Sequence[str], base: Path,
          timeout: Optional[float] = None, env: Optional[dict[str, str]] = None) -> Submission:
    """Grade one submission in a fresh working copy under ``base``, removed afterwards;
    ``env`` is added to the environment of its grading processes."""
    name = path.name[:-4] if path.suffix.lower() == ".zip" else path.name
    result = Submission(name)
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="sub-", dir=base))
    try:
        source = path
        if path.is_file():
            source = work / "unzipped"
            source.mkdir()
            try:
                _unzip(path, source)
            except (zipfile.BadZipFile, ValueError, OSError) as err:
                result.error = f"{path.name}: not a usable zip ({err})"
        files = exercise_files(source) if not result.error else {}
        course = work / "course"
        (course / "exercises").mkdir(parents=True)
        for spec in LAUNCHES.values():
            shutil.copyfile(shipped_exercise(spec.skeleton), course / "exercises" / spec.skeleton)
        for file_name, file in files.items():
            shutil.copyfile(file, course / "exercises" / file_name)
        if not result.error and source is not path:
            shutil.rmtree(source)
        tmp = work / "tmp"
        tmp.mkdir()
        for key in selected:
            spec = LAUNCHES[key]
            mine = course / "exercises" / spec.skeleton
            if result.error or spec.skeleton not in files:
                why = result.error or f"exercises/{spec.skeleton} is not in the submission"
                result.outcomes.append(Outcome(key, spec.skeleton, False, f"not handed in: {why}",
                                               verdict="not handed in"))
            elif mine.read_bytes() == shipped_exercise(spec.skeleton).read_bytes():
                result.outcomes.append(Outcome(key, spec.skeleton, False,
                                               "not attempted: the file is the shipped skeleton",
                                               verdict="not attempted"))
            else:
                result.outcomes.append(copy_outcome(key, mine) or run_exercise(
                    key, course, work, timeout, {**(env or {}), "TMPDIR": str(tmp),
                                                 "TEMP": str(tmp), "TMP": str(tmp)}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.seconds = time.monotonic() - start
    return result


def grade_all(root: Path, selected: Sequence[str], jobs: int = 1,
              timeout: Optional[float] = None, progress: Any = None,
              on_done: Optional[Callable[[list[Submission]], None]] = None) -> list[Submission]:
    """Grade every submission of ``root``, ``jobs`` at a time (at most one per core).

    ``on_done(finished)`` is called as each submission finishes, with every one finished so
    far in ``root``'s order (``ddplab check`` writes its reports then). A ``KeyboardInterrupt``
    ends every exercise being graded and is raised again, carrying ``.results``: the
    submissions finished before it.

    The grading processes share one folder of reference runs (:data:`REFERENCE_CACHE`): the
    teacher's, when the variable is set, else one in the class's temporary folder, removed
    with it."""
    jobs = max(1, min(jobs, os.cpu_count() or 1))
    base = Path(private_folder("ddplab-grading-"))   # a kill -9 leaves none
    shared: dict[str, str] = {}
    if not os.environ.get(REFERENCE_CACHE):
        (base / "references").mkdir()
        shared[REFERENCE_CACHE] = str(base / "references")
    order = submissions(root)
    finished: dict[Path, Submission] = {}
    lock = threading.Lock()
    STOPPING.clear()
    try:
        def one(path: Path) -> Submission:
            done = grade(path, selected, base, timeout, shared)
            if STOPPING.is_set():
                return done
            with lock:
                finished[path] = done
                so_far = [finished[p] for p in order if p in finished]
                if progress is not None:
                    print(f"graded {done.name}: {done.passed}/{len(selected)}", file=progress,
                          flush=True)
                if on_done is not None:
                    on_done(so_far)
            return done

        pool = ThreadPoolExecutor(max_workers=jobs)
        try:
            futures = [pool.submit(one, path) for path in order]
            return [future.result() for future in futures]
        except KeyboardInterrupt as stop:
            stop_all()
            for future in futures:
                future.cancel()
            pool.shutdown(wait=True)
            with lock:
                stop.results = [finished[p] for p in order if p in finished]  # type: ignore
            raise
        finally:
            pool.shutdown(wait=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ----------------------------------------------------------------------------- reports


def table(results: Sequence[Submission], selected: Sequence[str]) -> str:
    """One row per submission, one column per exercise (pass/FAIL), then each failure."""
    width = max([len("submission")] + [len(r.name) for r in results])
    head = f"{'submission':<{width}}  " + "  ".join(f"{k:>4}" for k in selected) + "  passed"
    rows = [head]
    for r in results:
        marks = "  ".join(f"{_mark(o):>4}" for o in r.outcomes)
        rows.append(f"{r.name:<{width}}  {marks}  {r.passed}/{len(selected)}")
    for r in results:
        for o in r.outcomes:
            if not o.correct:
                rows.append(f"{r.name} {o.key} ({o.file}): {o.message.splitlines()[0]}")
    return "\n".join(rows)


def _mark(outcome: Outcome) -> str:
    return "pass" if outcome.correct else "COPY" if outcome.verdict == COPIED else "FAIL"


def to_json(results: Sequence[Submission], selected: Sequence[str]) -> dict[str, Any]:
    return {"exercises": {k: LAUNCHES[k].skeleton for k in selected},
            "submissions": [{"name": r.name, "passed": r.passed, "total": len(r.outcomes),
                             "seconds": round(r.seconds, 2),
                             "exercises": [asdict(o) for o in r.outcomes]} for r in results]}


def junit(results: Sequence[Submission]) -> ElementTree.ElementTree:
    """JUnit XML: one ``<testsuite>`` per submission, one ``<testcase>`` per exercise, a
    ``<failure>`` for each wrong one (as GitHub Classroom, GitLab and Jenkins read it)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    host = socket.gethostname()
    failures = sum(len(r.outcomes) - r.passed for r in results)
    suites = ElementTree.Element("testsuites", name="ddplab check",
                                 tests=str(sum(len(r.outcomes) for r in results)),
                                 failures=str(failures), errors="0",
                                 time=f"{sum(r.seconds for r in results):.3f}")
    for number, r in enumerate(results):
        suite = ElementTree.SubElement(
            suites, "testsuite", name=r.name, tests=str(len(r.outcomes)),
            failures=str(len(r.outcomes) - r.passed), errors="0", skipped="0",
            time=f"{r.seconds:.3f}", timestamp=stamp, hostname=host, id=str(number),
            package="ddplab.exercises")
        ElementTree.SubElement(suite, "properties")
        for o in r.outcomes:
            case = ElementTree.SubElement(suite, "testcase", name=f"{o.key} {o.file}",
                                          classname=f"{r.name}.exercises", time=f"{o.seconds:.3f}")
            if not o.correct:
                failure = ElementTree.SubElement(case, "failure", type=o.verdict,
                                                 message=o.message.splitlines()[0])
                failure.text = o.message
        ElementTree.SubElement(suite, "system-out")
        ElementTree.SubElement(suite, "system-err")
    tree = ElementTree.ElementTree(suites)
    ElementTree.indent(tree)
    return tree
