"""ddplab.schedule: the LR scaled with the global batch, and the linear warm-up."""

from __future__ import annotations

import pytest

from ddplab import schedule


def test_linear_lr_scaling_and_warmup() -> None:
    assert schedule.effective_lr(0.1, 4, 2, scale_lr=True) == pytest.approx(0.8)
    assert schedule.effective_lr(0.1, 4, 2, scale_lr=False) == 0.1
    assert [schedule.lr_at(s, 1.0, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert schedule.lr_at(0, 0.3, 0) == 0.3

