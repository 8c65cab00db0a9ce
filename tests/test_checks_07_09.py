"""Exercises 07-09 accept their reference answer and reject a wrong one, with a hint."""

from __future__ import annotations

import pytest

from ddplab.checks import check, reference_answer

WRONG = {"07": 2, "08": 200, "09": 13.2 / 6.1}


@pytest.mark.parametrize("key", sorted(WRONG))
def test_reference_is_accepted_and_a_wrong_answer_rejected(key, capsys):
    assert check(key, reference_answer(key)) is True
    assert check(key, WRONG[key]) is False
    assert "not yet" in capsys.readouterr().out


def test_reference_answers_are_the_lessons_numbers():
    assert reference_answer("07") == 6
    assert reference_answer("08") == pytest.approx(175.0)
    assert reference_answer("09") == pytest.approx(0.541, abs=1e-3)


def test_answers_in_other_spellings(capsys):
    assert check("07", "6") and check("08", 175) and check("09", 0.54)
    assert not check("07", None) and not check("08", "a lot") and not check("09", 1.5)
    assert "not answered yet" in capsys.readouterr().out
