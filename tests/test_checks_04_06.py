"""Exercises 04-06 accept their reference answer and reject a wrong one."""

from __future__ import annotations

import pytest
import torch

from ddplab.checks import check, reference_answer

WRONG = {"04": (168, 0), "05": [3, 4, 5], "06": (torch.float32, torch.float32)}


@pytest.mark.parametrize("key", sorted(WRONG))
def test_reference_is_accepted_and_a_wrong_answer_rejected(key, capsys):
    assert check(key, reference_answer(key)) is True
    assert check(key, WRONG[key]) is False
    assert "not yet" in capsys.readouterr().out


def test_answers_in_plain_spelling_are_accepted():
    assert reference_answer("04") == (169, 5)
    assert check("05", (4, 5))
    assert check("06", ("bfloat16", "float32"))
    assert not check("06", None) and not check("04", "169")
