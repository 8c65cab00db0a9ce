"""No quiz shows its answer above the question.

A quiz is a notebook code cell ``ddplab.check("KEY", answer)`` whose key is registered with a
reference answer in ``ddplab/lab/checks.py`` (``@exercise(KEY, ...)``; the coding exercises,
judged on a run, are not quizzes). Its expected answer must not appear in any cell above that
cell: not in a source cell (what the notebook types, prints or asserts), and not in an output
(what a cell printed when the notebook ran).

"Appears" means one of the answer's printed forms occurs as a token of its own:

- a number: how Python prints it and its roundings to 0-3 decimals, each only when it has at
  least 3 significant characters (``909``, ``909.1``, ``0.54``, ``0.875``). Shorter forms, such as
  the 6 of ``6 GPUs``, occur everywhere and prove nothing, so they are not searched;
- a pair or list: its printed form as a whole (``[2, 2, 2, 0]``, ``(512, 0.16)``,
  ``(torch.float16, torch.float32)``; a list also without trailing zeros, ``[2, 2, 2]``, the way
  a chunk list prints), and each number in it, by the rule above (a demonstration that prints
  half of the answer gives half of it away).

In outputs, which hold measured numbers that may match a short answer by chance, a number
counts from 4 significant digits (``909.1``, not ``909``); whole lists and pairs count as above.

The sources are checked on every run (cheap and deterministic). The outputs are checked on the
executed copies ``python -m ddplab course`` writes to ``build/notebooks/``; executing every
notebook here would take minutes, so without those copies that test is skipped and says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from ddplab.lab.checks import EXERCISES, reference_answer
from ddplab.workspace import NOTEBOOK_GLOB

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob(NOTEBOOK_GLOB))
EXECUTED = ROOT / "build" / "notebooks"
CHECK = re.compile(r"ddplab\.check\(\s*\"(\w+)\"\s*,\s*answer\s*\)")


def number_forms(value: float, digits: int = 3) -> set[str]:
    """How a number may be printed, keeping forms of ``digits`` or more significant digits."""
    forms = {repr(value), str(value)}
    forms |= {f"{value:.{d}f}" for d in range(4)}
    if float(value).is_integer():
        forms.add(str(int(value)))
    return {f for f in forms if significant(f) >= digits}


def significant(form: str) -> int:
    """Significant digits of a printed number: ``6.000`` has 1, ``175.0`` 3, ``0.054`` 2."""
    digits = form.lstrip("-")
    if "." in digits:
        digits = digits.rstrip("0").rstrip(".")
    return len(digits.replace(".", "").lstrip("0"))


def printed_forms(answer: Any, digits: int = 3) -> set[str]:
    """Every printed form of a quiz answer that counts as showing it (see the module doc)."""
    if isinstance(answer, bool):
        return {str(answer)}
    if isinstance(answer, (int, float)):
        return number_forms(answer, digits)
    if isinstance(answer, (list, tuple)):
        forms = {repr(answer), str(answer), repr(type(answer)(str(a) for a in answer))}
        forms.add(", ".join(str(a) for a in answer))
        if isinstance(answer, list):
            trimmed = list(answer)
            while trimmed and trimmed[-1] == 0:
                trimmed.pop()
            forms.add(repr(trimmed))
        for item in answer:
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                forms |= number_forms(item, digits)
        return {f for f in forms if f not in ("[]", "()", "")}
    return {str(answer)}


def occurs(form: str, text: str) -> bool:
    """``form`` in ``text`` as a token of its own (``0.16`` is not in ``0.1634`` or ``10.16``)."""
    return re.search(rf"(?<![\w.]){re.escape(form)}(?![\w]|\.\d)", text) is not None


def quizzes(cells: list[dict]) -> Iterator[tuple[int, str]]:
    """(cell index, key) of every quiz cell of a notebook."""
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            for key in CHECK.findall("".join(cell["source"])):
                if key in EXERCISES:
                    yield index, key


def outputs_text(cell: dict) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append("".join(output.get("text", "")))
        for data in output.get("data", {}).values():
            if isinstance(data, (str, list)):
                parts.append("".join(data))
    return "\n".join(parts)


def shown_above(cells: list[dict], read, digits: int = 3) -> list[str]:
    """Every quiz answer found above its quiz, as 'cell N shows FORM (quiz KEY)'."""
    found = []
    for index, key in quizzes(cells):
        forms = printed_forms(reference_answer(key), digits)
        for above in range(index):
            text = read(cells[above])
            found += [f"cell {above} shows {form!r}, the answer of quiz {key!r} in cell {index}"
                      for form in sorted(forms) if occurs(form, text)]
    return found


def test_every_quiz_of_the_course_is_found():
    keys = {key for path in NOTEBOOKS for _, key in quizzes(json.loads(path.read_text())["cells"])}
    assert keys == set(EXERCISES)          # each registered quiz is asked in a notebook


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_source_cell_above_a_quiz_shows_its_answer(path):
    cells = json.loads(path.read_text())["cells"]
    assert shown_above(cells, lambda cell: "".join(cell["source"])) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_output_above_a_quiz_shows_its_answer(path):
    executed = EXECUTED / path.name
    if not executed.is_file():
        pytest.skip(f"no executed copy {executed.relative_to(ROOT)}: run `python -m ddplab "
                    "course` first (executing every notebook here would take minutes)")
    # Outputs hold measured numbers, which may match a 3-digit answer by chance: 4 digits here.
    assert shown_above(json.loads(executed.read_text())["cells"], outputs_text, digits=4) == []


def test_the_rule_finds_what_it_should():
    cells = [{"cell_type": "code", "source": ["print('throughput: 909.09 samples/s')"],
              "outputs": []},
             {"cell_type": "markdown", "source": ["A global batch of 1024, lr 0.0040."]},
             {"cell_type": "code", "source": ["ddplab.check(\"01\", answer)"], "outputs": []}]
    assert "[2, 2, 2]" in printed_forms([2, 2, 2, 0]) and "1024" in printed_forms((1024, 0.004))
    assert occurs("909.09", cells[0]["source"][0])
    assert occurs("1024", cells[1]["source"][0])
    assert not occurs("0.16", "loss 0.1634") and not occurs("0.16", "10.16") and occurs("0.16", "lr 0.16.")
    assert "[0, 0, 0, 0]" in printed_forms([0, 0, 0, 0])   # a list of zeros counts as a whole
    assert number_forms(6) == set() and "909.09" in number_forms(1000 / 1.1)
    assert shown_above(cells, lambda cell: "".join(cell["source"])) != []
