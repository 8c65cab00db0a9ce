"""Exercise checkers: each notebook ends with an exercise the learner answers in a cell.

``ddplab.check("03", answer)`` compares the answer with a reference computed here (never stored
in the notebook) and prints a helpful message. CI runs every checker against its own
reference answer, so a broken checker fails the build.

To add an exercise, register it below with ``@exercise(key, question)``; the decorated function
returns the reference answer, and ``compare`` (optional) returns a hint string when an answer is
wrong, or None when it is right.

Lessons: the exercise at the end of every notebook (01-09).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

Compare = Callable[[Any, Any], Optional[str]]


@dataclass
class Exercise:
    key: str
    question: str
    reference: Callable[[], Any]
    compare: Compare


EXERCISES: dict[str, Exercise] = {}


def close_to(rel: float = 1e-6, hint: str = "") -> Compare:
    """A comparison for numbers: right within ``rel`` relative tolerance."""
    def compare(answer: Any, expected: Any) -> Optional[str]:
        try:
            good = math.isclose(float(answer), float(expected), rel_tol=rel, abs_tol=1e-12)
        except (TypeError, ValueError):
            return f"expected a number, got {answer!r}. {hint}".strip()
        return None if good else (hint or f"{answer!r} is not right yet; check your reasoning.")
    return compare


def equal(hint: str = "") -> Compare:
    """A comparison by ``==``."""
    def compare(answer: Any, expected: Any) -> Optional[str]:
        return None if answer == expected else (hint or f"{answer!r} is not right yet.")
    return compare


def exercise(key: str, question: str, compare: Optional[Compare] = None
             ) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Register the reference-answer function of exercise ``key``."""
    def register(fn: Callable[[], Any]) -> Callable[[], Any]:
        EXERCISES[key] = Exercise(key, question, fn, compare or equal())
        return fn
    return register


def check(key: str, answer: Any) -> bool:
    """Check a learner's answer to exercise ``key``; print why it is wrong, if it is.

    Returns:
        True when the answer is right.
    """
    if key not in EXERCISES:
        raise KeyError(f"no exercise {key!r}; known: {', '.join(sorted(EXERCISES))}")
    if answer is None or answer is Ellipsis:
        print(f"Exercise {key}: not answered yet. {EXERCISES[key].question}")
        return False
    ex = EXERCISES[key]
    hint = ex.compare(answer, ex.reference())
    print(f"Exercise {key}: " + ("correct!" if hint is None else f"not yet: {hint}"))
    return hint is None


def reference_answer(key: str) -> Any:
    """The reference answer of exercise ``key`` (used by tests, never shown in notebooks)."""
    return EXERCISES[key].reference()


# ----------------------------------------------------------------------- exercises 01-06
# (each notebook's exercise is registered below, in notebook order)
