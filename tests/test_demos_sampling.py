"""ddplab.lab.demos.sampling: the facts lesson 04 states about DistributedSampler are true."""

from __future__ import annotations

import pytest

from ddplab.lab.demos import error_of, sampling


@pytest.mark.parametrize("length,world", [(10, 3), (12, 4), (7, 8), (1347, 2)])
def test_shares_cover_the_dataset_with_equal_lengths(length, world):
    shares = sampling.sampler_shares(length, world)
    assert len({len(s) for s in shares}) == 1
    read = [i for s in shares for i in s]
    assert set(read) == set(range(length))
    facts = sampling.padding(length, world)
    assert facts["read"] == len(read) and facts["repeats"] == len(read) - length


def test_drop_last_never_repeats_and_may_leave_samples_unread():
    facts = sampling.padding(10, 3, drop_last=True)
    assert facts == {"per_rank": 3, "read": 9, "repeats": 0, "unread": 1}
    shares = sampling.sampler_shares(10, 3, drop_last=True)
    assert len(set().union(*map(set, shares))) == 9


def test_is_padding_marks_exactly_the_repeats():
    length, world = 10, 4
    shares = sampling.sampler_shares(length, world, shuffle=False)
    marked = [shares[r][p] for r in range(world) for p in range(len(shares[r]))
              if sampling.is_padding(p, r, length, world)]
    assert sorted(marked) == [0, 1]  # without shuffle the first indices are repeated


def test_orders_repeat_without_set_epoch_and_change_with_it():
    without = sampling.epoch_orders(20, 2, 3, set_epoch=False)
    with_ = sampling.epoch_orders(20, 2, 3, set_epoch=True)
    assert without[0] == without[1] == without[2]
    assert with_[0] == without[0]  # set_epoch(0) is the default epoch
    assert with_[1] != with_[0] and with_[2] != with_[1]


def test_padding_biases_a_sharded_evaluation():
    correct = [False, False] + [True] * 8
    true, padded = sampling.padded_accuracy(correct, 4)
    assert true == 0.8 and padded == pytest.approx(8 / 12)


def test_error_of_returns_the_exception_or_none():
    assert isinstance(error_of(lambda: 1 / 0), ZeroDivisionError)
    assert error_of(lambda: None) is None


def _events(losses):
    """Fake ``epoch`` events: ``losses[(epoch, rank)]`` with a short order each."""
    return [{"epoch": e, "rank": r, "loss": loss, "order": [e, r, 9, 8, 7, 6, 5]}
            for (e, r), loss in losses.items()]


def test_identical_loss_epochs_needs_every_rank_equal():
    with_set = sampling.by_epoch_and_rank(_events({(1, 0): 1.0, (1, 1): 2.0, (2, 0): 0.5,
                                                   (2, 1): 0.7, (3, 0): 0.4, (3, 1): 0.3}))
    without = sampling.by_epoch_and_rank(_events({(1, 0): 1.0, (1, 1): 2.0, (2, 0): 0.5,
                                                  (2, 1): 0.8, (3, 0): 0.1, (3, 1): 0.2}))
    assert sampling.identical_loss_epochs(with_set, without) == {1}   # epoch 2: rank 1 differs
    rows = sampling.side_by_side(with_set, without, first=3)
    assert [(row["epoch"], row["rank"]) for row in rows] == sorted(with_set)
    assert rows[3]["loss, set_epoch"] == "0.700000" and rows[3]["loss, no set_epoch"] == "0.800000"
    assert rows[0]["first indices, set_epoch"] == [1, 0, 9]


def test_distinct_batches_without_set_epoch_are_one_epoch_s_worth():
    kept = sampling.distinct_batches(100, 2, 8, epochs=5, set_epoch=False)
    fresh = sampling.distinct_batches(100, 2, 8, epochs=5, set_epoch=True)
    assert kept == {"batches": 35, "distinct": 7}         # ceil(50 / 8) = 7 batches, 5 times
    assert fresh == {"batches": 35, "distinct": 35}       # a new grouping every epoch
    other = sampling.distinct_batches(100, 2, 8, epochs=1, rank=1)
    assert other["batches"] == 7


def test_never_read_without_set_epoch_leaves_the_same_samples_out():
    without = sampling.never_read(1347, 2, 30, set_epoch=False, drop_last=True)
    with_ = sampling.never_read(1347, 2, 30, set_epoch=True, drop_last=True)
    assert without == {"per_rank": [674, 674], "by_all": 1}   # one share each; 1347 mod 2 cut
    assert with_ == {"per_rank": [0, 0], "by_all": 0}
    padded = sampling.never_read(10, 3, 1, set_epoch=False, drop_last=False)
    assert padded["by_all"] == 0                             # padding reads every sample
