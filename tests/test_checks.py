"""Every exercise (01-09, 07b, 09b, 12) accepts its reference answer, rejects a wrong one, and
says why."""

from __future__ import annotations

import pytest
import torch

from ddplab.lab.checks import EXERCISES, check, reference_answer

WRONG = {"01": 1000 / 1.16, "02": [1, 2, 3], "03": (1024, 0.001), "04": (168, 0),
         "05": [3, 4, 5], "06": (torch.float32, torch.float32), "07": 2, "07b": 1, "08": 64,
         "09": 13.2 / 6.1, "09b": 2.0, "12": 2 * 4096 * 14336 * 2 / 1e6}


def test_every_notebook_has_one_exercise():
    assert sorted(EXERCISES) == [*(f"{n:02d}" for n in range(1, 8)), "07b", "08", "09", "09b",
                                 "12"] == sorted(WRONG)


@pytest.mark.parametrize("key", sorted(WRONG))
def test_reference_is_accepted_and_a_wrong_answer_rejected(key, capsys):
    right, wrong = check(key, reference_answer(key)), check(key, WRONG[key])
    assert bool(right) is True and bool(wrong) is False
    assert right.message.endswith("correct!") and "not yet" in wrong.message
    assert capsys.readouterr().out.splitlines() == [right.message, wrong.message]


@pytest.mark.parametrize("key", sorted(WRONG))
def test_unanswered_exercise_asks_the_question(key, capsys):
    verdict = check(key, None)
    assert bool(verdict) is False
    assert "not answered yet" in capsys.readouterr().out


def test_a_verdict_in_a_notebook_adds_no_output_cell_of_its_own():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    formatted, _metadata = shell.display_formatter.format(check("01", None))
    assert formatted == {}  # Jupyter shows the printed message only, no "Out: False"


def test_reference_answers_are_what_the_lessons_teach():
    assert reference_answer("01") == pytest.approx(1000 / 1.1)   # median of epochs 2-6
    assert reference_answer("02") == [1, 2, 3, 5, 6, 9]          # 9: chunks of 3, only three
    assert reference_answer("03") == (512, pytest.approx(0.16))
    assert reference_answer("04") == (169, 5)
    assert reference_answer("07") == 6
    assert reference_answer("07b") == 6                            # RANK 0, 4, ..., 20
    assert reference_answer("08") == pytest.approx(32.0)        # (n - 1) M / (2 (n - 1) / n M)
    assert reference_answer("09") == pytest.approx(0.875, abs=1e-3)
    assert reference_answer("09b") == pytest.approx(40 / 35)       # (30 + 10) / (30 + 5) ms
    assert reference_answer("12") == pytest.approx(44.04, abs=0.01)     # 3 x 4096 x 14336 x 2 B / 8


def test_hints_name_the_mistake(capsys):
    check("01", 1000 / 1.45)                      # warm-up epoch included
    assert "warm-up" in capsys.readouterr().out
    check("02", [1, 2, 3])
    assert "fewer chunks than GPUs" in capsys.readouterr().out
    check("02", [1, 2, 3, 4, 5, 6, 9])
    assert "multiple of 4" in capsys.readouterr().out
    check("03", (64, 0.16))
    assert "64 x 8" in capsys.readouterr().out
    check("07b", 3)                               # one per machine: LOCAL_RANK, not RANK
    hint = capsys.readouterr().out
    assert "local_rank == 0" in hint and "every process of the job" in hint
    assert "multiple" not in hint and "23" not in hint   # a hint, not the way to the answer
    check("12", 3 * 4096 * 14336 * 4 / 8 / 1e6)   # fp32 instead of bf16
    assert "2 bytes" in capsys.readouterr().out
    check("09", 14.0 / 2.0)                       # the speed-up, not the efficiency
    assert "that is the speed-up" in capsys.readouterr().out
    check("09", 0.5)                              # the question names efficiency; a hint defines it
    assert "efficiency = speed-up / 8" in capsys.readouterr().out
    check("09b", 2)                               # the compute's speed-up, not the step's
    assert "still waits for every batch" in capsys.readouterr().out
    check("08", 64)                               # the server's link both ways vs ring sends
    assert "both ways" in capsys.readouterr().out


def test_answers_in_other_spellings():
    assert check("02", (9, 6, 5, 3, 2, 1)) and check("03", [512, "0.16"])
    assert check("05", (4, 5)) and check("06", ("float16", "float32"))
    assert check("07", "6") and check("08", "32") and check("09", 0.875)
    assert not check("01", "fast") and not check("03", 1024) and not check("04", "169")
    assert not check("08", "a lot") and not check("09", 1.5)


def test_the_example_in_checks_docstring_is_judged_as_its_comment_says(capsys):
    """The docstring shows a wrong warm-up answer (a right one would answer an exercise where
    Shift-Tab shows it), and the judge does reject it."""
    import ast
    import re

    from ddplab.lab import checks

    example = re.search(r'ddplab\.check\("(\d+b?)", (\[.*?\]|\(.*?\))\) +# a warm-up answer: (.*)',
                        checks.check.__doc__)
    assert example, "check's docstring should show a warm-up answer"
    key, answer, said = example.groups()
    assert "why not" in said and not check(key, ast.literal_eval(answer))
