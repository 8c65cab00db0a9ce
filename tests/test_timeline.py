"""ddplab.lab.timeline's per-stage measures: busy shares and the time two stages overlap."""

from __future__ import annotations

import pytest

from ddplab.lab import timeline


def spans(*rows: tuple[int, str, int, float, float], micro_batches: int = 1) -> list[dict]:
    return [{"rank": r, "phase": p, "micro": m, "start": a, "end": b,
             "micro_batches": micro_batches} for r, p, m, a, b in rows]


TURNS = spans((0, "forward", 0, 0, 1), (1, "forward", 0, 1, 2), (1, "backward", 0, 2, 4),
              (0, "backward", 0, 4, 6))
OVERLAPPED = spans((0, "forward", 0, 0, 1), (0, "forward", 1, 1, 2),
                   (1, "forward", 0, 1, 2), (1, "forward", 1, 2, 3), micro_batches=2)


def test_busy_shares_are_each_ranks_busy_time_over_the_step_and_match_the_bubble():
    assert timeline.busy_shares(TURNS) == {0: pytest.approx(3 / 6), 1: pytest.approx(3 / 6)}
    assert timeline.busy_shares(OVERLAPPED) == {0: pytest.approx(2 / 3), 1: pytest.approx(2 / 3)}
    for run in (TURNS, OVERLAPPED):
        shares = timeline.busy_shares(run)
        assert 1 - sum(shares.values()) / len(shares) == pytest.approx(timeline.bubble(run))
    slow = [{**s, "start": 3 * s["start"], "end": 3 * s["end"]} for s in OVERLAPPED]
    assert timeline.busy_shares(slow) == pytest.approx(timeline.busy_shares(OVERLAPPED))
    with pytest.raises(ValueError, match="no spans"):
        timeline.busy_shares([])


def test_overlap_is_zero_for_turns_and_the_shared_time_otherwise():
    assert timeline.overlap(TURNS) == 0.0                   # touching spans do not overlap
    assert timeline.overlap(OVERLAPPED) == pytest.approx(1.0)    # from 1 to 2 both ran
    three = spans((0, "forward", 0, 0, 4), (1, "forward", 0, 1, 3), (2, "forward", 0, 2, 5))
    assert timeline.overlap(three) == pytest.approx(3.0)     # 1..4: two or three at once


def test_with_gaps_reads_the_hand_off_gaps_and_adds_them_to_the_ideal_step():
    # 2 micro-batches, a work unit of 1 per pass, each hand-off 0.5: rank 0 forwards at 0 and 1.5
    run = spans((0, "forward", 0, 0, 1), (0, "forward", 1, 1.5, 2.5),
                (1, "forward", 0, 1.5, 2.5), (1, "forward", 1, 3, 4),
                (1, "backward", 1, 4, 5), (1, "backward", 0, 5.5, 6.5),
                (0, "backward", 1, 5.5, 6.5), (0, "backward", 0, 7, 8), micro_batches=2)
    assert timeline.handoff_gaps(run, 0, "forward") == [0.5]
    assert timeline.handoff_gaps(run, 1, "backward") == [0.5]
    model = timeline.with_gaps(run)
    assert model["gap"] == 0.5 and model["work"] == 4
    step = 3 / 2 * 4 + 2 * 2 * 0.5           # (M + S - 1) / M x work + 2 (M + S - 2) gaps
    assert model["idle"] == pytest.approx(1 - 4 / step)
    assert timeline.with_gaps(TURNS)["gap"] == 0.0     # one micro-batch: no gap to read
    assert timeline.with_gaps(TURNS)["idle"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no spans"):
        timeline.with_gaps([])
