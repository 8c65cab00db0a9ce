"""Judges of the coding exercises: each looks at what a learner's run did, not at its text.

A coding exercise is a skeleton worker in ``exercises/`` with marked gaps: the learner's copy sits
in their course folder, beside ``notebooks/`` (``ddplab init`` writes it; a clone is one too).
The learner fills the gaps, launches the file and hands the ``RunResult`` to ``ddplab.check``::

    result = ddplab.launch("../exercises/ddp_wrap.py", nprocs=2)
    ddplab.check("03", result)      # prints what is wrong and where to look, or "correct!"

The skeleton's fixed part reports facts through ``ddplab.events`` (``metric`` events, one per
fact and rank); a judge reads them with :func:`metric` and returns a hint string when the run
is not right yet, or None when it is. One module per topic in this package registers its
judges with :func:`judge`; they are all imported on first use.

Lessons: the coding exercise at the end of notebooks 03-12, and the capstone (13).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

Judge = Callable[[Any], Optional[str]]

@dataclass
class CodingExercise:
    key: str
    skeleton: str  # file name inside exercises/
    task: str  # one line: what the learner must make the run do
    judge: Judge


JUDGES: dict[str, CodingExercise] = {}
_LOADED = False


def judge(key: str, skeleton: str, task: str) -> Callable[[Judge], Judge]:
    """Register the judge of coding exercise ``key`` (its skeleton is ``exercises/<skeleton>``).

    The decorated function takes the learner's ``RunResult`` and returns None when the run did
    what the exercise asks, or a hint that says what is wrong and where to look.
    """
    def register(fn: Judge) -> Judge:
        JUDGES[key] = CodingExercise(key, skeleton, task, fn)
        return fn
    return register


def load_all() -> dict[str, CodingExercise]:
    """Import every judge module of this package (once) and return the registry."""
    global _LOADED
    if not _LOADED:
        for info in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{info.name}")
        _LOADED = True
    return JUDGES


def skeleton_path(key: str) -> Path:
    """The learner's file of exercise ``key`` (what its notebook launches), in the course folder
    of the working directory (``ddplab.workspace.exercises_dir``)."""
    from ...workspace import exercises_dir

    return exercises_dir() / load_all()[key].skeleton


def is_run_result(answer: Any) -> bool:
    """Whether ``answer`` is a launch's result (a ``RunResult``) rather than a plain value."""
    return all(hasattr(answer, name) for name in ("logs", "events", "exit_codes", "status"))


def is_run_set(answer: Any) -> bool:
    """Whether ``answer`` is a non-empty dict of named launch results (an exercise of several
    launches, such as the capstone's unbroken, killed and resumed runs)."""
    return isinstance(answer, dict) and bool(answer) and all(
        is_run_result(value) for value in answer.values())


def run_failed(result: Any) -> Optional[str]:
    """A hint when the run itself failed (every judge starts with this), else None.

    A timeout is explained from the ranks' stacks when the launcher kept them (see
    :mod:`ddplab.lab.judges.hangs`): which rank waits in which collective, at which line.
    """
    from .hangs import run_failed as explain

    return explain(result)


def metric(result: Any, name: str) -> dict[int, Any]:
    """Every rank's value of the ``metric`` event ``name`` (the last one each rank emitted)."""
    found: dict[int, Any] = {}
    for rank, events in result.events.items():
        for event in events:
            if event.get("kind") == "metric" and event.get("name") == name:
                found[int(event.get("rank", rank))] = event.get("value")
    return found


def metrics(result: Any, name: str) -> dict[int, list[Any]]:
    """Every value of the ``metric`` event ``name`` each rank emitted, in order."""
    found: dict[int, list[Any]] = {}
    for rank, events in result.events.items():
        for event in events:
            if event.get("kind") == "metric" and event.get("name") == name:
                found.setdefault(int(event.get("rank", rank)), []).append(event.get("value"))
    return found
