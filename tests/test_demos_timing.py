"""ddplab.lab.demos.timing: torch.utils.benchmark for the kernel, without the CUDA_HOME notice."""

from __future__ import annotations

import logging

from ddplab.lab.demos import timing


def test_benchmark_is_torch_utils_benchmark_with_the_extension_notice_silenced():
    import torch.utils.benchmark

    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        assert timing.benchmark() is torch.utils.benchmark
        assert logger.getEffectiveLevel() == logging.ERROR      # notices and warnings dropped
    finally:
        logger.setLevel(level)


def test_time_step_two_ways_alternates_on_one_thread_and_restores_the_threads():
    import statistics
    import time

    import torch

    calls = []

    def step():
        calls.append(torch.get_num_threads())
        time.sleep(0.001)

    threads = torch.get_num_threads()
    times = timing.time_step_two_ways(step, rounds=3, seconds=0.01)
    assert set(calls) == {1} and torch.get_num_threads() == threads
    assert times.rounds == 3 and len(times.by_hand) >= 3 and times.first >= 0.001
    assert times.hand_median == statistics.median(times.by_hand)
    assert len(times.timer.times) >= 3 and times.timer.median >= 0.001      # per step
    assert len(times.steps_per_block) == 3 and min(times.steps_per_block) >= 1


def test_a_step_longer_than_the_run_time_gets_blocks_of_one_step():
    import time

    times = timing.time_step_two_ways(lambda: time.sleep(0.02), rounds=2, seconds=0.01)
    assert times.steps_per_block == (1, 1)   # one step outlasts min_run_time: no bigger block
    assert " blocks of 1 step each" in times.report()


def test_time_step_two_ways_restores_the_threads_after_an_error():
    import torch

    threads = torch.get_num_threads()

    def step():
        raise RuntimeError("boom")

    try:
        timing.time_step_two_ways(step, rounds=1, seconds=0.01)
    except RuntimeError:
        pass
    assert torch.get_num_threads() == threads


def _times(by_hand, timer_times):
    from types import SimpleNamespace
    import statistics

    timer = SimpleNamespace(times=timer_times, median=statistics.median(timer_times))
    return timing.StepTimes(first=0.01, by_hand=by_hand, timer=timer, rounds=len(by_hand))


def test_report_calls_overlapping_middle_halves_within_noise():
    times = _times([0.0010, 0.0011, 0.0012, 0.0013, 0.0014], [0.0011, 0.0012, 0.0013])
    import pytest

    assert times.middle_halves == {"by hand": pytest.approx((0.0011, 0.0013)),
                                   "Timer": pytest.approx((0.00115, 0.00125))}
    report = times.report()
    assert "within noise: the middle halves overlap" in report and "shorter" not in report
    assert "middle half, by hand: 1.10 to 1.30 ms" in report


def test_report_names_the_shorter_method_when_the_middle_halves_are_apart():
    times = _times([0.0010, 0.0010, 0.0010], [0.0020, 0.0020, 0.0020])
    report = times.report()
    assert "read 50% shorter by hand than with Timer" in report and "within noise" not in report
    assert report.splitlines()[-2] == "the first step took 10.0 times the median one"
