"""ddplab.lab.edited_script: notebook 01's copy of the baseline script, one line less."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddplab.lab import edited_script
from ddplab.workers import single

SHIPPED = Path(single.__file__).read_text()
WITHOUT = edited_script.without(SHIPPED)


def test_without_deletes_the_zero_grad_line_and_nothing_else():
    assert WITHOUT.count("optimizer.zero_grad()") == SHIPPED.count("optimizer.zero_grad()") - 1
    assert WITHOUT.index("# [/step]") < SHIPPED.index("# [/step]")        # the step's, the first
    assert len(WITHOUT.splitlines()) == len(SHIPPED.splitlines()) - 1
    with pytest.raises(ValueError):
        edited_script.without("x = 1\n")


@pytest.mark.parametrize("edit", [
    lambda text: edited_script.without(text),                               # the line deleted
    lambda text: text.replace("optimizer.zero_grad()", "", 1),              # a blank line left
    lambda text: text.replace("optimizer.zero_grad()", "   ", 1) + "\n\n",  # spaces, blank lines
    lambda text: text.replace("optimizer.zero_grad()", "# optimizer.zero_grad()", 1),  # commented
])
def test_a_copy_without_zero_grad_is_the_experiment_whatever_its_blank_lines(edit):
    assert edited_script.lacks_only(edit(SHIPPED), SHIPPED)


@pytest.mark.parametrize("edit", [
    lambda text: text,                                                        # untouched
    lambda text: edited_script.without(text).replace("lr=args.lr", "lr=1.0"),  # one more change
    lambda text: text.replace("optimizer.zero_grad()", "pass", 1),            # another statement
    lambda text: text.replace("optimizer.step()", "", 1),                     # another line gone
    lambda text: edited_script.without(text) + "def (:\n",                    # does not parse
])
def test_any_other_copy_is_not_the_experiment(edit):
    assert not edited_script.lacks_only(edit(SHIPPED), SHIPPED)


def test_verdict_is_judged_on_accuracy_then_loss():
    e = lambda accuracy, loss: {"accuracy": accuracy, "loss": loss}     # noqa: E731
    assert edited_script.verdict(e(0.1, 2.0), e(0.9, 0.3)) == "worse"
    assert edited_script.verdict(e(0.9, 0.2), e(0.9, 0.3)) == "better"   # the tie broken by loss
    assert edited_script.verdict(e(0.9, 0.3), e(0.9, 0.3)) == "same"


class _Run:
    def __init__(self, epoch):
        self.epoch = epoch

    def check(self):
        return self

    def events_of(self, kind):
        assert kind == "epoch"
        return [self.epoch]


def test_first_epochs_edits_an_untouched_copy_and_reuses_a_digits_baseline(tmp_path, monkeypatch,
                                                                           capsys):
    launched = []
    bad = {"accuracy": 0.1, "loss": 2.5}
    monkeypatch.setattr(edited_script, "_first_epoch",
                        lambda script: launched.append(Path(script)) or bad)
    copy = tmp_path / "single.py"
    copy.write_text(SHIPPED)
    good = {"accuracy": 0.8, "loss": 0.7}
    baseline = (_Run(good), [*edited_script.DIGITS, "--epochs", 4])
    outcome = edited_script.first_epochs(copy, baseline=baseline, prediction="worse")
    assert copy.read_text() == WITHOUT and outcome.edited_for_you and outcome.zero_grad_only
    assert launched == [copy]                              # the baseline's epoch 1 reused
    assert (outcome.shipped, outcome.mine, outcome.truth) == (good, bad, "worse")
    shown = capsys.readouterr().out
    assert "you predicted 'worse'; it is 'worse'" in shown
    assert "optimizer.zero_grad() was deleted" in shown                  # said, prediction or not


def test_first_epochs_runs_the_shipped_script_when_the_baseline_used_other_settings(
        tmp_path, monkeypatch, capsys):
    launched = []
    monkeypatch.setattr(edited_script, "_first_epoch",
                        lambda script: launched.append(str(script)) or {"accuracy": 0.5,
                                                                         "loss": 1.0})
    copy = tmp_path / "single.py"
    copy.write_text(SHIPPED.replace("optimizer.zero_grad()", "", 1) + "\n")   # the learner's
    other = [*edited_script.DIGITS, "--batch-size", 128, "--epochs", 4]       # a Try it's flag
    outcome = edited_script.first_epochs(copy, baseline=(_Run(None), other))
    assert launched == ["ddplab.workers.single", str(copy)]
    assert not outcome.edited_for_you and outcome.zero_grad_only and outcome.truth == "same"
    shown = capsys.readouterr().out                        # no prediction: no numbers shown
    assert "set PREDICTION" in shown and "loss" not in shown and "accuracy" not in shown
    assert "was deleted" not in shown                      # the learner edited it: nothing said


def _outcome(mine, shipped=None, zero_grad_only=True):
    shipped = shipped or {"accuracy": 0.8, "loss": 0.7, "samples": 1347, "steps": 43}
    mine = {"samples": 1347, "steps": 43, **mine}
    return edited_script.Outcome(shipped, mine, edited_script.verdict(mine, shipped),
                                 zero_grad_only, False)


def test_check_passes_a_copy_without_zero_grad_that_fell_far_and_hides_it_until_predicted():
    fell = _outcome({"accuracy": 0.1, "loss": 2.3})
    assert "more than 30 points" in edited_script.check(fell, "worse")
    hidden = edited_script.check(fell)
    assert hidden.startswith("verified:") and "30" not in hidden and "worse" not in hidden


@pytest.mark.parametrize("mine", [
    {"accuracy": 0.9, "loss": 0.2},              # better: not worse
    {"accuracy": 0.1, "loss": 1.4},              # the loss only doubled, not more
    {"accuracy": 0.6, "loss": 2.3},              # the accuracy fell by only 20 points
    {"accuracy": 0.1, "loss": 2.3, "steps": 42},  # not the same run
])
def test_check_fails_a_copy_without_zero_grad_that_did_not_fall_as_expected(mine):
    with pytest.raises(AssertionError):
        edited_script.check(_outcome(mine), "worse")


def test_check_leaves_the_learners_own_experiment_unchecked():
    own = _outcome({"accuracy": 0.9, "loss": 0.2}, zero_grad_only=False)
    assert edited_script.check(own).startswith("your own experiment: not checked;")
    assert "loss 0.200" in edited_script.check(own, "same")
