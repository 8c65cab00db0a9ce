"""Exercises 01-03 accept their reference answer and reject wrong ones with a hint."""

from __future__ import annotations

import pytest

from ddplab.checks import check, reference_answer

WRONG = {"01": 1000 / 1.16, "02": [2, 2, 1, 1], "03": (1024, 0.001)}


@pytest.mark.parametrize("key", sorted(WRONG))
def test_reference_is_accepted_and_a_wrong_answer_rejected(key, capsys):
    assert check(key, reference_answer(key)) is True
    assert check(key, WRONG[key]) is False
    assert "not yet" in capsys.readouterr().out


def test_reference_answers_are_what_the_lessons_teach():
    assert reference_answer("01") == pytest.approx(1000 / 1.1)   # median of epochs 2-6
    assert reference_answer("02") == [2, 2, 2, 0]                # chunk(4) of 6 leaves GPU 3 idle
    assert reference_answer("03") == (1024, pytest.approx(0.004))


def test_hints_name_the_mistake(capsys):
    check("01", 1000 / 1.45)                      # warm-up epoch included
    assert "warm-up" in capsys.readouterr().out
    check("02", [2, 2, 2])
    assert "4 numbers" in capsys.readouterr().out
    check("03", (256, 0.004))
    assert "256 x 4" in capsys.readouterr().out


def test_answers_in_other_spellings():
    assert check("02", (2, 2, 2, 0)) and check("03", [1024, "0.004"])
    assert not check("01", "fast") and not check("03", 1024) and not check("02", None)
