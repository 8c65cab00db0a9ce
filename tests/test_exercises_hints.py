"""No verdict on an untouched skeleton spells out the code its TODO blocks need.

A hint says what the run did wrong and what must be true; the calls to type, their arguments
and their order are the exercise. :func:`answer_named` finds, in a verdict, the names the
reference solution (``tests/solutions/``) adds over the skeleton: a name the skeleton never
mentions, or a call with arguments (``write_file(state, path)``) or a keyword argument
(``map_location=``) that only the solution's lines make. A name the skeleton's spec already
gives (``DistributedSampler`` in 04's docstring, ``save()``) may be named. The skeleton tests
of each exercise (``test_exercises_ddp.py``, ``test_exercises_06_08.py``, ``test_sharding.py``,
``test_debugging.py``, ``test_capstone.py``) hold their verdict to it; this module checks the
finder itself.
"""

from __future__ import annotations

import builtins
import difflib
import re
from functools import lru_cache
from pathlib import Path

import pytest

from ddplab.lab.grading import LAUNCHES, shipped_exercise

SOLUTIONS = Path(__file__).resolve().parent / "solutions"
CALL, KEYWORD = re.compile(r"\b([A-Za-z_]\w*)\("), re.compile(r"\b([A-Za-z_]\w*)=[^=]")
#: Names every Python file calls; a hint naming them gives nothing away.
COMMON = set(dir(builtins)) | {"self", "super"}


@lru_cache(maxsize=None)
def todo_names(key: str) -> tuple[str, frozenset[str], frozenset[str], frozenset[str]]:
    """What exercise ``key``'s solution adds over its skeleton: (the skeleton's text, names
    called, keywords passed, of those the names the skeleton never mentions)."""
    skeleton = shipped_exercise(LAUNCHES[key].skeleton).read_text()
    solution = (SOLUTIONS / LAUNCHES[key].skeleton).read_text()
    a, b = skeleton.splitlines(), solution.splitlines()
    added = [line.split("#")[0] for tag, _, _, j1, j2 in difflib.SequenceMatcher(
        a=a, b=b, autojunk=False).get_opcodes() if tag != "equal" for line in b[j1:j2]]
    calls = {n for line in added for n in CALL.findall(line)} - COMMON
    keywords = {n for line in added for n in KEYWORD.findall(line)} - COMMON
    unseen = {n for n in calls | keywords if not re.search(rf"\b{n}\b", skeleton)}
    return skeleton, frozenset(calls), frozenset(keywords), frozenset(unseen)


def changes_outside_todo(skeleton: list[str], solution: list[str]) -> list[tuple[int, int]]:
    """The line ranges (1-based, inclusive) where ``solution`` changes ``skeleton`` outside its
    ``TODO(exercise)`` blocks; the docstring's first line, which names the file, may differ."""
    matcher = difflib.SequenceMatcher(a=skeleton, b=solution, autojunk=False)
    return [(i1 + 1, i2) for tag, i1, i2, _, _ in matcher.get_opcodes()
            if tag != "equal" and i1 > 0
            and not any("# TODO(exercise)" in line for line in skeleton[i1:i2])]


def answer_named(key: str, message: str) -> list[str]:
    """The parts of the solution's code that ``message`` spells out (it should be none): a
    name the skeleton never mentions, a call with arguments or a keyword argument that the
    skeleton does not spell so itself."""
    skeleton, calls, keywords, unseen = todo_names(key)
    found = [n for n in sorted(unseen) if re.search(rf"\b{n}\b", message)]
    found += [m.group(0) for m in re.finditer(r"\b(\w+)\([^()]+\)", message)
              if m.group(1) in calls and m.group(0) not in skeleton]
    found += [f"{n}=" for n in sorted(keywords)
              if re.search(rf"\b{n}=", message) and f"{n}=" not in skeleton]
    return found


@pytest.mark.parametrize("key, earlier, caught", [
    ("05", "save() (TODO 1) must have rank 0 call write_file(state, path) every time.",
     ["write_file(state, path)"]),
    ("04", "the epoch stays 0 until you call sampler.set_epoch(epoch) at the start of each one",
     ["set_epoch", "set_epoch(epoch)"]),
    ("06", "they were not clipped. Clip them with torch.nn.utils.clip_grad_norm_ before the "
     "scaler steps (TODO 3).", ["clip_grad_norm_"]),
    ("11b", "Point 2 wants the average in float32: MixedPrecisionPolicy(param_dtype=torch."
     "bfloat16, reduce_dtype=torch.float32).",
     ["param_dtype", "reduce_dtype", "MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
      "reduce_dtype=torch.float32)", "param_dtype=", "reduce_dtype="]),
])
def test_the_finder_catches_hints_that_spelled_out_the_code(key, earlier, caught):
    """Wordings these judges gave before are caught; what the spec names, and the
    requirement alone, are not."""
    assert answer_named(key, earlier) == caught
    assert not answer_named(key, "the run did not do what save()'s docstring asks (TODO 1).")


def test_the_spec_s_own_calls_may_be_named():
    """13's spec says ``log_step(step, loss)`` itself; 04's names DistributedSampler."""
    assert not answer_named("13", "call log_step(step, loss) after every optimizer step.")
    assert not answer_named("04", "torch's DistributedSampler, or a sampler of your own")
