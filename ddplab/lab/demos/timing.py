"""Timing tools for the notebook kernel (lesson 01).

Kernel side (see ``ddplab.lab.demos``): nothing here touches a GPU.

- ``benchmark``: ``torch.utils.benchmark``, imported without the notice its import of
  ``torch.utils.cpp_extension`` logs when no CUDA toolkit is installed (``CUDA_HOME``), a notice
  about compiling C++ extensions that has nothing to do with timing.
- ``time_step_two_ways``: one step timed by hand and with ``Timer``, in alternating rounds;
  ``StepTimes.report()`` prints the medians, the middle halves and how the two compare.

Lesson: 01.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Sequence

import torch


def benchmark() -> ModuleType:
    """Return ``torch.utils.benchmark``, its import's ``CUDA_HOME`` notice silenced.

    Example::

        >>> benchmark().Timer.__name__
        'Timer'

    Lesson: 01.
    """
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils import benchmark as module

    return module


@dataclass(frozen=True)
class StepTimes:
    """One step timed two ways, in alternating rounds (:func:`time_step_two_ways`)."""

    first: float              # the very first step's reading, its one-off costs included
    by_hand: list[float]      # one time.perf_counter() reading per step, after the first
    timer: Any                # Timer's measurements of every round, merged: seconds per step
    rounds: int               # rounds of (readings by hand, then Timer.blocked_autorange)
    steps_per_block: tuple[int, ...] = ()   # the steps in each round's Timer blocks

    @property
    def hand_median(self) -> float:
        """The median of the readings by hand (the first step left out)."""
        return statistics.median(self.by_hand)

    @property
    def middle_halves(self) -> dict[str, tuple[float, float]]:
        """Each method's first and third quartiles, in seconds: its middle half of the repeats."""
        return {"by hand": middle_half(self.by_hand), "Timer": middle_half(self.timer.times)}

    def report(self) -> str:
        """The first step, both medians and middle halves, and how the two medians compare.

        Where the two middle halves overlap, the medians' difference is called within noise;
        otherwise the report says which method read the step shorter, and by how much.
        """
        hand, timer = self.hand_median, self.timer.median
        (hand_low, hand_high), (timer_low, timer_high) = self.middle_halves.values()
        lines = [f"first step:     {self.first * 1e3:6.2f} ms (its one-off costs included)",
                 f"median by hand: {hand * 1e3:6.2f} ms, of {len(self.by_hand)} readings",
                 f"median, Timer:  {timer * 1e3:6.2f} ms, of {len(self.timer.times)} blocks"
                 + self._block_size()]
        for method, (low, high) in self.middle_halves.items():
            lines.append(f"middle half, {method + ':':<8} {low * 1e3:.2f} to {high * 1e3:.2f} ms")
        gap = abs(hand / timer - 1)
        if hand_low <= timer_high and timer_low <= hand_high:
            verdict = f"the medians differ by {gap:.0%}, within noise: the middle halves overlap"
        else:
            shorter = "by hand than with Timer" if hand < timer else "with Timer than by hand"
            verdict = (f"the median step read {gap:.0%} shorter {shorter}; the middle halves "
                       "do not overlap")
        lines += ["", f"the first step took {self.first / hand:.1f} times the median one", verdict]
        return "\n".join(lines)

    def _block_size(self) -> str:
        sizes = sorted(set(self.steps_per_block))
        if not sizes:
            return ""
        steps = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]}"
        return f" of {steps} step{'' if sizes == [1] else 's'} each"


def time_step_two_ways(step: Callable[[], Any], rounds: int = 5,
                       seconds: float = 0.05) -> StepTimes:
    """Time ``step`` by hand and with ``torch.utils.benchmark.Timer``, alternately, on 1 thread.

    The first call is read alone (its one-off costs). Then each round reads the clock around
    single calls for ``seconds``, and lets ``Timer.blocked_autorange(min_run_time=seconds)``
    time blocks of calls: a busy stretch of the machine falls on both methods, not on one.
    Timer's clock is ``time.perf_counter`` (its default would synchronize a GPU). The number
    of threads torch uses is set to 1, Timer's default, and restored even on an error.
    Timer picks its block size from the step's time: one step per block when a step is long.

    Args:
        step: the work to time, called with no arguments.
        rounds: how many times the two methods take turns.
        seconds: how long each method times in each round.

    Returns:
        :class:`StepTimes`; ``timer.median`` is Timer's median per step.

    Lesson: 01.
    """
    bench = benchmark()
    timer = bench.Timer("step()", globals={"step": step}, timer=time.perf_counter)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first, by_hand, measured = _reading(step), [], []
        for _ in range(rounds):
            end = time.perf_counter() + seconds
            while not by_hand or time.perf_counter() < end:
                by_hand.append(_reading(step))
            measured.append(timer.blocked_autorange(min_run_time=seconds))
    finally:
        torch.set_num_threads(threads)
    merged, = bench.Measurement.merge(measured)
    return StepTimes(first, by_hand, merged, rounds, tuple(m.number_per_run for m in measured))


def middle_half(times: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles of ``times``: the middle half of the repeats lies between
    them (one reading: that reading twice)."""
    if len(times) < 2:
        return times[0], times[0]
    low, _, high = statistics.quantiles(times, n=4, method="inclusive")
    return low, high


def _reading(step: Callable[[], Any]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start
