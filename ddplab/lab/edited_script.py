"""The learner's copy of the baseline script, one line less: what it lacks, what it learned.

Notebook 01's "Your turn" copies ``ddplab/workers/single.py``, the learner deletes its
``optimizer.zero_grad()`` line, predicts the first epoch against the shipped script's, and
:func:`first_epochs` trains the copy for one epoch and says how it compared. A copy that lacks
that one statement and nothing else is the experiment the notebook checks; the comparison is
of Python syntax (:func:`lacks_only`), so blank lines, spacing and comments do not count.

Lesson: 01.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

#: The statement the learner deletes.
ZERO_GRAD = "optimizer.zero_grad()"
#: The settings the copy is trained with: notebook 01's digits workload.
DIGITS = ["--dataset", "digits", "--model", "cnn", "--batch-size", 32, "--lr", 0.05]


def without(text: str, statement: str = ZERO_GRAD) -> str:
    """``text`` without the first line that holds only ``statement`` (indented or not).

    Example::

        >>> without("a = 1\\n    optimizer.zero_grad()\\nb = 2\\n")
        'a = 1\\nb = 2\\n'

    Lesson: 01.
    """
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() == statement:
            return "".join(lines[:i] + lines[i + 1:])
    raise ValueError(f"no line holds only {statement!r}")


def lacks_only(mine: str, shipped: str, statement: str = ZERO_GRAD) -> bool:
    """True when ``mine`` is ``shipped`` without ``statement``, blank lines, spaces, comments aside.

    Both are parsed; their syntax trees are compared (a file that does not parse: False).

    Example::

        >>> lacks_only("x = 1\\n\\n  \\n", "x = 1\\noptimizer.zero_grad()\\n")
        True

    Lesson: 01.
    """
    try:
        return ast.dump(ast.parse(mine)) == ast.dump(ast.parse(without(shipped, statement)))
    except SyntaxError:
        return False


def verdict(mine: dict, shipped: dict) -> str:
    """"same", "better" or "worse": ``mine``'s epoch on test accuracy, the loss breaking a tie.

    Lesson: 01.
    """
    score = lambda epoch: (epoch["accuracy"], -epoch["loss"])   # noqa: E731
    if score(mine) == score(shipped):
        return "same"
    return "better" if score(mine) > score(shipped) else "worse"


@dataclass(frozen=True)
class Outcome:
    """What :func:`first_epochs` saw: each script's first epoch and how they compare."""

    shipped: dict             # the shipped script's epoch 1 (an ``epoch`` event)
    mine: dict                # the copy's epoch 1
    truth: str                # verdict(mine, shipped)
    zero_grad_only: bool      # the copy lacks optimizer.zero_grad() and nothing else
    edited_for_you: bool      # the copy was untouched, so the line was deleted from it


def check(outcome: Outcome, prediction: Optional[str] = None) -> str:
    """The line notebook 01 prints about ``outcome``; raises AssertionError if it does not hold.

    Both epochs must come from the same run (samples and steps). A copy that lacks
    ``optimizer.zero_grad()`` and nothing else must compare as the lesson expects; any other
    copy is the learner's own experiment and is not checked. With no ``prediction`` the line
    gives neither the numbers nor the result.

    Lesson: 01.
    """
    mine, shipped = outcome.mine, outcome.shipped
    seen = (f"loss {mine['loss']:.3f} vs {shipped['loss']:.3f}, "
            f"accuracy {mine['accuracy']:.1%} vs {shipped['accuracy']:.1%}")
    if (shipped["samples"], shipped["steps"]) != (mine["samples"], mine["steps"]):
        raise AssertionError(f"the two epochs are not the same run: {seen}")
    if outcome.zero_grad_only:
        if outcome.truth != "worse":
            raise AssertionError(seen)
        if not mine["loss"] > 2 * shipped["loss"]:
            raise AssertionError(f"the loss should at least double: {seen}")
        if not mine["accuracy"] < shipped["accuracy"] - 0.3:
            raise AssertionError(f"the accuracy should fall by more than 30 points: {seen}")
        if prediction is None:
            return ("verified: your copy's epoch 1 against the shipped one (outcome shown once "
                    "you predict)")
        return ("verified: without zero_grad() the loss of epoch 1 at least doubled and the "
                "accuracy fell by more than 30 points")
    if prediction is None:
        return "your own experiment: not checked; the cell that copies the script resets it"
    return f"your own experiment: not checked ({seen}); the cell that copies the script resets it"


def first_epochs(copy: Union[str, Path], worker: str = "ddplab.workers.single",
                 baseline: Optional[tuple[Any, Sequence]] = None,
                 prediction: Optional[str] = None) -> Outcome:
    """Train ``copy`` for one epoch of :data:`DIGITS`; compare with the shipped ``worker``'s.

    A copy still equal to the shipped file gets its ``optimizer.zero_grad()`` line deleted (on
    disk) first. The shipped script's epoch 1 comes from ``baseline``, a (launch result, args)
    pair, when that run used :data:`DIGITS`, else from a new one-epoch run. Prints that the
    line was deleted when it was, then each script's epoch 1 and the verdict against
    ``prediction``; with no prediction, it prints neither (they show once it is set).

    Returns:
        :class:`Outcome`.

    Lesson: 01.
    """
    copy = Path(copy)
    shipped_text = Path(importlib.util.find_spec(worker).origin).read_text()
    edited_for_you = copy.read_text() == shipped_text
    if edited_for_you:                    # not edited (as under CI): delete the line for them
        copy.write_text(without(shipped_text))
        print("your copy was untouched: optimizer.zero_grad() was deleted from it (reload it)")
    run, args = baseline if baseline is not None else (None, None)
    if args is not None and list(args[:-2]) == DIGITS and args[-2] == "--epochs":
        shipped = run.check().events_of("epoch")[0]      # the same seed, data and settings
    else:
        shipped = _first_epoch(worker)
    mine = _first_epoch(copy)
    truth = verdict(mine, shipped)
    if prediction is None:                # the numbers would give the answer away
        print("you did not predict: set PREDICTION and run this cell again to see each "
              "script's epoch 1")
    else:
        for name, epoch in (("the shipped script", shipped), ("your copy", mine)):
            print(f"epoch 1, {name + ':':<19} loss {epoch['loss']:.3f}, "
                  f"test accuracy {epoch['accuracy']:.1%}")
        print(f"\nyou predicted {prediction!r}; it is {truth!r}")
    return Outcome(shipped, mine, truth, lacks_only(copy.read_text(), shipped_text),
                   edited_for_you)


def _first_epoch(script: Union[str, Path]) -> dict:
    import ddplab

    result = ddplab.launch(script, 1, args=[*DIGITS, "--epochs", 1], quiet=True)
    return result.check().events_of("epoch")[0]
