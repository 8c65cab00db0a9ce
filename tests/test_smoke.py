"""One launch per engine, end to end: what ``make test-fast`` runs after the tests that start no
process. Each launch runs a script that knows nothing of ddplab's launcher, on 2 gloo ranks, and
is checked by what every rank printed and how it exited."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddplab import launch

SCRIPTS = Path(__file__).resolve().parent / "scripts"

pytestmark = pytest.mark.launch


def test_torchrun_engine_runs_a_plain_torchrun_script_on_two_ranks():
    result = launch(SCRIPTS / "plain.py", 2, quiet=True, live=False, timeout=300)
    assert result.ok, result.error
    assert result.exit_codes == {0: 0, 1: 0}
    for rank in (0, 1):
        assert f"rank {rank} of 2: sum 3" in result.logs[rank]


def test_spawn_engine_runs_an_mp_spawn_script_that_starts_two_ranks():
    result = launch(SCRIPTS / "spawn_min.py", 2, engine="spawn", args=["--nprocs", "2"],
                    quiet=True, live=False, timeout=300)
    assert result.ok, result.error
    assert result.engine == "spawn" and result.returncode == 0
    lines = [line for lines in result.logs.values() for line in lines]
    assert sum("sum=3.0" in line for line in lines) == 2, lines
