"""Which way this run's launches start their workers, by the launcher's own rule
(``ddplab.env.no_fork_reason``): forked from a warm helper (Linux), or one cold
``python -m torch.distributed.run`` subprocess a launch (macOS, Windows, and any run with
``DDPLAB_LAUNCH_PATH=subprocess``, as ``make test-cold`` sets for the whole suite).

A test of a fact of the fork path alone skips off it and says why (``needs_fork``); a test
whose launch timeout was sized for the fork path's speed adds ``COLD_START_S`` off it
(``launch_timeout``). The doctor lists how launches start among its problems off the fork
path: a test of the machine's problems reads them without it (``machine_problems``).
"""

from __future__ import annotations

import pytest

from ddplab.env import no_fork_reason

#: Seconds a launch's timeout allows on the cold path beyond the fork path's: there each launch
#: starts torchrun and every rank imports torch afresh before the job's own code runs. Measured
#: on a 2-core machine: a cold 4-rank launch of exercise 08's solution takes 5 s alone, and
#: 11-14 s with a second such launch beside it and two busy cores (a parallel test run's load);
#: a forked one, about a tenth of a second before the same code runs.
COLD_START_S = 30.0


def cold() -> bool:
    """True when launches here are cold torchrun subprocesses (they cannot fork)."""
    return no_fork_reason() is not None


def needs_fork() -> None:
    """Skip a test of the fork path where launches cannot fork (as with
    ``DDPLAB_LAUNCH_PATH=subprocess`` set for a whole run)."""
    if cold():
        pytest.skip(f"tests the fork path, and launches cannot fork here: {no_fork_reason()}")


def launch_timeout(seconds: float) -> float:
    """A launch timeout sized for the fork path, with the cold start added off it."""
    return seconds + COLD_START_S if cold() else seconds


def machine_problems(found: list) -> list:
    """The doctor's ``(problem, fix)`` pairs but its notice of how launches start, which it
    gives exactly once where launches cannot fork (``test_doctor_says_how_launches_start_here``
    reads it) and never where they can: what remains is about the machine alone."""
    notices = [pair for pair in found if pair[0].startswith("launches cannot fork")]
    assert len(notices) == (1 if cold() else 0), found
    return [pair for pair in found if pair not in notices]
