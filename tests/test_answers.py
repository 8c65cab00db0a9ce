"""An exercise's answer is shown only after a true verdict, from a call that names no file."""

from __future__ import annotations

import pytest

from ddplab.lab import answers


def test_the_answer_is_shown_only_after_a_true_verdict(capsys):
    assert answers.show_after(False, "10") is False
    withheld = capsys.readouterr().out
    assert "judge says your run is correct" in withheld
    assert "Join" not in withheld and "RunningLoss" not in withheld   # not a word of it

    assert answers.show_after(True, "10") is True
    shown = capsys.readouterr().out   # outside Jupyter the section is printed
    assert "class RunningLoss(Joinable)" in shown and "join_hook" in shown
    assert "Lesson: 10" not in shown and "[/running-loss]" not in shown   # the section only


def test_every_kept_answer_has_its_section():
    for exercise in answers.SHOWN:
        assert answers.show_after(True, exercise)


def test_an_exercise_without_a_kept_answer_is_refused():
    with pytest.raises(KeyError):
        answers.show_after(True, "99")


def test_no_notebook_names_an_answer_file_in_view():
    import json
    from pathlib import Path

    for path in sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb")):
        code = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                       if c["cell_type"] == "code")
        assert "lab.answers." not in code and "lab/answers/" not in code, path.name
